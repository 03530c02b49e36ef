"""tests/test_launch_shapes.py: a route and its launch cannot disagree.

tests/c/test_launch_shapes.cu asks, for every route c/routes.c chooses over a sweep of problems,
the one switch per pass that turns a route into a kernel instance (kernels/forward.cuh
with_forward_kernel, kernels/backward.cuh with_backward_kernel): an instance must exist, and
the grid the route sized must be the one that instance's block takes (the block sizes:
c/launch.h). It is host code: nvcc compiles it and cc compiles c/routes.c, and it runs without
a GPU. Skipped where no nvcc is found (NVCC, the PATH, /usr/local/cuda/bin).
"""
import os
import shutil
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def find_nvcc():
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if candidate and os.access(candidate, os.X_OK):
            return candidate
    return None


NVCC = find_nvcc()
needs_sources = pytest.mark.skipif(
    not os.path.isfile(os.path.join(REPO, "tests", "c", "test_launch_shapes.cu")),
    reason="the C sources (a source checkout) are missing")


@needs_sources
@pytest.mark.skipif(NVCC is None, reason="no nvcc to compile the kernels' launch code")
def test_every_route_has_a_kernel_instance_whose_block_its_grid_was_sized_for(tmp_path):
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    routes = tmp_path / "routes.o"
    subprocess.run([cc, "-std=c11", "-O1", "-I" + os.path.join(REPO, "c"), "-c",
                    os.path.join(REPO, "c", "routes.c"), "-o", str(routes)], check=True)
    binary = tmp_path / "test_launch_shapes"
    built = subprocess.run([NVCC, "-std=c++17", "-I" + os.path.join(REPO, "c"), "-o", str(binary),
                            os.path.join(REPO, "tests", "c", "test_launch_shapes.cu"),
                            str(routes)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stdout + built.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and " 0 failed" in run.stdout, run.stdout + run.stderr

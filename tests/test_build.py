"""tests/test_build.py: what the Makefile finds and remembers, and what the wheel promises.

- nvcc: the PATH's, else the usual toolkit folders, else the CUDA compiler pip installs into the
  Python's environment (nvidia/cu13/bin/nvcc); without any, `make info` names the pip command.
  Checked with a stand-in nvcc in a scratch site-packages folder, so nothing is compiled.
- A build folder remembers MSDA_CUDA=0 when the user chose it, not when nvcc was missing.
- The wheel's platform tag tells the truth: a manylinux_2_<N> library needs only glibc's own
  libraries at GLIBC versions up to 2.<N>, names no OpenMP library and leaves no OpenMP symbol to
  the loader (c/omp_runtime.c binds them at run time), and exports only msda_* and ONNX
  Runtime's RegisterCustomOps (checked on the loaded library, e.g. the wheel tests/matrix.py
  installs).
"""
import os
import re
import shutil
import subprocess
import sys

import pytest

import pymsda

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
needs_make = pytest.mark.skipif(shutil.which("make") is None or
                                not os.path.isfile(os.path.join(REPO, "Makefile")),
                                reason="make or the Makefile (source checkout) is missing")

FAKE_NVCC = """#!/bin/sh
case "$*" in
  *--version*) echo "Cuda compilation tools, release 13.9, V13.9.1" ;;
  *--dryrun*) echo "#\\$ TOP=$(dirname "$0")/.." >&2 ;;
  *--list-gpu-arch*) printf 'compute_75\\ncompute_90\\n' ;;
esac
"""


def pip_site(tmp_path):
    """A site-packages folder holding a stand-in for pip's CUDA 13 compiler; returns (site, nvcc)."""
    site = tmp_path / "site-packages"
    nvcc = site / "nvidia" / "cu13" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    return site, nvcc


def run_make(tmp_path, *targets, site=None):
    """make in the checkout with no nvcc on the PATH nor in the toolkit folders, a scratch build
    folder, and a Python that sees `site` but not its own site-packages (python -S: this
    environment may hold pip's nvcc)."""
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not os.path.exists(os.path.join(d, "nvcc"))]
    env = {k: v for k, v in os.environ.items() if k not in ("NVCC", "MSDA_CUDA", "CUDA_HOME",
                                                            "MAKEFLAGS", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(path)
    if site:
        env["PYTHONPATH"] = str(site)
    done = subprocess.run(["make", "--no-print-directory", "-C", REPO, "BUILD=" + str(tmp_path / "b"),
                           "NVCC_FOLDERS=", "PYTHON=%s -S" % sys.executable] + list(targets),
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@needs_make
def test_make_finds_the_cuda_compiler_pip_installed(tmp_path):
    site, nvcc = pip_site(tmp_path)
    info = run_make(tmp_path, "info", site=site)
    assert f"nvcc:          {nvcc} (CUDA 13.9)" in info
    assert "CUDA kernels:  yes" in info
    assert f"CUDA_HOME:     {os.path.realpath(nvcc.parent.parent)}" in info


@needs_make
def test_make_info_names_the_pip_command_when_no_nvcc_is_found(tmp_path):
    info = run_make(tmp_path, "info")
    assert "nvcc:          not found" in info
    assert re.search(r'pip install "cuda-toolkit\[nvcc,cccl\]==13\.\d+\.\*"', info), info
    assert "driver 580+" in info
    assert "CUDA kernels:  no (nvcc not found)" in info


@needs_make
def test_cpu_only_from_a_missing_nvcc_is_not_remembered(tmp_path):
    run_make(tmp_path, str(tmp_path / "b" / "config"))  # what a build writes first
    choice = (tmp_path / "b" / "choice.mk").read_text()
    assert re.search(r"^REMEMBERED_MSDA_CUDA := *$", choice, re.M), choice
    site, _ = pip_site(tmp_path)
    assert "CUDA kernels:  yes" in run_make(tmp_path, "info", site=site)


@needs_make
def test_an_explicit_msda_cuda_0_is_remembered(tmp_path):
    site, _ = pip_site(tmp_path)
    run_make(tmp_path, str(tmp_path / "b" / "config"), "MSDA_CUDA=0", site=site)
    assert "REMEMBERED_MSDA_CUDA := 0" in (tmp_path / "b" / "choice.mk").read_text()
    assert "CUDA kernels:  no (MSDA_CUDA=0)" in run_make(tmp_path, "info", site=site)


@needs_make
def test_a_remembered_0_from_before_the_distinction_looks_for_nvcc_again(tmp_path):
    (tmp_path / "b").mkdir()
    (tmp_path / "b" / "choice.mk").write_text(
        "REMEMBERED_MSDA_CUDA := 0\nREMEMBERED_CUDA_ARCHS := \nREMEMBERED_CUDA_PTX := \n")
    site, _ = pip_site(tmp_path)
    assert "CUDA kernels:  yes" in run_make(tmp_path, "info", site=site)


# ---- the wheel's promise ------------------------------------------------------------------------

def backend():
    sys.path.insert(0, os.path.join(REPO, "pymsda"))
    try:
        import _build_backend
    finally:
        sys.path.pop(0)
    return _build_backend


def readelf(*args):
    if shutil.which("readelf") is None:
        pytest.skip("readelf is not installed")
    return subprocess.run(["readelf", "--wide"] + list(args) + [pymsda.library_path()],
                          check=True, capture_output=True, text=True).stdout


def test_a_manylinux_tag_is_what_the_loaded_library_needs():
    tag = backend()._platform_tag(pymsda.library_path())
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", readelf("--dynamic"))
    if not tag.startswith("manylinux_"):
        assert tag.startswith("linux_")
        pytest.skip(f"not a portable library (needs {needed}): the portable one is make wheel's")
    floor = int(re.match(r"manylinux_2_(\d+)_", tag).group(1))
    assert set(needed) <= backend().GLIBC_LIBRARIES, needed
    glibc = [int(m) for m in re.findall(r"\bGLIBC_2\.(\d+)", readelf("--version-info"))]
    # the tag is the highest glibc it needs, never below make wheel's floor (Makefile: GLIBC_FLOOR)
    assert glibc and floor == max(max(glibc), backend().MANYLINUX_FLOOR), (tag, max(glibc))
    symbols = readelf("--dyn-syms")
    exported = re.findall(r"\s(?:FUNC|OBJECT)\s+GLOBAL\s+DEFAULT\s+\d+\s+(\S+)", symbols)
    assert "RegisterCustomOps" in exported  # ONNX Runtime's entry (c/ort_op.c)
    assert all(name.startswith("msda_") or name == "RegisterCustomOps" for name in exported), \
        exported
    # Nothing undefined without a version: the OpenMP entry points are the library's own
    # (c/omp_runtime.c), bound at run time, so no runtime has to be there when it loads.
    unversioned = re.findall(r"\sGLOBAL\s+DEFAULT\s+UND\s+([^@\s]+)$", symbols, re.M)
    assert not unversioned, unversioned

"""tests/test_build.py: what the Makefile finds and remembers, and what the wheel promises.

- nvcc: the PATH's, else the usual toolkit folders, else the CUDA compiler pip installs into the
  Python's environment (nvidia/cu13/bin/nvcc); without any, `make info` names the pip command.
  Checked with a stand-in nvcc in a scratch site-packages folder, so nothing is compiled.
- What a plain `make` builds, said in the one line it starts with: CUDA kernels where nvcc is
  found and a GPU is visible (for the GPUs' architectures: a stand-in nvidia-smi) or torch is a
  CUDA build (the default list: a stand-in torch/version.py, read, never imported), else CPU-only;
  MSDA_CUDA and CUDA_ARCHS, named, win. An automatic CUDA choice is remembered, a CPU-only one not.
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
  *--list-gpu-arch*) printf 'compute_%s\\n' 75 80 86 90 100 120 ;;
esac
"""
DEFAULT_LIST = "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 compute_90"  # the Makefile's, as FAKE_NVCC knows it


def pip_site(tmp_path):
    """A site-packages folder holding a stand-in for pip's CUDA 13 compiler; returns (site, nvcc)."""
    site = tmp_path / "site-packages"
    nvcc = site / "nvidia" / "cu13" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(0o755)
    return site, nvcc


def fake_torch(site, version, cuda):
    """torch/version.py as torch writes it, in `site` (make reads it; nothing imports it)."""
    folder = site / "torch"
    folder.mkdir(parents=True)
    (folder / "__init__.py").write_text("raise ImportError('make must not import torch')\n")
    (folder / "version.py").write_text(
        f"from typing import Optional\n__version__ = {version!r}\ndebug = False\n"
        f"cuda: Optional[str] = {cuda!r}\n")


def fake_gpus(tmp_path, *capabilities):
    """An nvidia-smi that answers --query-gpu=compute_cap for these GPUs; none: it fails, as
    on a machine with the tools but no driver."""
    script = tmp_path / "nvidia-smi"
    lines = "".join(f"echo {c}\n" for c in capabilities)
    script.write_text("#!/bin/sh\n" + (lines or "echo 'NVIDIA-SMI has failed'\nexit 9\n"))
    script.chmod(0o755)
    return f"GPU_QUERY={script}"


def run_make(tmp_path, *targets, site=None):
    """make in the checkout with no nvcc on the PATH nor in the toolkit folders, a scratch build
    folder, and a Python that sees `site` but not its own site-packages (python -S: this
    environment may hold pip's nvcc and torch). No GPU unless a target says GPU_QUERY=...:
    the machine's own are hidden."""
    path = [d for d in os.environ.get("PATH", "").split(os.pathsep)
            if d and not os.path.exists(os.path.join(d, "nvcc"))]
    env = {k: v for k, v in os.environ.items() if k not in ("NVCC", "MSDA_CUDA", "CUDA_HOME",
                                                            "MAKEFLAGS", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(path)
    if site:
        env["PYTHONPATH"] = str(site)
    done = subprocess.run(["make", "--no-print-directory", "-C", REPO, "BUILD=" + str(tmp_path / "b"),
                           "NVCC_FOLDERS=", "PYTHON=%s -S" % sys.executable, "GPU_QUERY=false",
                           "GPU_DEVICES="] + list(targets),
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


@needs_make
def test_make_finds_the_cuda_compiler_pip_installed(tmp_path):
    site, nvcc = pip_site(tmp_path)
    fake_torch(site, "2.14.1+cu130", "13.0")
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
    assert "CUDA kernels:  no (nvcc not found: make info says how" in info


@needs_make
def test_make_info_names_the_cuda_of_a_cuda_torch_in_the_pip_command(tmp_path):
    site = tmp_path / "site-packages"
    fake_torch(site, "2.16.0+cu132", "13.2")
    info = run_make(tmp_path, "info", site=site)
    assert 'pip install "cuda-toolkit[nvcc,cccl]==13.2.*"' in info
    assert "torch 2.16.0+cu132 uses CUDA 13.2" in info


@needs_make
def test_without_a_gpu_or_a_cuda_torch_make_builds_cpu_only_and_says_how_to_get_cuda(tmp_path):
    site, _ = pip_site(tmp_path)
    fake_torch(site, "2.13.0+cpu", None)
    info = run_make(tmp_path, "info", site=site)
    assert ("CUDA kernels:  no (no GPU visible, and torch 2.13.0+cpu has no CUDA: make "
            "MSDA_CUDA=1 builds them too") in info, info
    assert "architectures: \n" in info
    # the line the build starts with (the stamp the compilers wait for; nothing is compiled)
    started = run_make(tmp_path, str(tmp_path / "b" / "started"), site=site)
    assert started.count("\n") == 1 and started.startswith(
        f"building {tmp_path / 'b' / 'libpymsda.so'}: C ("), started
    assert "no CUDA kernels (no GPU visible" in started and "MSDA_CUDA=1" in started
    # not remembered: once a GPU is here, the next make builds for it
    assert re.search(r"^REMEMBERED_MSDA_CUDA := *$", (tmp_path / "b" / "choice.mk").read_text(),
                     re.M)
    info = run_make(tmp_path, "info", fake_gpus(tmp_path, "9.0"), site=site)
    assert "CUDA kernels:  yes (a GPU is visible" in info and "architectures: sm_90 compute_90\n" in info


@needs_make
def test_make_builds_for_the_gpus_it_sees(tmp_path):
    site, _ = pip_site(tmp_path)
    fake_torch(site, "2.13.0+cpu", None)  # the GPU decides, whatever torch is
    info = run_make(tmp_path, "info", fake_gpus(tmp_path, "9.0", "8.6", "9.0"), site=site)
    assert "CUDA kernels:  yes (a GPU is visible: for the GPUs here only" in info, info
    assert "architectures: sm_86 sm_90 compute_90\n" in info
    started = run_make(tmp_path, str(tmp_path / "b" / "started"),
                       fake_gpus(tmp_path, "9.0", "8.6"), site=site)
    assert "CUDA 13.9 kernels for sm_86 sm_90 compute_90 (a GPU is visible" in started, started
    assert started.count("\n") == 1


@needs_make
def test_a_gpu_this_nvcc_cannot_target_gets_the_default_list(tmp_path):
    site, _ = pip_site(tmp_path)
    info = run_make(tmp_path, "info", fake_gpus(tmp_path, "12.1"), site=site)
    assert f"architectures: {DEFAULT_LIST}\n" in info
    assert "sm_121 (the GPU here) is not among this nvcc's targets" in info, info


@needs_make
def test_a_cuda_torch_without_a_gpu_builds_the_default_list(tmp_path):
    site, _ = pip_site(tmp_path)
    fake_torch(site, "2.14.1+cu130", "13.0")
    info = run_make(tmp_path, "info", site=site)
    assert "CUDA kernels:  yes (no GPU visible, but torch 2.14.1+cu130 is a CUDA 13.0 build" in info
    assert f"architectures: {DEFAULT_LIST}\n" in info


@needs_make
@pytest.mark.parametrize("named,architectures", [
    ("MSDA_CUDA=1", DEFAULT_LIST),  # a container build: no GPU visible, a CPU torch
    ("CUDA_ARCHS=80", "sm_80 compute_80"),
    ("CUDA_ARCHS=default", DEFAULT_LIST),
    ("CUDA_ARCHS=all", "sm_75 sm_80 sm_86 sm_90 sm_100 sm_120 compute_120"),
])
def test_named_cuda_choices_win_over_the_machine(tmp_path, named, architectures):
    site, _ = pip_site(tmp_path)
    fake_torch(site, "2.13.0+cpu", None)
    info = run_make(tmp_path, "info", named, site=site)
    assert f"CUDA kernels:  yes ({named}" in info, info
    assert f"architectures: {architectures}\n" in info


@needs_make
def test_msda_cuda_0_wins_over_a_gpu(tmp_path):
    site, _ = pip_site(tmp_path)
    info = run_make(tmp_path, "info", "MSDA_CUDA=0", fake_gpus(tmp_path, "9.0"), site=site)
    assert "CUDA kernels:  no (MSDA_CUDA=0)" in info


@needs_make
def test_an_automatic_cuda_choice_is_remembered_when_the_gpu_is_gone(tmp_path):
    site, _ = pip_site(tmp_path)
    run_make(tmp_path, str(tmp_path / "b" / "config"), fake_gpus(tmp_path, "9.0"), site=site)
    assert "REMEMBERED_CUDA_ARCHS := 90" in (tmp_path / "b" / "choice.mk").read_text()
    info = run_make(tmp_path, "info", site=site)  # no GPU now (a container), a CPU-only torch
    assert "CUDA kernels:  yes (remembered in" in info and "architectures: sm_90 compute_90\n" in info


@needs_make
def test_cpu_only_from_a_missing_nvcc_is_not_remembered(tmp_path):
    run_make(tmp_path, str(tmp_path / "b" / "config"))  # what a build writes first
    choice = (tmp_path / "b" / "choice.mk").read_text()
    assert re.search(r"^REMEMBERED_MSDA_CUDA := *$", choice, re.M), choice
    site, _ = pip_site(tmp_path)
    fake_torch(site, "2.14.1+cu130", "13.0")
    assert "CUDA kernels:  yes" in run_make(tmp_path, "info", site=site)


@needs_make
def test_an_explicit_msda_cuda_0_is_remembered(tmp_path):
    site, _ = pip_site(tmp_path)
    run_make(tmp_path, str(tmp_path / "b" / "config"), "MSDA_CUDA=0", site=site)
    assert "REMEMBERED_MSDA_CUDA := 0" in (tmp_path / "b" / "choice.mk").read_text()
    info = run_make(tmp_path, "info", fake_gpus(tmp_path, "9.0"), site=site)
    assert "CUDA kernels:  no (MSDA_CUDA=0 remembered in" in info


@needs_make
def test_make_wheel_says_how_long_it_took(tmp_path):
    # the library is taken as built (-o: not remade), packed as it is (no zig)
    build = tmp_path / "b"
    build.mkdir()
    shutil.copy(pymsda.library_path(), build / "libpymsda.so")
    out = run_make(tmp_path, "wheel", "ZIG=", "MSDA_CUDA=0", "DIST=" + str(tmp_path / "dist"),
                   "-o", str(build / "libpymsda.so"))
    assert re.search(r"^built .*/dist/pymsda-[^ ]+\.whl in \d+ s$", out, re.M), out


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

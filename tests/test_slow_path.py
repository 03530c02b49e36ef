"""Never silently slow: a CUDA tensor that the library's kernels cannot serve runs on the
pure-PyTorch path only after a SlowPathWarning (once per process) that names the cause and the
fix, or raises RuntimeError on every such call with PYMSDA_REQUIRE_KERNELS=1.

The two causes: a library built without CUDA kernels, and one whose code does not run on the GPU
(no machine code for its architecture and no PTX the driver can compile), which the library
itself reports (c/msda.h: msda_cuda_runs_on). On the CPU the message and the switch are checked
through the function that gives them; on a GPU, in a subprocess, with a CPU-only library and
with one holding only sm_100 code (built here; each needs make, the second nvcc too).
"""
import os
import shutil
import subprocess
import sys

import pytest
import torch

import pymsda
from pymsda import _op, _clib
from conftest import REPO, requires_cuda


@pytest.fixture
def fresh(monkeypatch):
    """The once-per-process state, reset for the test; the environment switch unset."""
    monkeypatch.setattr(_op, "_slow_path_warned", False)
    monkeypatch.delenv(_op.REQUIRE_KERNELS, raising=False)
    return monkeypatch


def test_library_without_cuda_kernels_warns_once_naming_the_build(fresh, recwarn):
    fresh.setattr(_clib, "has_cuda_kernels", False)
    _op.slow_path(torch.device("cuda", 0))
    _op.slow_path(torch.device("cuda", 0))
    warned = [w for w in recwarn if issubclass(w.category, pymsda.SlowPathWarning)]
    assert len(warned) == 1
    text = str(warned[0].message)
    assert "built without CUDA kernels" in text and _clib.path in text
    assert "make && pip install ." in text and "PYMSDA_REQUIRE_KERNELS=1" in text


def test_gpu_the_kernels_do_not_run_on_names_the_library_reason_and_its_arch(fresh, recwarn):
    fresh.setattr(_clib, "has_cuda_kernels", True)
    fresh.setattr(_clib, "unserved_cuda",
                  {3: "msda_cuda_runs_on: the kernels (sm_100 compute_100) cannot run"})
    fresh.setattr(torch.cuda, "get_device_capability", lambda device: (8, 6))
    _op.slow_path(torch.device("cuda", 3))
    text = str(recwarn.pop(pymsda.SlowPathWarning).message)
    assert "cuda:3" in text and "sm_100 compute_100" in text
    assert "make CUDA_ARCHS=86" in text and "driver" in text


def test_require_kernels_raises_on_every_call(fresh):
    fresh.setattr(_clib, "has_cuda_kernels", False)
    fresh.setenv(_op.REQUIRE_KERNELS, "1")
    for _ in range(2):
        with pytest.raises(RuntimeError, match="pure-PyTorch path"):
            _op.slow_path(torch.device("cuda", 0))
    fresh.setenv(_op.REQUIRE_KERNELS, "0")  # "0" (or empty): a warning again
    with pytest.warns(pymsda.SlowPathWarning):
        _op.slow_path(torch.device("cuda", 0))


def test_cpu_calls_never_warn(recwarn, fresh):
    fresh.setenv(_op.REQUIRE_KERNELS, "1")
    value = torch.randn(1, 6, 1, 4)
    loc, attn = torch.rand(1, 2, 1, 1, 1, 2), torch.rand(1, 2, 1, 1, 1)
    pymsda.ms_deform_attn(value, [(2, 3)], None, loc, attn)
    assert not [w for w in recwarn if issubclass(w.category, pymsda.SlowPathWarning)]


def test_library_says_whether_its_kernels_run_on_a_device():
    count = _clib.lib.msda_cuda_device_count()
    assert _clib.lib.msda_cuda_runs_on(count) == 0  # one past the last device
    text = _clib.lib.msda_last_error().decode()
    if _clib.lib.msda_has_cuda():
        assert f"no CUDA device {count}" in text
    else:
        assert "no CUDA kernels" in text
    assert _clib.lib.msda_cuda_runs_on(-1) == 0


# ---- on a GPU: a library that cannot serve it, in a subprocess -------------------------------

_SCRIPT = r"""
import sys, warnings
import torch
import pymsda
from pymsda.reference import ms_deform_attn_pytorch
value = torch.randn(2, 30, 2, 8, device="cuda", requires_grad=True)
loc = torch.rand(2, 5, 2, 2, 3, 2, device="cuda", requires_grad=True)
attn = torch.rand(2, 5, 2, 2, 3, device="cuda", requires_grad=True)
shapes = [(4, 5), (2, 5)]
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        outs = [pymsda.ms_deform_attn(value, shapes, None, loc, attn) for _ in range(2)]
    except RuntimeError as error:
        print("RAISED", error)
        sys.exit(0)
outs[0].sum().backward()
slow = [str(w.message) for w in caught if issubclass(w.category, pymsda.SlowPathWarning)]
expected = ms_deform_attn_pytorch(value, shapes, loc, attn)
print("WARNINGS", len(slow))
print("SAME", bool(torch.allclose(outs[1], expected)), value.grad is not None)
print("TEXT", slow[0] if slow else "")
"""


def _build(tmp_path, name, *make_args):
    if shutil.which("make") is None:
        pytest.skip("needs make to build a library of its own")
    build = tmp_path / name
    made = subprocess.run(["make", "-C", REPO, f"BUILD={build}", f"-j{os.cpu_count() or 2}",
                           *make_args], capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    return str(build / "libpymsda.so")


def run(library, strict=False):
    env = {k: v for k, v in os.environ.items() if k != _op.REQUIRE_KERNELS}
    env["PYMSDA_LIBRARY"] = library
    if strict:
        env[_op.REQUIRE_KERNELS] = "1"
    done = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, capture_output=True,
                          text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    return dict(line.split(" ", 1) for line in done.stdout.strip().splitlines())


def _check_slow_path(library, cause):
    seen = run(library)
    assert seen["WARNINGS"] == "1"  # two calls, one warning
    assert seen["SAME"] == "True True"  # the pure-PyTorch result, with gradients
    assert cause in seen["TEXT"] and "PYMSDA_REQUIRE_KERNELS=1" in seen["TEXT"]
    raised = run(library, strict=True)
    assert "RAISED" in raised and cause in raised["RAISED"]


@requires_cuda
@pytest.mark.own_library
def test_cpu_only_library_warns_at_the_first_cuda_call(tmp_path):
    _check_slow_path(_build(tmp_path, "build-cpu", "MSDA_CUDA=0"), "built without CUDA kernels")


@requires_cuda
@pytest.mark.own_library
def test_library_without_code_for_this_gpu_warns_at_the_first_cuda_call(tmp_path):
    # machine code and PTX for sm_100 only: no code an older GPU can run (about a minute)
    if shutil.which("nvcc") is None:
        pytest.skip("needs nvcc to build an sm_100 library")
    if torch.cuda.get_device_capability() >= (10, 0):
        pytest.skip("an sm_100 library runs on this GPU")
    library = _build(tmp_path, "build-sm100", "CUDA_ARCHS=100", "CUDA_PTX=100")
    _check_slow_path(library, "cannot run on CUDA device 0")

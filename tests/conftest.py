"""tests/conftest.py: shared markers and fixtures.

CUDA tests carry `requires_cuda`: they skip (never fail) where torch sees no GPU or the library
was built without CUDA kernels, and run unchanged on a GPU machine. Every test draws its random
inputs from `generator`, seeded from the test's node id: reproducible, yet different for every
test and every parametrised case.

Features an older torch lacks are detected, not inferred from its version number: a test that
needs one skips with `requires_torch_feature(...)`, whose reason names the feature and the torch.
With PYMSDA_TEST_INSTALLED=1 (tests/matrix.py sets it) the session refuses to start unless pymsda
was imported from an installed wheel rather than from this source checkout.

The run ends with its skips counted by reason (pytest -rs says where each one was); a reason
that an install lifts names it, and README.md's "Tests" lists them.
"""
import collections
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

import pymsda
from factories import seed_of

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def pytest_report_header(config):
    return (f"pymsda: {os.path.dirname(pymsda.__file__)} (library {pymsda.library_path()}); "
            f"torch {torch.__version__}")


def pytest_configure(config):
    config.addinivalue_line("markers", "huge: CUDA tests of tens of GB (tests/test_large_problems.py)"
                            "; left out of the sanitizer runs")
    config.addinivalue_line("markers", "caching_allocator: CUDA tests that need torch's caching "
                            "allocator (graph capture; no cudaFree); left out of the sanitizer "
                            "runs, which turn it off")
    config.addinivalue_line("markers", "own_library: builds and loads a library of its own in a "
                            "subprocess (left out of the sanitizer runs of the suite)")
    if os.environ.get("PYMSDA_TEST_INSTALLED") == "1":
        for what, path in (("package", pymsda.__file__), ("library", pymsda.library_path())):
            if os.path.realpath(path).startswith(os.path.realpath(REPO) + os.sep):
                raise pytest.UsageError(f"PYMSDA_TEST_INSTALLED=1 but pymsda's {what} comes from "
                                        f"the source checkout: {path}")


def pytest_terminal_summary(terminalreporter):
    skipped = terminalreporter.stats.get("skipped", [])
    reasons = collections.Counter(_skip_reason(report) for report in skipped)
    if not reasons:
        return
    width = max(120, shutil.get_terminal_size().columns) - 8
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason (pytest -rs: where)")
    for reason, count in reasons.most_common():
        line = reason if len(reason) <= width else reason[:width - 3] + "..."
        terminalreporter.write_line(f"{count:6d}  {line}")


def _skip_reason(report):
    """The reason a skipped report gives, without pytest's "Skipped: " (first line only)."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
    reason = (reason.splitlines() or [""])[0]
    return reason[len("Skipped: "):] if reason.startswith("Skipped: ") else reason


# TorchScript is deprecated: torch.jit.script, trace, save and load (and torch's own modules that
# script functions when imported) warn, DeprecationWarning on torch 2.13 and FutureWarning on 2.14
# (docs/export.md says so to users). Tests that script or trace on purpose, or import such a torch
# module, expect it; any other warning, and these anywhere else, still show.
expects_torchscript_deprecation = pytest.mark.filterwarnings(
    r"ignore:`torch\.jit\.(script|script_method|trace|interface|save|load)` is deprecated:Warning")

NEEDS_ONNX = 'needs onnx and onnxruntime (the ONNX tests): pip install ".[onnx]"'


def cuda_usable():
    return torch.cuda.is_available() and pymsda.has_cuda()


def grid_sample_supports(dtype, device="cpu"):
    """Whether this torch's grid_sample (the reference) has a kernel for dtype on device: torch
    1.13 has none for float16/bfloat16 on the CPU."""
    if device == "cuda" and not torch.cuda.is_available():
        return False
    try:
        F.grid_sample(torch.zeros(1, 1, 2, 2, dtype=dtype, device=device),
                      torch.zeros(1, 1, 1, 2, dtype=dtype, device=device), align_corners=False)
        return True
    except (RuntimeError, NotImplementedError):
        return False


def requires_torch_feature(available, feature):
    """A skip mark for tests that need `feature`, which this torch lacks when not available."""
    return pytest.mark.skipif(not available,
                              reason=f"torch {torch.__version__} has no {feature}")


def skip_unless_grid_sample_supports(dtype, device):
    if not grid_sample_supports(dtype, device):
        pytest.skip(f"torch {torch.__version__}: grid_sample (the reference) has no {dtype} "
                    f"kernel on {device}")


requires_cuda = pytest.mark.skipif(
    not cuda_usable(),
    reason="needs a CUDA GPU and a libpymsda built with CUDA kernels (pymsda.has_cuda())")

requires_two_gpus = pytest.mark.skipif(
    not (cuda_usable() and torch.cuda.device_count() >= 2), reason="needs at least 2 CUDA GPUs")

# Parametrise a test over these to run it on the CPU always and on CUDA where there is a GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]

FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def generator(request):
    return torch.Generator().manual_seed(seed_of(request.node.nodeid))



"""pymsda: Multi-Scale Deformable Attention for PyTorch, as a C/CUDA library loaded with ctypes.

The library is built without any PyTorch header, so one build works across PyTorch and Python
versions. Public API: ms_deform_attn, MSDeformAttnFunction, MSDeformAttn, reference. Where torch
has torch.library.custom_op (2.4 and later), importing pymsda also registers the operators
torch.ops.pymsda.ms_deform_attn_forward and torch.ops.pymsda.ms_deform_attn_backward, which
torch.compile and torch.export trace (pymsda.ops.HAS_TORCH_LIBRARY_OPS says whether they are);
and, on every torch, pymsda::ms_deform_attn, which torch.jit.script records for ms_deform_attn.

Without torch (a machine that deploys exported models with ONNX Runtime), `import pymsda` still
works: pymsda.library_path() is the library that SessionOptions.register_custom_ops_library
loads (its op pymsda::MSDeformAttn, docs/export.md), and every attribute that needs torch raises
ImportError saying so.
"""
import importlib.util
import sys

from . import _clib

__version__ = "0.1.0"
__all__ = ["ms_deform_attn", "MSDeformAttnFunction", "MSDeformAttn", "export", "reference",
           "routes", "library_path", "has_cuda", "cuda_archs", "empty_cpu_cache",
           "SlowPathWarning"]


def library_path():
    """Path of the loaded libpymsda.so: pymsda's kernels, and ONNX Runtime's op
    pymsda::MSDeformAttn for `onnxruntime.SessionOptions().register_custom_ops_library(path)`.
    Needs no torch."""
    return _clib.path


def cuda_archs():
    """GPU architectures embedded in the library, e.g. ['sm_75', ..., 'compute_121']."""
    return _clib.lib.msda_cuda_archs().decode().split()


def _torch_api():
    """The names that need torch, imported (and the ops registered): at `import pymsda`, or at
    their first use when this import is `python -m pymsda` starting (_cli_start)."""
    import torch

    from . import _buffers, export, reference, routes
    from .modules import MSDeformAttn
    from ._op import SlowPathWarning
    from .ops import MSDeformAttnFunction, ms_deform_attn  # (registers the op TorchScript records)

    def has_cuda():
        """True when the library has CUDA kernels, torch sees a GPU and so does the library."""
        return (bool(_clib.lib.msda_has_cuda()) and torch.cuda.is_available()
                and _clib.lib.msda_cuda_device_count() > 0)

    def empty_cpu_cache():
        """Gives back the CPU gradient buffers pymsda keeps for reuse between backward calls (at
        most 8, 256 MB together by default: PYMSDA_CPU_POOL_MB; see pymsda/_buffers.py). Buffers
        still in use stay with their users. Like torch.cuda.empty_cache, only useful to return
        memory."""
        _buffers.pool.clear()

    globals().update(export=export, reference=reference, routes=routes, MSDeformAttn=MSDeformAttn,
                     SlowPathWarning=SlowPathWarning, MSDeformAttnFunction=MSDeformAttnFunction,
                     ms_deform_attn=ms_deform_attn, has_cuda=has_cuda,
                     empty_cpu_cache=empty_cpu_cache)


def _cli_start():
    """Whether this import is `python -m pymsda` starting (Python imports the package before
    running its __main__, with sys.argv[0] "-m" meanwhile; sys.orig_argv, 3.10 and later, says
    which module): the commands import what they need, so `--help` waits for no torch."""
    orig = getattr(sys, "orig_argv", None) or []
    return sys.argv[:1] == ["-m"] and any(orig[i:i + 2] == ["-m", "pymsda"]
                                          for i in range(len(orig) - 1))


_NEEDS_TORCH = frozenset(__all__) - {"library_path", "cuda_archs"}
if importlib.util.find_spec("torch") is None:
    def __getattr__(name):
        if name in _NEEDS_TORCH | {"ops", "modules", "compat", "bench", "HAS_TORCH_LIBRARY_OPS"}:
            raise ImportError(
                f"pymsda.{name} needs PyTorch, which is not installed in this Python: pip install "
                "torch (without torch, pymsda serves ONNX Runtime: pymsda.library_path())")
        raise AttributeError(f"module 'pymsda' has no attribute {name!r}")
elif _cli_start():
    _loading = []

    def __getattr__(name):
        if name in _NEEDS_TORCH and not _loading:  # (while loading, `from . import export`
            _loading.append(name)                  # asks here before importing the submodule)
            _torch_api()
            return globals()[name]
        raise AttributeError(f"module 'pymsda' has no attribute {name!r}")
else:
    _torch_api()

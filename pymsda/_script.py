"""torch.jit.script: the operator pymsda::ms_deform_attn that scripted code calls.

TorchScript cannot compile ms_deform_attn itself (keyword-only options, a C library called by
ctypes). So ms_deform_attn is registered as a TorchScript builtin, as torch registers its own
Python functions: a scripted function or module that calls pymsda.ms_deform_attn (or a drop-in
that is scriptable, see docs/export.md) records one node pymsda::ms_deform_attn, with the same
arguments. Its kernel (CompositeImplicitAutograd, so autograd sees what it runs) is
ms_deform_attn itself: the scripted code computes exactly what eager code computes, with the same
checks and gradients. A saved scripted module loads where pymsda is imported.

Registered with torch.library's Python kernels (torch 1.13 and later); spatial_shapes and
level_start_index are typed Any, so they may be tensors or lists, as in eager code.
"""
import torch

from . import _library
from ._torch_private import register_script_builtin, script_unsupported
from .ops import ms_deform_attn

SCHEMA = ("ms_deform_attn(Tensor value, Any spatial_shapes, Any level_start_index, "
          "Tensor sampling_locations, Tensor attention_weights, int? im2col_step=None, *, "
          "int[]? num_points_list=None, str sampling=\"bilinear\", bool softmax=False, "
          "bool? deterministic=None, bool validate=False) -> Tensor")

_DIRECTLY = ("pymsda.ms_deform_attn is a TorchScript builtin (the operator pymsda::ms_deform_attn)"
             ": script the function or module that calls it, not the op itself")


def _kernel(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
            im2col_step=None, num_points_list=None, sampling="bilinear", softmax=False,
            deterministic=None, validate=False):
    return ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                          attention_weights, im2col_step, num_points_list=num_points_list,
                          sampling=sampling, softmax=softmax, deterministic=deterministic,
                          validate=validate)


def _register():
    """The torch.library.Library holding the op (kept alive: registrations end with it), or None
    where this torch cannot register Python kernels."""
    Library = getattr(getattr(torch, "library", None), "Library", None)
    if Library is None:
        return None
    try:
        # FRAGMENT: the namespace may already hold the torch.library.custom_op ops (_library.py);
        # torch 1.13 has no FRAGMENT, and no custom ops to share the namespace with
        library = Library("pymsda", "FRAGMENT" if _library.HAS_TORCH_LIBRARY_OPS else "DEF")
        library.define(SCHEMA)
        library.impl("ms_deform_attn", _kernel, "CompositeImplicitAutograd")
        if not register_script_builtin(ms_deform_attn, "pymsda::ms_deform_attn"):
            return None
    except (AttributeError, RuntimeError, ValueError):
        return None
    return library


_op_library = _register()
HAS_SCRIPT_OP = _op_library is not None
# torch.jit.script(pymsda.ms_deform_attn) itself: say what works (calls from scripted code are
# resolved to the builtin before this is looked at)
script_unsupported(ms_deform_attn, _DIRECTLY if HAS_SCRIPT_OP else (
    "pymsda.ms_deform_attn cannot be compiled by torch.jit.script with torch "
    f"{torch.__version__}: use torch.jit.trace (it records the op), or torch.onnx.export"))

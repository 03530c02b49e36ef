"""The MSDA operator: ms_deform_attn, Deformable DETR's MSDeformAttnFunction, and the op
pymsda::ms_deform_attn that torch.jit.script records.

Every caller meets ms_deform_attn, whose body begins with the one table of which exit serves
which caller, the dispatch right under it. Every exit that computes with pymsda's kernels ends in
pymsda/_op.py's forward() and backward(), the only functions that call the C library.
"""
from typing import Any, Optional

import torch

from . import _clib
from ._args import common, deterministic_algorithms, flags_of, points_dtype, prepare
from ._checks import HALF_DTYPES
from ._op import HAS_TORCH_LIBRARY_OPS, run, traced, unserved
from ._torch_private import (JIT_TRACE, ONNX, recording, register_script_builtin,
                             script_unsupported)
from ._trace import decomposed, onnx

_Tensor, _F32 = torch.Tensor, torch.float32
_EAGER_TYPES = (torch.Tensor, torch.nn.Parameter)

__all__ = ["ms_deform_attn", "MSDeformAttnFunction"]


def ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, im2col_step=None, *, num_points_list=None,
                   sampling="bilinear", softmax=False, deterministic=None, validate=False):
    """Multi-Scale Deformable Attention (Deformable DETR's MSDeformAttnFunction).

    Args:
        value: (B, S, H, C) float32/float64/float16/bfloat16, the flattened feature maps of all
            levels, S = sum_l H_l * W_l.
        spatial_shapes: (L, 2) int64 or int32 tensor on any device, rows (H_l, W_l); or a list of
            (H, W) pairs.
        level_start_index: (L,) int64 or int32 tensor, the offset of each level in S; or None to
            derive it from spatial_shapes (without a device synchronisation).
        sampling_locations: (B, Q, H, L, P, 2), last dim (x, y) normalised to [0, 1]: x = 0 is
            the left edge of the level, x = 1 its right edge (pixel centres at (j + 0.5) / W).
            Points outside [0, 1] are allowed; neighbours outside the map contribute 0.
        attention_weights: (B, Q, H, L, P), already normalised by the caller (softmax), or
            logits with softmax=True.
        im2col_step: accepted for compatibility and ignored: any batch size works.
        num_points_list: per-level point counts (RT-DETRv2), a list of L ints >= 0. Then
            sampling_locations is (B, Q, H, N, 2) and attention_weights (B, Q, H, N) with
            N = sum(num_points_list), level 0's points first.
        sampling: "bilinear" (default) or "nearest" (RT-DETRv2's "discrete": the nearest pixel,
            clamped; sampling_locations then gets no gradient, None).
        softmax: attention_weights are logits: torch's softmax over each (query, head)'s
            points, in the dtype the points are read in, then the plain op.
        deterministic: bitwise reproducible gradients (on CUDA grad_value summed in 64-bit fixed
            point, a workspace of 8 bytes per value element). None (default) follows
            torch.are_deterministic_algorithms_enabled().
        validate: also check spatial_shapes and level_start_index that live on the GPU, with a
            device synchronisation; PYMSDA_VALIDATE=1 does it for every call. Otherwise device
            tables are trusted: wrong tables give wrong numbers, never an access outside the
            tensors. Host tables (a list, a CPU tensor) are always checked.

    Returns:
        (B, Q, H * C) tensor of value's dtype:
        out[b, q, h*C + c] = sum_{l,p} A[b,q,h,l,p] * bilinear(V_l[b, :, :, h, c],
                                                      loc_x * W_l - 0.5, loc_y * H_l - 0.5),
        i.e. grid_sample(bilinear, padding_mode="zeros", align_corners=False) at
        grid = 2 * loc - 1, differentiable with respect to value, sampling_locations and
        attention_weights. Half precision accumulates in float32.

    Dtypes (docs/numerics.md has the whole rule, the kinks, non-finite input): the points are
    read in value's dtype when both have it; with a half value and float32 points (what
    torch.autocast gives) they are read as float32, never rounded, and grad_value is summed as
    the all-half call sums it. Gradients come back in each input's dtype.

    Tracing (docs/export.md): torch.compile, torch.export and torch.jit.trace record the
    registered op pymsda::ms_deform_attn_forward (torch 2.4 and later); torch.onnx.export a
    decomposition into standard ONNX ops or TensorRT's plugin; torch.jit.script the op
    pymsda::ms_deform_attn. Nothing reads a GPU tensor on the host, so calls capture in CUDA
    graphs after one warm-up call.

    Raises:
        TypeError for a wrong type or dtype and ValueError for a wrong shape, size, device or
        shape table, each naming the argument; ValueError or RuntimeError from the library
        (message from c/msda.h's msda_last_error) should a check in C refuse the call.
    """
    if softmax:  # torch's softmax, then the plain op (see softmax above)
        if not _composable(value, sampling_locations, attention_weights):
            prepare(value, spatial_shapes, level_start_index, sampling_locations,
                    attention_weights, validate, num_points_list)  # raises, naming the argument
        attention_weights = _softmax_points(value, sampling_locations, attention_weights)
    if sampling == "bilinear" and deterministic is None:  # (at once)
        flags = _clib.FLAG_DETERMINISTIC if deterministic_algorithms() else 0
    else:
        flags = flags_of(sampling, deterministic)
        if flags & _clib.FLAG_NEAREST and isinstance(sampling_locations, _Tensor):
            # piecewise constant in the location: no gradient at all (None), on every path
            sampling_locations = sampling_locations.detach()
    # Which exit serves which caller: the first row that fits, asked in this order below.
    # recording() is pymsda's one test of tracing and exporting (pymsda/_torch_private.py).
    #
    # | caller (told by)                              | exit
    # |-----------------------------------------------|--------------------------------------------
    # | torch.onnx.export, either exporter            | _trace.onnx: the decomposition into ONNX
    # |   (recording() & ONNX)                        |   ops, or one node of TensorRT's plugin or
    # |                                               |   of pymsda's ONNX Runtime op
    # | torch.jit.trace (recording() & JIT_TRACE)     | _op.traced: the torch.library op (torch
    # |                                               |   < 2.4: _trace.decomposed)
    # | torch.compile, torch.export, dispatch modes   | _op.traced (torch >= 2.4)
    # |   (recording() & FAKE), tensor subclasses     |
    # | torch.jit.script (scripted code records       | this function, the op's kernel: the rows
    # |   pymsda::ms_deform_attn, registered below)   |   here
    # | eager, the common call (_args.common)         | _op.run: _op.forward; with a gradient
    # |                                               |   wanted, through the autograd node
    # | eager, anything else (_args.prepare: every    | _op.run
    # |   check, each naming what is wrong)           |
    # | a device the library does not serve           | _op.unserved: on meta, shapes alone; else
    # |   (_clib.serves)                              |   the pure-PyTorch op (a SlowPathWarning
    # |                                               |   on CUDA)
    recorder = recording()
    if recorder & ONNX:
        return onnx(value, spatial_shapes, level_start_index, sampling_locations,
                    attention_weights, num_points_list, flags, dynamo=not recorder & JIT_TRACE)
    if recorder & JIT_TRACE and not HAS_TORCH_LIBRARY_OPS:
        return decomposed(value, spatial_shapes, level_start_index, sampling_locations,
                          attention_weights, num_points_list, flags)
    if HAS_TORCH_LIBRARY_OPS and (recorder or not (
            type(value) is _Tensor and type(sampling_locations) is _Tensor
            and type(attention_weights) is _Tensor) and _subclassed(
                value, sampling_locations, attention_weights)):
        return traced(value, spatial_shapes, level_start_index, sampling_locations,
                      attention_weights, num_points_list, flags)
    if num_points_list is None and not validate:
        prepared = common(value, spatial_shapes, level_start_index, sampling_locations,
                          attention_weights, flags)
        if prepared is not None:
            return run(*prepared)
    value, loc, attn, call = prepare(value, spatial_shapes, level_start_index,
                                     sampling_locations, attention_weights, validate,
                                     num_points_list, flags)
    if not _clib.serves(value.device):
        return unserved(value, loc, attn, call, num_points_list)
    return run(value, loc, attn, call)


def _softmax_points(value, loc, attn):
    """softmax=True: attention_weights (logits) softmaxed over each (query, head)'s points, to
    be passed to the plain op. The composition's backward is the faster (kernels/TUNING.md:
    softmax=True). The softmax runs in the dtype the op reads the points in
    (_args.points_dtype), so logits that are widened to float32 are widened first; it is
    torch's own softmax otherwise (under autocast, float32)."""
    x = attn.flatten(3) if attn.dim() == 5 else attn  # (B, Q, H, L * P) or (B, Q, H, N)
    to = points_dtype(value.dtype, loc.dtype, attn.dtype)
    if to is not attn.dtype:
        x = x.softmax(-1, dtype=to)
    elif to in HALF_DTYPES and x.device.type == "cpu":  # (torch 1.13: no half softmax on the CPU)
        x = x.softmax(-1, dtype=_F32).to(to)
    else:
        x = x.softmax(-1)
    return x.view(attn.shape)


def _subclassed(*tensors):
    """Whether a tensor is of a subclass that must meet the dispatcher (a Parameter need not)."""
    return any(type(t) not in _EAGER_TYPES and isinstance(t, _Tensor) for t in tensors)


def _composable(value, loc, attn):
    """Whether softmax=True can be composed here: floating-point tensors (anything else the
    checks refuse, naming it)."""
    return (isinstance(attn, _Tensor) and isinstance(value, _Tensor) and isinstance(loc, _Tensor)
            and attn.is_floating_point() and attn.dim() in (4, 5))


class MSDeformAttnFunction:
    """Deformable DETR's autograd function, as `MSDeformAttnFunction.apply(value,
    value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
    im2col_step)`; im2col_step is ignored. The annotations are for torch.jit.script, which
    compiles the class and records the op pymsda::ms_deform_attn (registered below)."""

    @staticmethod
    def apply(value, value_spatial_shapes: Any, value_level_start_index: Any, sampling_locations,
              attention_weights, im2col_step: Optional[int] = None):
        return ms_deform_attn(value, value_spatial_shapes, value_level_start_index,
                              sampling_locations, attention_weights, im2col_step)


# ---------------------------------------------------------------------------------------------
# torch.jit.script: the operator pymsda::ms_deform_attn that scripted code calls.
#
# TorchScript cannot compile ms_deform_attn itself (keyword-only options, a C library called by
# ctypes). So ms_deform_attn is registered as a TorchScript builtin, as torch registers its own
# Python functions: a scripted function or module that calls pymsda.ms_deform_attn (or a drop-in
# that is scriptable, see docs/export.md) records one node pymsda::ms_deform_attn, with the same
# arguments. Its kernel (CompositeImplicitAutograd, so autograd sees what it runs) is
# ms_deform_attn itself: the scripted code computes exactly what eager code computes, with the
# same checks and gradients. A saved scripted module loads where pymsda is imported. Registered
# with torch.library's Python kernels (torch 1.13 and later); spatial_shapes and
# level_start_index are typed Any, so they may be tensors or lists, as in eager code.

SCRIPT_SCHEMA = ("ms_deform_attn(Tensor value, Any spatial_shapes, Any level_start_index, "
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


def _register_script_op():
    """The torch.library.Library holding the op (kept alive: registrations end with it), or None
    where this torch cannot register Python kernels."""
    Library = getattr(getattr(torch, "library", None), "Library", None)
    if Library is None:
        return None
    try:
        # FRAGMENT: the namespace may already hold the torch.library.custom_op ops (_op.py);
        # torch 1.13 has no FRAGMENT, and no custom ops to share the namespace with
        library = Library("pymsda", "FRAGMENT" if HAS_TORCH_LIBRARY_OPS else "DEF")
        library.define(SCRIPT_SCHEMA)
        library.impl("ms_deform_attn", _kernel, "CompositeImplicitAutograd")
        if not register_script_builtin(ms_deform_attn, "pymsda::ms_deform_attn"):
            return None
    except (AttributeError, RuntimeError, ValueError):
        return None
    return library


_op_library = _register_script_op()
HAS_SCRIPT_OP = _op_library is not None
# torch.jit.script(pymsda.ms_deform_attn) itself: say what works (calls from scripted code are
# resolved to the builtin before this is looked at)
script_unsupported(ms_deform_attn, _DIRECTLY if HAS_SCRIPT_OP else (
    "pymsda.ms_deform_attn cannot be compiled by torch.jit.script with torch "
    f"{torch.__version__}: use torch.jit.trace (it records the op), or torch.onnx.export"))

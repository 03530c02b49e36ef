"""The calls into the C library: the op's eager autograd node, and its registration with
torch.library.

forward and backward allocate the outputs with torch (so the caching allocator and CUDA graphs
serve them) and call libpymsda's entry points with the tensors' pointers and the current stream
of their device, packed into one msda_args. _MSDA is the one autograd.Function; run picks the
cheapest way in.

torch.library: the ops pymsda::ms_deform_attn_forward and pymsda::ms_deform_attn_backward,
their fake (shape-only) implementations and autograd, and the traced call that uses them
(torch.compile, torch.export, fake tensors, dispatch modes), where a ctypes call cannot be
recorded. Registered only where the running torch has torch.library.custom_op.
"""
import ctypes
import os
import warnings
from typing import List, Optional, Tuple

import torch

from . import _clib
from ._args import points_as_read, prepare, starts_of
from ._buffers import pool as _cpu_pool
from ._checks import (DTYPE_CODE, check_float_tensor, check_grad_output, check_pairs,
                      check_shapes_only, point_counts)
from ._clib import check as _check, lib, serves as _library_serves
from ._torch_private import current_raw_stream as _current_stream, direct_apply, \
    functorch_active as _functorch_active
from .reference import ms_deform_attn_pytorch

# ---------------------------------------------------------------------------------------------
# calls into the C library

# msda_forward and msda_backward take one msda_args (c/msda.h), packed here with struct into a
# fresh bytes object per call in about a fifth of the time ctypes takes to convert twenty
# separate arguments. Each call's packer takes only the fields it sets; the rest are zero.
c_forward, c_backward = lib.msda_forward, lib.msda_backward
_CALL = ("B", "S", "H", "C", "L", "Q", "P", "dtype", "index_dtype", "device", "num_threads",
         "flags", "level_points", "value", "spatial_shapes", "level_start_index",
         "sampling_locations", "attention_weights")
_pack_forward = _clib.args_packer(*_CALL, "output", "stream")
_pack_backward = _clib.args_packer(*_CALL, "grad_output", "grad_value", "grad_sampling_locations",
                                  "grad_attention_weights", "workspace", "workspace_bytes",
                                  "stream")
_pack_sizes = _clib.args_packer("B", "S", "H", "C", "L", "Q", "P", "dtype", "device", "flags")


def device_args(t):
    """(device, stream, num_threads) for the C call: the CUDA ordinal of t and the current
    stream of that device (not of the current device), or -1, 0 and torch's CPU thread count."""
    if t.is_cuda:
        index = t.get_device()
        return index, _current_stream(index), 0
    return -1, 0, torch.get_num_threads()


def forward(value, levels, loc, attn, sizes, lp=None, flags=0):
    B, S, H, C, L, Q, P = sizes
    if loc.dtype is not value.dtype:  # float32 points, half value (_args.points_as_read)
        flags |= _clib.FLAG_POINTS_F32
    out = value.new_empty((B, Q, H * C))
    if value.is_cuda:  # device_args, inline
        device = value.get_device()
        stream, threads = _current_stream(device), 0
    else:
        device, stream, threads = -1, 0, torch.get_num_threads()
    shapes_ptr, starts_ptr = levels.pointers or levels.read_pointers()
    status = c_forward(_pack_forward(
        B, S, H, C, L, Q, P, DTYPE_CODE[value.dtype], levels.index_code, device, threads,
        flags, 0 if lp is None else ctypes.addressof(lp), value.data_ptr(), shapes_ptr,
        starts_ptr, loc.data_ptr(), attn.data_ptr(), out.data_ptr(), stream))
    if status:
        _check(status)
    return out


def backward(grad_out, value, levels, loc, attn, sizes, need_value, need_loc, need_attn,
              lp=None, flags=0):
    B, S, H, C, L, Q, P = sizes
    if loc.dtype is not value.dtype:  # float32 points, half value (_args.points_as_read)
        flags |= _clib.FLAG_POINTS_F32
    grad_out = grad_out.contiguous()
    if grad_out.dtype != value.dtype:
        grad_out = grad_out.to(value.dtype)
    device, stream, threads = device_args(value)
    # grad_value of a half type: on the CPU the library accumulates it in an f32 buffer, cast
    # once here; on CUDA it has value's dtype (c/msda.h: the library accumulates in f32 where
    # it must, in the workspace it asks for).
    # On the CPU the gradients come from the pool of reused buffers (_buffers.py: a fresh
    # large one is page-faulted in on every call).
    if device >= 0:
        grad_value = value.new_empty(value.shape) if need_value else None
        grad_loc = torch.empty_like(loc) if need_loc else None
        grad_attn = torch.empty_like(attn) if need_attn else None
    else:
        grad_value = (_cpu_empty(value.shape, value.dtype if value.dtype in _FULL_DTYPES
                                 else torch.float32) if need_value else None)
        grad_loc = _cpu_empty(loc.shape, loc.dtype) if need_loc else None
        grad_attn = _cpu_empty(attn.shape, attn.dtype) if need_attn else None
    workspace, workspace_bytes = None, 0
    if (need_value and device >= 0
            and (flags & _clib.FLAG_DETERMINISTIC or value.dtype not in _FULL_DTYPES)):
        workspace_bytes = lib.msda_backward_workspace_size(
            _pack_sizes(B, S, H, C, L, Q, P, DTYPE_CODE[value.dtype], device, flags))
        if workspace_bytes < 0:
            _check(_clib.ERR_INVALID_ARGUMENT)
        if workspace_bytes > 0:
            workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=value.device)
    shapes_ptr, starts_ptr = levels.pointers or levels.read_pointers()
    status = c_backward(_pack_backward(
        B, S, H, C, L, Q, P, DTYPE_CODE[value.dtype], levels.index_code, device, threads,
        flags, 0 if lp is None else ctypes.addressof(lp), value.data_ptr(), shapes_ptr,
        starts_ptr, loc.data_ptr(), attn.data_ptr(), grad_out.data_ptr(),
        grad_value.data_ptr() if need_value else 0,
        grad_loc.data_ptr() if need_loc else 0,
        grad_attn.data_ptr() if need_attn else 0,
        workspace.data_ptr() if workspace is not None else 0, workspace_bytes, stream))
    if status:
        _check(status)
    if grad_value is not None and grad_value.dtype != value.dtype:
        grad_value = grad_value.to(value.dtype)
    return grad_value, grad_loc, grad_attn


_FULL_DTYPES = (torch.float32, torch.float64)
_cpu_empty = _cpu_pool.empty


def _grads_of_node(ctx, grad_out):
    value, loc, attn = ctx.saved_tensors
    need_value, need_loc, need_attn = ctx.needs_input_grad[:3]
    levels, sizes, lp, flags = ctx.plan
    grads = backward(grad_out, value, levels, loc, attn, sizes, need_value, need_loc, need_attn,
                      lp, flags)
    return grads + (None,)


_grads_once_differentiable = torch.autograd.function.once_differentiable(_grads_of_node)


class _MSDA(torch.autograd.Function):
    """The eager autograd node (every torch version): forward and backward call C directly."""

    @staticmethod
    def forward(ctx, value, sampling_locations, attention_weights, plan):
        # plan = (levels, sizes, lp, flags): one argument, so apply() has fewer to look at
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        ctx.plan = plan
        levels, sizes, lp, flags = plan
        return forward(value, levels, sampling_locations, attention_weights, sizes, lp, flags)

    @staticmethod
    def backward(ctx, grad_out):
        # The library's gradients are not differentiable again. With create_graph=True (grad
        # mode on here) once_differentiable makes a second derivative raise instead of being
        # silently 0; otherwise its no_grad wrapper is skipped (a few microseconds a call).
        if torch.is_grad_enabled():
            return _grads_once_differentiable(ctx, grad_out)
        return _grads_of_node(ctx, grad_out)


# _MSDA.apply without torch.autograd.Function's Python wrapper, which _MSDA (no setup_context)
# needs only under functorch transforms: about 2 us a call less (4-5 on a slow host); None
# where this torch does not allow it (then _MSDA.apply)
_apply_direct = direct_apply(_MSDA)


# ---------------------------------------------------------------------------------------------
# which devices the library serves; the pure-PyTorch path for the others

class SlowPathWarning(UserWarning):
    """A CUDA call of pymsda ran on the pure-PyTorch path (pymsda.reference): several times
    slower than the library's kernels and with many times their memory."""


REQUIRE_KERNELS = "PYMSDA_REQUIRE_KERNELS"
_slow_path_warned = False


def slow_path(device):
    """Called before the pure-PyTorch op serves a tensor on CUDA device `device`: the first time
    in the process a SlowPathWarning naming the cause and the fix; a RuntimeError instead, on
    every such call, where the environment sets PYMSDA_REQUIRE_KERNELS=1."""
    global _slow_path_warned
    strict = os.environ.get(REQUIRE_KERNELS, "0") not in ("", "0")
    if _slow_path_warned and not strict:
        return
    if not _clib.has_cuda_kernels:
        cause = f"the pymsda library it loaded ({_clib.path}) was built without CUDA kernels"
        fix = ("build them: in the pymsda checkout, `make && pip install .` with a CUDA compiler "
               "present (no CUDA toolkit? docs/build.md says which pip command installs one)")
    else:
        major, minor = torch.cuda.get_device_capability(device)
        cause = _clib.unserved_cuda.get(device.index, "its kernels do not run on this GPU")
        fix = (f"rebuild for this GPU: `make CUDA_ARCHS={major}{minor} && pip install .` in the "
               "pymsda checkout, or update the NVIDIA driver if it is older than the CUDA the "
               "library was built with")
    text = (f"pymsda: a call on {device} runs on the pure-PyTorch path (several times slower "
            f"than the kernels, many times their memory): {cause}. Fix: {fix}. Set "
            f"{REQUIRE_KERNELS}=1 to make this an error.")
    if strict:
        raise RuntimeError(text)
    _slow_path_warned = True
    warnings.warn(text, SlowPathWarning, stacklevel=4)


def run_reference(value, spatial_shapes, loc, attn, num_points_list, flags):
    """The pure-PyTorch op, for a device the library does not serve (a GPU without the
    library's CUDA kernels: with a SlowPathWarning, MPS, ...); with float32 points and a half
    value (the dtype rule, _args.points_as_read) it runs in float32 and rounds the output to value's
    dtype."""
    if value.is_cuda:
        slow_path(value.device)
    out = ms_deform_attn_pytorch(
        value if value.dtype is loc.dtype else value.to(loc.dtype), spatial_shapes, loc, attn,
        num_points_list=num_points_list,
        sampling="nearest" if flags & _clib.FLAG_NEAREST else "bilinear")
    return out if out.dtype is value.dtype else out.to(value.dtype)


class MetaMSDA(torch.autograd.Function):
    """The op on meta tensors outside tracing: outputs and gradients of the right shapes and
    dtypes, no numbers (there are none to read)."""

    @staticmethod
    def forward(ctx, value, sampling_locations, attention_weights, sizes):
        B, S, H, C, L, Q, P = sizes
        ctx.like = [(t.shape, t.dtype) for t in (value, sampling_locations, attention_weights)]
        return value.new_empty((B, Q, H * C))

    @staticmethod
    def backward(ctx, grad_out):
        grads = tuple(grad_out.new_empty(shape, dtype=dtype) if need else None
                      for (shape, dtype), need in zip(ctx.like, ctx.needs_input_grad))
        return grads + (None,)


_is_grad_enabled = torch.is_grad_enabled


def run(value, loc, attn, plan):
    """The op on prepared tensors (plan = (levels, sizes, lp, flags)): through the autograd node
    when a gradient is wanted (its C++ apply directly where that is safe), else the forward
    alone."""
    if _is_grad_enabled() and (value.requires_grad or loc.requires_grad or attn.requires_grad):
        if _apply_direct is not None and not _functorch_active():
            return _apply_direct(value, loc, attn, plan)
        return _MSDA.apply(value, loc, attn, plan)
    levels, sizes, lp, flags = plan
    return forward(value, levels, loc, attn, sizes, lp, flags)


# ---------------------------------------------------------------------------------------------
# torch.library: pymsda::ms_deform_attn_forward and pymsda::ms_deform_attn_backward
#
# Schema (the tensors as ms_deform_attn documents them; spatial_shapes is always a tensor here):
#   ms_deform_attn_forward(Tensor value, Tensor spatial_shapes, Tensor? level_start_index,
#       Tensor sampling_locations, Tensor attention_weights, SymInt[]? num_points_list,
#       SymInt flags) -> Tensor
#   ms_deform_attn_backward(Tensor grad_output, <the forward's arguments>, bool need_value,
#       bool need_sampling_locations, bool need_attention_weights) -> (Tensor, Tensor, Tensor)
# flags is a bitwise OR of msda_flags (c/msda.h). A gradient that is not needed comes back as an
# empty (0,) tensor; the gradients have the dtypes of value, sampling_locations and
# attention_weights.


def _forward_impl(value: torch.Tensor, spatial_shapes: torch.Tensor,
                  level_start_index: Optional[torch.Tensor], sampling_locations: torch.Tensor,
                  attention_weights: torch.Tensor, num_points_list: Optional[List[int]],
                  flags: int) -> torch.Tensor:
    value, levels, loc, attn, sizes, lp = prepare(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        num_points_list=num_points_list)
    return forward(value, levels, loc, attn, sizes, lp, flags)


def _forward_fake(value, spatial_shapes, level_start_index, sampling_locations,
                  attention_weights, num_points_list, flags):
    if torch.onnx.is_in_onnx_export():
        # ms_deform_attn records no op while exporting (pymsda/export.py), so this one comes
        # from a graph made before: an ExportedProgram, or its module()
        raise RuntimeError(
            "pymsda: torch.onnx.export was given a graph that holds pymsda's op "
            "pymsda::ms_deform_attn_forward (an ExportedProgram from torch.export, or its "
            "module()), which ONNX has no operator for. Decompose it first: "
            "torch.onnx.export(exported_program.run_decompositions("
            "pymsda.export.decompositions()), ...); or export the model itself: "
            "torch.onnx.export(model, args, dynamo=True) records the decomposition")
    B, S, H, C, L, Q, P = check_shapes_only(value, spatial_shapes, level_start_index,
                                             sampling_locations, attention_weights,
                                             num_points_list)
    return value.new_empty((B, Q, H * C))


def _backward_impl(grad_output: torch.Tensor, value: torch.Tensor, spatial_shapes: torch.Tensor,
                   level_start_index: Optional[torch.Tensor], sampling_locations: torch.Tensor,
                   attention_weights: torch.Tensor, num_points_list: Optional[List[int]],
                   flags: int, need_value: bool, need_sampling_locations: bool,
                   need_attention_weights: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    v, levels, loc, attn, sizes, lp = prepare(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        num_points_list=num_points_list)
    B, S, H, C, L, Q, P = sizes
    check_grad_output(grad_output, B, Q, H, C, v.device)
    grads = backward(grad_output, v, levels, loc, attn, sizes, need_value,
                      need_sampling_locations, need_attention_weights, lp, flags)
    return tuple(torch.empty((0,), dtype=like.dtype, device=like.device) if grad is None
                 else grad.to(like.dtype)
                 for grad, like in zip(grads, (value, sampling_locations, attention_weights)))


def _backward_fake(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, num_points_list, flags, need_value,
                   need_sampling_locations, need_attention_weights):
    B, S, H, C, L, Q, P = check_shapes_only(value, spatial_shapes, level_start_index,
                                             sampling_locations, attention_weights,
                                             num_points_list)
    check_grad_output(grad_output, B, Q, H, C, value.device)
    return tuple(like.new_empty(like.shape if need else (0,)) for like, need in (
        (value, need_value), (sampling_locations, need_sampling_locations),
        (attention_weights, need_attention_weights)))


def _setup_context(ctx, inputs, output):
    value, spatial_shapes, level_start_index, loc, attn, num_points_list, flags = inputs
    ctx.save_for_backward(value, spatial_shapes, level_start_index, loc, attn)
    ctx.num_points_list, ctx.flags = num_points_list, flags


def _backward_formula(ctx, grad_output):
    value, spatial_shapes, level_start_index, loc, attn = ctx.saved_tensors
    need_value, _, _, need_loc, need_attn = ctx.needs_input_grad[:5]
    need_loc = need_loc and not ctx.flags & _clib.FLAG_NEAREST  # None, as ms_deform_attn gives
    grad_value, grad_loc, grad_attn = _backward_op(
        grad_output, value, spatial_shapes, level_start_index, loc, attn, ctx.num_points_list,
        ctx.flags, need_value, need_loc, need_attn)
    return (grad_value if need_value else None, None, None, grad_loc if need_loc else None,
            grad_attn if need_attn else None, None, None)


def _register():
    """The two ops, or (None, None) on a torch without torch.library.custom_op (< 2.4): the
    eager path needs none of it."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return None, None
    forward_op = custom_op("pymsda::ms_deform_attn_forward", mutates_args=())(_forward_impl)
    backward_op = custom_op("pymsda::ms_deform_attn_backward", mutates_args=())(_backward_impl)
    forward_op.register_fake(_forward_fake)
    backward_op.register_fake(_backward_fake)
    forward_op.register_autograd(_backward_formula, setup_context=_setup_context)
    return forward_op, backward_op


_forward_op, _backward_op = _register()
HAS_TORCH_LIBRARY_OPS = _forward_op is not None


def traced(value, spatial_shapes, level_start_index, sampling_locations,
                           attention_weights, num_points_list, flags):
    """ms_deform_attn through pymsda::ms_deform_attn_forward. Written for torch.compile to
    trace: no data is read; host-side shape lists are checked here and become constant tensors
    of the graph; the op's fake implementation checks the rest, its real one checks again."""
    per_level = num_points_list is None
    check_float_tensor("value", value, 4)
    check_float_tensor("sampling_locations", sampling_locations, 6 if per_level else 5)
    check_float_tensor("attention_weights", attention_weights, 5 if per_level else 4)
    device = value.device
    if not isinstance(spatial_shapes, torch.Tensor):
        pairs = check_pairs(spatial_shapes)
        starts, total = starts_of(pairs)
        if total != value.shape[1]:
            raise ValueError(
                f"spatial_shapes {list(pairs)} cover sum(H*W) = {total} positions but value "
                f"has S = {value.shape[1]} (value.shape[1])")
        if level_start_index is not None and not isinstance(level_start_index, torch.Tensor):
            if [int(s) for s in level_start_index] != starts:
                raise ValueError(f"level_start_index {list(level_start_index)} does not match "
                                 f"spatial_shapes {list(pairs)}: expected {starts}")
            level_start_index = None
        spatial_shapes = torch.tensor(pairs, dtype=torch.int64, device=device)
        if level_start_index is None:
            level_start_index = torch.tensor(starts, dtype=torch.int64, device=device)
    elif level_start_index is not None and not isinstance(level_start_index, torch.Tensor):
        level_start_index = torch.tensor([int(s) for s in level_start_index],
                                         dtype=spatial_shapes.dtype, device=device)
    if not per_level:
        num_points_list = list(point_counts(num_points_list, spatial_shapes.shape[0]))
    sampling_locations, attention_weights = points_as_read(value.dtype, sampling_locations,
                                                    attention_weights)
    if not _library_serves(device):
        return run_reference(value, spatial_shapes, sampling_locations, attention_weights,
                          num_points_list, flags)
    return _forward_op(value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights, num_points_list, flags)

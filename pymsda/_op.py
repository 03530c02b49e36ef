"""The op's forward and backward, the only two functions that call the C library, and every
way in to them (pymsda/ops.py's table says which caller takes which):

    forward, backward   allocate the output and the gradients with torch (so the caching
                        allocator and CUDA graphs serve them) and call msda_forward and
                        msda_backward with the tensors' pointers and the current stream of their
                        device, packed into one msda_args (pymsda/_clib.py)
    _MSDA, run          the eager autograd node, and the eager call: the node when a gradient is
                        wanted, else forward alone
    gradients           the backward formula of both autograd registrations of the op: the
                        eager node's and the torch.library op's
    forward_op, backward_op, traced
                        the torch.library ops pymsda::ms_deform_attn_forward and _backward (where
                        the running torch has torch.library.custom_op), which torch.compile,
                        torch.export, torch.jit.trace and dispatch modes record where a ctypes
                        call could not be: their implementations prepare the call and run forward
                        and backward; traced() is ms_deform_attn through them
    unserved, run_reference
                        a device the library does not serve: the pure-PyTorch op (with a
                        SlowPathWarning on CUDA), shapes alone on meta

A call's arguments besides its three tensors travel as `call` = (levels, sizes, level_points,
flags), as pymsda/_args.py prepares them.
"""
import ctypes
import os
import warnings
from typing import List, Optional, Tuple

import torch

from . import _clib
from ._args import level_starts, points_as_read, prepare
from ._buffers import pool as _cpu_pool
from ._checks import (DTYPE_CODE, HALF_DTYPES, check_float_tensor, check_grad_output,
                      check_pairs, check_shapes_only, check_starts, check_total, point_counts)
from ._clib import check as _check, lib, serves as _library_serves
from ._torch_private import ONNX, current_raw_stream as _current_stream, direct_apply, \
    functorch_active as _functorch_active, recording
from .reference import ms_deform_attn_pytorch

# ---------------------------------------------------------------------------------------------
# the two calls into the C library

# msda_forward and msda_backward take one msda_args (c/msda.h), packed with struct into a fresh
# bytes object per call, in about a fifth of the time ctypes takes to convert twenty arguments
# (each packer takes the fields its call reads, pymsda/_clib.py). Tests count the calls here.
c_forward, c_backward = lib.msda_forward, lib.msda_backward


def device_args(t):
    """(device, stream, num_threads) for the C call: the CUDA ordinal of t and the current
    stream of that device (not of the current device), or -1, 0 and torch's CPU thread count."""
    if t.is_cuda:
        index = t.get_device()
        return index, _current_stream(index), 0
    return -1, 0, torch.get_num_threads()


def forward(value, loc, attn, call):
    """The op's output, (B, Q, H*C) of value's dtype, from msda_forward."""
    levels, (B, S, H, C, L, Q, P), lp, flags = call
    out = value.new_empty((B, Q, H * C))
    if value.is_cuda:  # device_args, inline
        device = value.get_device()
        stream, threads = _current_stream(device), 0
    else:
        device, stream, threads = -1, 0, torch.get_num_threads()
    shapes_ptr, starts_ptr = levels.pointers or levels.read_pointers()
    status = c_forward(_clib.pack_forward(
        B, S, H, C, L, Q, P, DTYPE_CODE[value.dtype], levels.index_code, device, threads,
        flags, 0 if lp is None else ctypes.addressof(lp), value.data_ptr(), shapes_ptr,
        starts_ptr, loc.data_ptr(), attn.data_ptr(), out.data_ptr(), stream))
    if status:
        _check(status)
    return out


def backward(grad_out, value, loc, attn, call, need_value, need_loc, need_attn):
    """(grad_value, grad_sampling_locations, grad_attention_weights) from msda_backward, each in
    its tensor's dtype, None where not needed."""
    levels, (B, S, H, C, L, Q, P), lp, flags = call
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
        grad_value = (_cpu_empty(value.shape, torch.float32 if value.dtype in HALF_DTYPES
                                 else value.dtype) if need_value else None)
        grad_loc = _cpu_empty(loc.shape, loc.dtype) if need_loc else None
        grad_attn = _cpu_empty(attn.shape, attn.dtype) if need_attn else None
    workspace, workspace_bytes = None, 0
    if (need_value and device >= 0
            and (flags & _clib.FLAG_DETERMINISTIC or value.dtype in HALF_DTYPES)):
        workspace_bytes = lib.msda_backward_workspace_size(
            _clib.pack_workspace(B, S, H, C, L, Q, P, DTYPE_CODE[value.dtype], device, flags))
        if workspace_bytes < 0:
            _check(_clib.ERR_INVALID_ARGUMENT)
        if workspace_bytes > 0:
            workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=value.device)
    shapes_ptr, starts_ptr = levels.pointers or levels.read_pointers()
    status = c_backward(_clib.pack_backward(
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


_cpu_empty = _cpu_pool.empty


# ---------------------------------------------------------------------------------------------
# the backward formula, and the eager autograd node

def gradients(ctx, grad_output):
    """The op's backward formula, which both of its autograd registrations run: the eager node
    _MSDA (inputs value, sampling_locations, attention_weights, call) and the torch.library op
    pymsda::ms_deform_attn_forward (inputs value, spatial_shapes, level_start_index,
    sampling_locations, attention_weights, num_points_list, flags). The gradients come from
    backward(): at once for the eager node, whose forward was given the prepared call; through
    the op pymsda::ms_deform_attn_backward for the torch.library op, so that the graph a tracer
    records holds them (the op's implementation prepares the call and runs backward())."""
    value, loc, attn, *tables = ctx.saved_tensors
    needs, call = ctx.needs_input_grad, ctx.call
    if not tables:  # the eager node
        return backward(grad_output, value, loc, attn, call, needs[0], needs[1], needs[2]) + (
            None,)
    num_points_list, flags = call
    # nearest sampling: no location gradient (None), as ms_deform_attn gives
    need = (needs[0], needs[3] and not flags & _clib.FLAG_NEAREST, needs[4])
    grads = [grad if wanted else None for grad, wanted in zip(backward_op(
        grad_output, value, *tables, loc, attn, num_points_list, flags, *need), need)]
    return grads[0], None, None, grads[1], grads[2], None, None


# The library's gradients are not differentiable again. With create_graph=True (grad mode on
# in backward) once_differentiable makes a second derivative raise instead of being silently
# 0; otherwise its no_grad wrapper is skipped (a few microseconds a call).
_gradients_once = torch.autograd.function.once_differentiable(gradients)


class _MSDA(torch.autograd.Function):
    """The eager autograd node (every torch version): forward() and gradients() with the call
    that ms_deform_attn prepared (one argument, so apply() has fewer to look at)."""

    @staticmethod
    def forward(ctx, value, sampling_locations, attention_weights, call):
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        ctx.call = call
        return forward(value, sampling_locations, attention_weights, call)

    @staticmethod
    def backward(ctx, grad_out):
        if torch.is_grad_enabled():
            return _gradients_once(ctx, grad_out)
        return gradients(ctx, grad_out)


# _MSDA.apply without torch.autograd.Function's Python wrapper, which _MSDA (no setup_context)
# needs only under functorch transforms: about 2 us a call less (4-5 on a slow host); None
# where this torch does not allow it (then _MSDA.apply)
_apply_direct = direct_apply(_MSDA)
_is_grad_enabled = torch.is_grad_enabled


def run(value, loc, attn, call):
    """The op on prepared tensors: through the autograd node when a gradient is wanted (its C++
    apply directly where that is safe), else forward() alone."""
    if _is_grad_enabled() and (value.requires_grad or loc.requires_grad or attn.requires_grad):
        if _apply_direct is not None and not _functorch_active():
            return _apply_direct(value, loc, attn, call)
        return _MSDA.apply(value, loc, attn, call)
    return forward(value, loc, attn, call)


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
    return forward(*prepare(value, spatial_shapes, level_start_index, sampling_locations,
                            attention_weights, num_points_list=num_points_list, flags=flags))


def _forward_fake(value, spatial_shapes, level_start_index, sampling_locations,
                  attention_weights, num_points_list, flags):
    if recording() & ONNX:
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
    v, loc, attn, call = prepare(value, spatial_shapes, level_start_index, sampling_locations,
                                 attention_weights, num_points_list=num_points_list, flags=flags)
    B, S, H, C, L, Q, P = call[1]
    check_grad_output(grad_output, B, Q, H, C, v.device)
    grads = backward(grad_output, v, loc, attn, call, need_value, need_sampling_locations,
                     need_attention_weights)
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
    ctx.save_for_backward(value, loc, attn, spatial_shapes, level_start_index)
    ctx.call = (num_points_list, flags)


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
    forward_op.register_autograd(gradients, setup_context=_setup_context)
    return forward_op, backward_op


forward_op, backward_op = _register()
HAS_TORCH_LIBRARY_OPS = forward_op is not None


def traced(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
           num_points_list, flags):
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
        starts = level_starts(pairs)
        check_total(pairs, value.shape[1])
        if level_start_index is not None and not isinstance(level_start_index, torch.Tensor):
            check_starts([int(s) for s in level_start_index], pairs, starts)
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
    return forward_op(value, spatial_shapes, level_start_index, sampling_locations,
                      attention_weights, num_points_list, flags)


# ---------------------------------------------------------------------------------------------
# a device the library does not serve: the pure-PyTorch op, or shapes alone on meta

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
    warnings.warn(text, SlowPathWarning, stacklevel=5)  # (the caller of ms_deform_attn)


def unserved(value, loc, attn, call, num_points_list):
    """The op on prepared tensors on a device the library does not serve: shapes alone on meta,
    else the pure-PyTorch op."""
    levels, sizes, _, flags = call
    if value.device.type == "meta":
        return _MetaMSDA.apply(value, loc, attn, sizes)
    return run_reference(value, levels.host if levels.host is not None else levels.shapes, loc,
                         attn, num_points_list, flags)


def run_reference(value, spatial_shapes, loc, attn, num_points_list, flags):
    """The pure-PyTorch op, for a device the library does not serve (a GPU without the
    library's CUDA kernels: with a SlowPathWarning, MPS, ...); with float32 points and a half
    value (the dtype rule, _args.points_dtype) it runs in float32 and rounds the output to
    value's dtype."""
    if value.is_cuda:
        slow_path(value.device)
    out = ms_deform_attn_pytorch(
        value if value.dtype is loc.dtype else value.to(loc.dtype), spatial_shapes, loc, attn,
        num_points_list=num_points_list,
        sampling="nearest" if flags & _clib.FLAG_NEAREST else "bilinear")
    return out if out.dtype is value.dtype else out.to(value.dtype)


class _MetaMSDA(torch.autograd.Function):
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

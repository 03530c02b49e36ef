"""torch.library: the ops pymsda::ms_deform_attn_forward and pymsda::ms_deform_attn_backward,
their fake (shape-only) implementations and autograd, and the traced call that uses them
(torch.compile, torch.export, fake tensors, dispatch modes), where a ctypes call cannot be
recorded. Registered only where the running torch has torch.library.custom_op."""
from typing import List, Optional, Tuple

import torch

from . import _clib
from ._autograd import _backward, _forward, _reference
from ._clib import serves as _library_serves
from ._checks import (_check_float_tensor, _check_grad_output, _check_pairs, _check_shapes_only,
                      _point_counts)
from ._plan import _points, _prepare
from ._tables import _starts_of

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
    value, levels, loc, attn, sizes, lp = _prepare(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        num_points_list=num_points_list)
    return _forward(value, levels, loc, attn, sizes, lp, flags)


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
    B, S, H, C, L, Q, P = _check_shapes_only(value, spatial_shapes, level_start_index,
                                             sampling_locations, attention_weights,
                                             num_points_list)
    return value.new_empty((B, Q, H * C))


def _backward_impl(grad_output: torch.Tensor, value: torch.Tensor, spatial_shapes: torch.Tensor,
                   level_start_index: Optional[torch.Tensor], sampling_locations: torch.Tensor,
                   attention_weights: torch.Tensor, num_points_list: Optional[List[int]],
                   flags: int, need_value: bool, need_sampling_locations: bool,
                   need_attention_weights: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    v, levels, loc, attn, sizes, lp = _prepare(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        num_points_list=num_points_list)
    B, S, H, C, L, Q, P = sizes
    _check_grad_output(grad_output, B, Q, H, C, v.device)
    grads = _backward(grad_output, v, levels, loc, attn, sizes, need_value,
                      need_sampling_locations, need_attention_weights, lp, flags)
    return tuple(torch.empty((0,), dtype=like.dtype, device=like.device) if grad is None
                 else grad.to(like.dtype)
                 for grad, like in zip(grads, (value, sampling_locations, attention_weights)))


def _backward_fake(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, num_points_list, flags, need_value,
                   need_sampling_locations, need_attention_weights):
    B, S, H, C, L, Q, P = _check_shapes_only(value, spatial_shapes, level_start_index,
                                             sampling_locations, attention_weights,
                                             num_points_list)
    _check_grad_output(grad_output, B, Q, H, C, value.device)
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


def _ms_deform_attn_traced(value, spatial_shapes, level_start_index, sampling_locations,
                           attention_weights, num_points_list, flags):
    """ms_deform_attn through pymsda::ms_deform_attn_forward. Written for torch.compile to
    trace: no data is read; host-side shape lists are checked here and become constant tensors
    of the graph; the op's fake implementation checks the rest, its real one checks again."""
    per_level = num_points_list is None
    _check_float_tensor("value", value, 4)
    _check_float_tensor("sampling_locations", sampling_locations, 6 if per_level else 5)
    _check_float_tensor("attention_weights", attention_weights, 5 if per_level else 4)
    device = value.device
    if not isinstance(spatial_shapes, torch.Tensor):
        pairs = _check_pairs(spatial_shapes)
        starts, total = _starts_of(pairs)
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
        num_points_list = list(_point_counts(num_points_list, spatial_shapes.shape[0]))
    sampling_locations, attention_weights = _points(value.dtype, sampling_locations,
                                                    attention_weights)
    if not _library_serves(device):
        return _reference(value, spatial_shapes, sampling_locations, attention_weights,
                          num_points_list, flags)
    return _forward_op(value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights, num_points_list, flags)

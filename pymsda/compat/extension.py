"""The interface of Deformable DETR's compiled extension `MultiScaleDeformableAttention`, on
pymsda; pymsda.compat.install() registers this module under that name.

    ms_deform_attn_forward(value, value_spatial_shapes, value_level_start_index,
                           sampling_locations, attention_weights, im2col_step) -> output
    ms_deform_attn_backward(value, value_spatial_shapes, value_level_start_index,
                            sampling_locations, attention_weights, grad_output, im2col_step)
        -> [grad_value, grad_sampling_loc, grad_attn_weight]

Shapes as in pymsda.ms_deform_attn: value (B, S, H, C), spatial_shapes (L, 2),
level_start_index (L,), sampling_locations (B, Q, H, L, P, 2), attention_weights
(B, Q, H, L, P), output and grad_output (B, Q, H*C); each gradient has the shape and dtype of
its input. im2col_step is accepted and ignored (any batch size works). Like the extension,
neither function records an autograd graph: the caller's autograd.Function does that.
"""
from typing import Any

import torch

from .. import _clib, ops
from .._torch_private import script_unsupported_because as _script_unsupported
from ..ops import ms_deform_attn

__all__ = ["ms_deform_attn_forward", "ms_deform_attn_backward"]


def ms_deform_attn_forward(value, value_spatial_shapes: Any, value_level_start_index: Any,
                           sampling_locations, attention_weights, im2col_step: int):
    # annotated for torch.jit.script, which records the op pymsda::ms_deform_attn
    with torch.no_grad():
        return ms_deform_attn(value, value_spatial_shapes, value_level_start_index,
                              sampling_locations, attention_weights)


def _kernel_backward_serves(value, value_spatial_shapes):
    """Whether the registered backward op (torch.ops.pymsda.ms_deform_attn_backward) can run
    this call directly: it exists (torch >= 2.4), the shapes are a tensor, and the library
    serves value's device (the library's own rule: its kernels run there)."""
    return (ops.HAS_TORCH_LIBRARY_OPS and isinstance(value, torch.Tensor)
            and isinstance(value_spatial_shapes, torch.Tensor) and _clib.serves(value.device))


def ms_deform_attn_backward(value, value_spatial_shapes, value_level_start_index,
                            sampling_locations, attention_weights, grad_output, im2col_step):
    if _kernel_backward_serves(value, value_spatial_shapes):
        # Straight into pymsda's backward kernel, no forward recomputed.
        flags = _clib.FLAG_DETERMINISTIC if torch.are_deterministic_algorithms_enabled() else 0
        with torch.no_grad():
            grads = torch.ops.pymsda.ms_deform_attn_backward(
                grad_output.detach(), value.detach(), value_spatial_shapes,
                value_level_start_index, sampling_locations.detach(),
                attention_weights.detach(), None, flags, True, True, True)
        return list(grads)
    # Elsewhere (older torch, a list of shapes, a device served by the pure-PyTorch fallback),
    # through pymsda's autograd: one forward is recomputed.
    leaves = [t.detach().requires_grad_(True)
              for t in (value, sampling_locations, attention_weights)]
    with torch.enable_grad():
        output = ms_deform_attn(leaves[0], value_spatial_shapes, value_level_start_index,
                                leaves[1], leaves[2])
        grads = torch.autograd.grad(output, leaves, grad_output)
    return list(grads)


# called by the caller's autograd.Function, which TorchScript cannot compile anyway
_script_unsupported(ms_deform_attn_backward, "Deformable DETR's autograd.Function calls it")

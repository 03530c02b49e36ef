"""The interface of Deformable DETR's compiled extension `MultiScaleDeformableAttention`, on
pymsda; pymsda.compat.install() registers this module under that name.

    ms_deform_attn_forward(value, value_spatial_shapes, value_level_start_index,
                           sampling_locations, attention_weights, im2col_step) -> output
    ms_deform_attn_backward(value, value_spatial_shapes, value_level_start_index,
                            sampling_locations, attention_weights, grad_output, im2col_step)
        -> [grad_value, grad_sampling_loc, grad_attn_weight]

Shapes as in pymsda.ms_deform_attn: value (B, S, H, C), spatial_shapes (L, 2),
level_start_index (L,), sampling_locations (B, Q, H, L, P, 2), attention_weights
(B, Q, H, L, P), output and grad_output (B, Q, H*C). im2col_step is accepted and ignored (any
batch size works). Like the extension, neither function records an autograd graph: the caller's
autograd.Function does that.
"""
import torch

from ..ops import ms_deform_attn

__all__ = ["ms_deform_attn_forward", "ms_deform_attn_backward"]


def ms_deform_attn_forward(value, value_spatial_shapes, value_level_start_index,
                           sampling_locations, attention_weights, im2col_step):
    with torch.no_grad():
        return ms_deform_attn(value, value_spatial_shapes, value_level_start_index,
                              sampling_locations, attention_weights)


def ms_deform_attn_backward(value, value_spatial_shapes, value_level_start_index,
                            sampling_locations, attention_weights, grad_output, im2col_step):
    # Through pymsda's autograd: one forward is recomputed, the backward is pymsda's kernel.
    leaves = [t.detach().requires_grad_(True)
              for t in (value, sampling_locations, attention_weights)]
    with torch.enable_grad():
        output = ms_deform_attn(leaves[0], value_spatial_shapes, value_level_start_index,
                                leaves[1], leaves[2])
        grads = torch.autograd.grad(output, leaves, grad_output)
    return list(grads)

"""HF transformers' MSDA kernel layer (the `MultiScaleDeformableAttention` module that Deformable
DETR, RT-DETR, Grounding DINO, OmDet-Turbo and others call, and the hub kernel replaces), on
pymsda.

    MultiScaleDeformableAttention()(value, value_spatial_shapes, value_spatial_shapes_list,
                                    level_start_index, sampling_locations, attention_weights,
                                    im2col_step) -> (batch, num_queries, num_heads * hidden_dim)

value (batch, S, num_heads, hidden_dim); value_spatial_shapes (L, 2) tensor and
value_spatial_shapes_list the same (H, W) pairs as a Python list (pymsda reads the list, so a
GPU shape tensor is never synchronised on); level_start_index (L,); sampling_locations
(batch, num_queries, num_heads, L, P, 2); attention_weights (batch, num_queries, num_heads, L, P).
The module has no parameters, like the original. MultiScaleDeformableAttentionFunction is the
autograd function of older transformers releases, same call shape as Deformable DETR's.
"""
from torch import nn

from ..ops import MSDeformAttnFunction, ms_deform_attn

__all__ = ["MultiScaleDeformableAttention", "MultiScaleDeformableAttentionFunction"]

MultiScaleDeformableAttentionFunction = MSDeformAttnFunction


class MultiScaleDeformableAttention(nn.Module):
    def forward(self, value, value_spatial_shapes, value_spatial_shapes_list, level_start_index,
                sampling_locations, attention_weights, im2col_step=None):
        shapes = value_spatial_shapes_list
        if shapes is None:
            shapes = value_spatial_shapes
        return ms_deform_attn(value, shapes, level_start_index, sampling_locations,
                              attention_weights, im2col_step)

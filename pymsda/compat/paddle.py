"""The Paddle RT-DETR / RT-DETRv3 custom op `ms_deformable_attn` (PaddleDetection's
ext_op, with deformable_attention_core_func as its fallback), on torch tensors and pymsda.

    ms_deformable_attn(value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights) -> (bs, query_length, n_head * c)

value (bs, value_length, n_head, c), spatial_shapes (n_levels, 2) rows (H, W),
level_start_index (n_levels,), sampling_locations (bs, query_length, n_head, n_levels,
n_points, 2), attention_weights (bs, query_length, n_head, n_levels, n_points).
"""
from ..ops import ms_deform_attn

__all__ = ["ms_deformable_attn"]


def ms_deformable_attn(value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights):
    return ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                          attention_weights)

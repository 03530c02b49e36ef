"""The Paddle RT-DETR / RT-DETRv3 custom op `ms_deformable_attn` (PaddleDetection's
ext_op, with deformable_attention_core_func as its fallback), on torch tensors and pymsda.

    ms_deformable_attn(value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights) -> (bs, query_length, n_head * c)
    deformable_attention_core_func(value, value_spatial_shapes, value_level_start_index,
                                   sampling_locations, attention_weights)
        the same call under the name of PaddleDetection's fallback (its five arguments, unlike
        the four of the PyTorch RT-DETR function in pymsda.compat.rtdetr)

value (bs, value_length, n_head, c), spatial_shapes (n_levels, 2) rows (H, W) (a tensor or a
list), level_start_index (n_levels,), sampling_locations (bs, query_length, n_head, n_levels,
n_points, 2), attention_weights (bs, query_length, n_head, n_levels, n_points). Both run
pymsda's kernels.
"""
from typing import Any

from ..ops import ms_deform_attn

__all__ = ["ms_deformable_attn", "deformable_attention_core_func"]


# Annotated for torch.jit.script, which records the op pymsda::ms_deform_attn for both.
def ms_deformable_attn(value, spatial_shapes: Any, level_start_index: Any, sampling_locations,
                       attention_weights):
    return ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                          attention_weights)


def deformable_attention_core_func(value, value_spatial_shapes: Any,
                                   value_level_start_index: Any, sampling_locations,
                                   attention_weights):
    return ms_deform_attn(value, value_spatial_shapes, value_level_start_index,
                          sampling_locations, attention_weights)

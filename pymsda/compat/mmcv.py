"""mmcv's MSDA functions (mmcv.ops.multi_scale_deform_attn), on pymsda.

    MultiScaleDeformableAttnFunction.apply(value, value_spatial_shapes, value_level_start_index,
                                           sampling_locations, attention_weights, im2col_step)
        -> (bs, num_queries, num_heads * embed_dims_per_head). mmcv casts
        sampling_locations and attention_weights to value's dtype; this follows
        ms_deform_attn's dtype rule instead (float32 points with a half value are read as
        float32), so under AMP it is more precise than mmcv, never less; output and gradient
        dtypes are mmcv's
    multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                        attention_weights)      (the pure-PyTorch path)
"""
from ..ops import ms_deform_attn
from ..reference import ms_deform_attn_pytorch

__all__ = ["MultiScaleDeformableAttnFunction", "multi_scale_deformable_attn_pytorch"]


class MultiScaleDeformableAttnFunction:
    """mmcv's autograd function: only `apply` is called by user code."""

    @staticmethod
    def apply(value, value_spatial_shapes, value_level_start_index, sampling_locations,
              attention_weights, im2col_step=64):
        return ms_deform_attn(value, value_spatial_shapes, value_level_start_index,
                              sampling_locations, attention_weights, im2col_step)


def multi_scale_deformable_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                        attention_weights):
    """The pure-PyTorch MSDA (grid_sample): value (bs, num_keys, num_heads, embed_dims //
    num_heads), value_spatial_shapes (num_levels, 2) rows (h, w), sampling_locations (bs,
    num_queries, num_heads, num_levels, num_points, 2), attention_weights (bs, num_queries,
    num_heads, num_levels, num_points) -> (bs, num_queries, embed_dims)."""
    return ms_deform_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                  attention_weights)

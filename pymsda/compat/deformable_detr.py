"""Deformable DETR's MSDA entry points (models/ops/functions and models/ops/modules), on pymsda.

    MSDeformAttnFunction.apply(value, value_spatial_shapes, value_level_start_index,
                               sampling_locations, attention_weights, im2col_step)
    ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations,
                                attention_weights)          (the pure-PyTorch path)
    MSDeformAttn(d_model=256, n_levels=4, n_heads=8, n_points=4), same parameters and forward
        (query, reference_points, input_flatten, input_spatial_shapes,
         input_level_start_index, input_padding_mask=None)

Replace `from models.ops.modules import MSDeformAttn` (or `from models.ops.functions import
...`) with `from pymsda.compat.deformable_detr import ...`; or keep the code as it is and call
pymsda.compat.install() to serve `import MultiScaleDeformableAttention as MSDA`.
"""
from ..modules import MSDeformAttn
from ..ops import MSDeformAttnFunction
from ..reference import ms_deform_attn_pytorch

__all__ = ["MSDeformAttnFunction", "ms_deform_attn_core_pytorch", "MSDeformAttn"]


def ms_deform_attn_core_pytorch(value, value_spatial_shapes, sampling_locations,
                                attention_weights):
    """The pure-PyTorch MSDA (grid_sample): value (N, S, M, D), value_spatial_shapes (L, 2),
    sampling_locations (N, Lq, M, L, P, 2), attention_weights (N, Lq, M, L, P) ->
    (N, Lq, M*D)."""
    return ms_deform_attn_pytorch(value, value_spatial_shapes, sampling_locations,
                                  attention_weights)

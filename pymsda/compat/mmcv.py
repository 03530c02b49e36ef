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
    MultiScaleDeformableAttention(embed_dims=256, num_heads=8, num_levels=4, num_points=4,
                                  im2col_step=64, dropout=0.1, batch_first=False,
                                  norm_cfg=None, init_cfg=None, value_proj_ratio=1.0)
        mmcv's module (mmcv.ops.MultiScaleDeformableAttention, mmcv 2.x): the same constructor
        arguments, parameters (state_dict keys), initialisation and forward, on pymsda on every
        device (mmcv runs its compiled op on CUDA only, the pure-PyTorch one elsewhere). mmcv-lite
        (and an mmcv whose compiled ops do not build) has no such module: where mmengine is
        installed and mmcv's compiled ops are not, this one is registered in mmengine's MODELS
        registry under mmcv's name, so configs naming type="MultiScaleDeformableAttention" (e.g.
        mmcv's BaseTransformerLayer attn_cfgs) build it once pymsda.compat.mmcv is imported.
"""
import importlib.util
import math
import os
import warnings
from typing import Any

import torch
from torch import nn

from .._torch_private import not_scriptable as _not_scriptable
from ..ops import ms_deform_attn
from ..reference import ms_deform_attn_pytorch
from . import _switch

__all__ = ["MultiScaleDeformableAttnFunction", "multi_scale_deformable_attn_pytorch",
           "MultiScaleDeformableAttention"]


class MultiScaleDeformableAttnFunction:
    """mmcv's autograd function: only `apply` is called by user code."""

    @staticmethod  # annotated for torch.jit.script (the op pymsda::ms_deform_attn)
    def apply(value, value_spatial_shapes: Any, value_level_start_index: Any, sampling_locations,
              attention_weights, im2col_step: int = 64):
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


class MultiScaleDeformableAttention(nn.Module):
    """mmcv's MultiScaleDeformableAttention (see the module docstring). forward(query, key=None,
    value=None, identity=None, query_pos=None, key_padding_mask=None, reference_points=None,
    spatial_shapes=None, level_start_index=None, **kwargs): query (num_query, bs, embed_dims)
    ((bs, num_query, embed_dims) with batch_first), value (num_value, bs, embed_dims) (query when
    None), key_padding_mask (bs, num_value) True at padding, reference_points (bs, num_query,
    num_levels, 2 or 4) in [0, 1], spatial_shapes (num_levels, 2) rows (h, w), level_start_index
    (num_levels,) -> dropout(output_proj(MSDA)) + identity, query's shape. The deprecated keyword
    residual is taken for identity, as in mmcv. While a tracer or exporter runs the MSDA is the
    pure-PyTorch one, which is what mmcv's module records off CUDA."""

    __prepare_scriptable__ = _not_scriptable  # (**kwargs, like mmcv's) say what works instead

    def __init__(self, embed_dims=256, num_heads=8, num_levels=4, num_points=4, im2col_step=64,
                 dropout=0.1, batch_first=False, norm_cfg=None, init_cfg=None,
                 value_proj_ratio=1.0):
        super().__init__()
        if embed_dims % num_heads != 0:
            raise ValueError(f"embed_dims must be divisible by num_heads, but got {embed_dims} "
                             f"and {num_heads}")
        self.init_cfg = init_cfg  # mmengine's BaseModule attribute; weights start as mmcv's
        self.norm_cfg = norm_cfg
        self.dropout = nn.Dropout(dropout)
        self.batch_first = batch_first
        self.im2col_step = im2col_step
        self.embed_dims, self.num_levels = embed_dims, num_levels
        self.num_heads, self.num_points = num_heads, num_points
        self.sampling_offsets = nn.Linear(embed_dims, num_heads * num_levels * num_points * 2)
        self.attention_weights = nn.Linear(embed_dims, num_heads * num_levels * num_points)
        value_proj_size = int(embed_dims * value_proj_ratio)
        self.value_proj = nn.Linear(embed_dims, value_proj_size)
        self.output_proj = nn.Linear(value_proj_size, embed_dims)
        self.init_weights()

    def init_weights(self):
        """mmcv's initialisation: head h's points along the angle 2*pi*h/num_heads (the larger
        component scaled to 1), point k (1-based) k times as far; zero attention weights;
        xavier-uniform projections with zero bias."""
        nn.init.constant_(self.sampling_offsets.weight, 0.0)
        device = self.sampling_offsets.weight.device
        angles = torch.arange(self.num_heads, dtype=torch.float32, device=device) * (
            2.0 * math.pi / self.num_heads)
        direction = torch.stack([angles.cos(), angles.sin()], -1)
        direction = direction / direction.abs().max(-1, keepdim=True)[0]
        steps = torch.arange(1, self.num_points + 1, dtype=torch.float32, device=device)
        bias = direction[:, None, None, :] * steps[None, None, :, None]
        bias = bias.expand(self.num_heads, self.num_levels, self.num_points, 2)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(bias.reshape(-1))
        nn.init.constant_(self.attention_weights.weight, 0.0)
        nn.init.constant_(self.attention_weights.bias, 0.0)
        for layer in (self.value_proj, self.output_proj):
            nn.init.xavier_uniform_(layer.weight, gain=1)
            nn.init.constant_(layer.bias, 0.0)
        self._is_init = True

    def forward(self, query, key=None, value=None, identity=None, query_pos=None,
                key_padding_mask=None, reference_points=None, spatial_shapes=None,
                level_start_index=None, **kwargs):
        if "residual" in kwargs:  # mmcv's deprecated name of identity
            if identity is not None:
                raise ValueError("pass identity or its deprecated name residual, not both")
            warnings.warn('"residual" is deprecated in `MultiScaleDeformableAttention.forward`, '
                          'please use "identity" instead', DeprecationWarning, stacklevel=2)
            identity = kwargs.pop("residual")
        if value is None:
            value = query
        if identity is None:
            identity = query
        if query_pos is not None:
            query = query + query_pos
        if not self.batch_first:
            query, value = query.permute(1, 0, 2), value.permute(1, 0, 2)
        bs, num_query, _ = query.shape
        num_value = value.shape[1]
        value = self.value_proj(value)
        if key_padding_mask is not None:
            value = value.masked_fill(key_padding_mask[..., None], 0.0)
        value = value.view(bs, num_value, self.num_heads, -1)
        offsets = self.sampling_offsets(query).view(
            bs, num_query, self.num_heads, self.num_levels, self.num_points, 2)
        attention_weights = self.attention_weights(query).view(
            bs, num_query, self.num_heads, self.num_levels * self.num_points).softmax(-1)
        attention_weights = attention_weights.view(
            bs, num_query, self.num_heads, self.num_levels, self.num_points)
        if reference_points.shape[-1] == 2:
            normalizer = torch.stack([spatial_shapes[..., 1], spatial_shapes[..., 0]], -1)
            sampling_locations = (reference_points[:, :, None, :, None, :]
                                  + offsets / normalizer[None, None, None, :, None, :])
        elif reference_points.shape[-1] == 4:
            sampling_locations = (reference_points[:, :, None, :, None, :2]
                                  + offsets / self.num_points
                                  * reference_points[:, :, None, :, None, 2:] * 0.5)
        else:
            raise ValueError(f"Last dim of reference_points must be 2 or 4, but get "
                             f"{reference_points.shape[-1]} instead.")
        if _switch.exporting():
            output = ms_deform_attn_pytorch(value, spatial_shapes, sampling_locations,
                                            attention_weights)
        else:
            output = ms_deform_attn(value, spatial_shapes, level_start_index,
                                    sampling_locations, attention_weights)
        output = self.output_proj(output)
        if not self.batch_first:
            output = output.permute(1, 0, 2)
        return self.dropout(output) + identity


def _mmcv_has_compiled_ops():
    """Whether the installed mmcv ships its compiled ops (mmcv/_ext*.so), found without importing
    mmcv (whose import is slow): then mmcv's own module is the one to register."""
    spec = importlib.util.find_spec("mmcv")
    if spec is None or not spec.submodule_search_locations:
        return False
    return any(name.startswith("_ext") for folder in spec.submodule_search_locations
               if os.path.isdir(folder) for name in os.listdir(folder))


def _register():
    """Registers MultiScaleDeformableAttention in mmengine's MODELS where mmengine is installed,
    mmcv's compiled ops are not and the name is free. Returns whether it did."""
    if importlib.util.find_spec("mmengine") is None or _mmcv_has_compiled_ops():
        return False
    from mmengine.registry import MODELS
    if MODELS.get("MultiScaleDeformableAttention") is not None:
        return False
    MODELS.register_module(name="MultiScaleDeformableAttention",
                           module=MultiScaleDeformableAttention)
    return True


REGISTERED = _register()

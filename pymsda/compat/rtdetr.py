"""RT-DETR's and RT-DETRv2's MSDA functions (lyuwenyu/RT-DETR, rtdetr_pytorch and
rtdetrv2_pytorch: src/zoo/rtdetr/utils.py) and RT-DETRv2's MSDeformableAttention module, on
pymsda's kernels.

    deformable_attention_core_func(value, value_spatial_shapes, sampling_locations,
                                   attention_weights)                           (RT-DETR v1)
        value (bs, value_length, n_head, c); value_spatial_shapes a list of (H, W) (or an
        (n_levels, 2) tensor); sampling_locations (bs, query_length, n_head, n_levels,
        n_points, 2); attention_weights (bs, query_length, n_head, n_levels, n_points)
        -> (bs, query_length, n_head * c)
    deformable_attention_core_func_v2(value, value_spatial_shapes, sampling_locations,
                                      attention_weights, num_points_list, method="default")
        sampling_locations (bs, query_length, n_head, sum(num_points_list), 2), attention_weights
        (bs, query_length, n_head, sum(num_points_list)), level 0's points first;
        method "default" samples bilinearly, "discrete" reads the nearest pixel
        (clamp(floor(x*W + 0.5), 0, W-1), clamp(floor(y*H + 0.5), 0, H-1)) and passes no
        location gradient. value is RT-DETRv2's (bs, value_length, n_head, c), or the list of
        per-level (bs, n_head, c, H_l*W_l) tensors that D-FINE-style forks of it pass.
        -> (bs, query_length, n_head * c)

Difference from the original "discrete": RT-DETRv2 clamps both pixel coordinates to H-1, which
on a non-square level reads a wrong (or out-of-range) pixel; here each axis is clamped to its
own size. On square levels the two agree.
"""
import functools
from typing import Any, List

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn import init

from .._torch_private import not_scriptable as _not_scriptable
from ..modules import initial_sampling_offsets
from ..ops import ms_deform_attn

__all__ = ["deformable_attention_core_func", "deformable_attention_core_func_v2",
           "MSDeformableAttention"]

_SAMPLING = {"default": "bilinear", "discrete": "nearest"}


# The two functions are annotated for torch.jit.script, which records the op
# pymsda::ms_deform_attn for them (value a tensor: D-FINE's list of levels is eager only).
def deformable_attention_core_func(value, value_spatial_shapes: Any, sampling_locations,
                                   attention_weights):
    return ms_deform_attn(value, value_spatial_shapes, None, sampling_locations,
                          attention_weights)


def _value_from_levels(levels):
    """D-FINE's per-level (bs, n_head, c, H_l*W_l) tensors as one (bs, S, n_head, c) tensor."""
    return torch.cat(list(levels), dim=-1).permute(0, 3, 1, 2)


def deformable_attention_core_func_v2(value, value_spatial_shapes: Any, sampling_locations,
                                      attention_weights, num_points_list: List[int],
                                      method: str = "default"):
    if method == "default":
        sampling = "bilinear"
    elif method == "discrete":
        sampling = "nearest"
    else:
        raise ValueError(f"method must be 'default' or 'discrete', got '{method}'")
    if isinstance(value, (list, tuple)):
        value = _value_from_levels(value)
    return ms_deform_attn(value, value_spatial_shapes, None, sampling_locations,
                          attention_weights, num_points_list=list(num_points_list),
                          sampling=sampling)


class MSDeformableAttention(nn.Module):
    """RT-DETRv2's decoder cross-attention: same constructor, parameter and buffer names
    (sampling_offsets, attention_weights, value_proj, output_proj, num_points_scale),
    initialisation and forward as rtdetrv2_decoder.MSDeformableAttention, so its checkpoints
    load; so do those of RT-DETR (v1)'s MSDeformableAttention (same parameters, no
    num_points_scale buffer, which is then taken from num_points). num_points is an int (every
    level) or a list of per-level counts.

    forward(query (bs, Lq, C), reference_points (bs, Lq, 1 or n_levels, 2 or 4) in [0, 1]
    (points, or boxes (cx, cy, w, h)), value (bs, Lv, C), value_spatial_shapes [(H, W), ...],
    value_mask (bs, Lv), True where the value is real, optional) -> (bs, Lq, C).

    The MSDA itself is the attribute ms_deformable_attn_core(value, value_spatial_shapes,
    sampling_locations, attention_weights, num_points_list), as in the original.
    """

    def __init__(self, embed_dim=256, num_heads=8, num_levels=4, num_points=4,
                 method="default", offset_scale=0.5):
        super().__init__()
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be divisible by num_heads "
                             f"({num_heads})")
        if method not in _SAMPLING:
            raise ValueError(f"method must be 'default' or 'discrete', got {method!r}")
        if isinstance(num_points, (list, tuple)):
            if len(num_points) != num_levels:
                raise ValueError(f"num_points lists {len(num_points)} counts for num_levels = "
                                 f"{num_levels} levels")
            num_points_list = [int(n) for n in num_points]
        else:
            num_points_list = [int(num_points)] * num_levels
        self.embed_dim, self.num_heads, self.num_levels = embed_dim, num_heads, num_levels
        self.head_dim = embed_dim // num_heads
        self.num_points_list = num_points_list
        self.offset_scale, self.method = offset_scale, method
        total = sum(num_points_list)
        self.total_points = num_heads * total
        # each point's offset is scaled by 1 / (the point count of its level)
        scale = [1.0 / n for n in num_points_list for _ in range(n)]
        self.register_buffer("num_points_scale", torch.tensor(scale, dtype=torch.float32))
        self.register_buffer("_level_of_point", torch.tensor(
            [level for level, n in enumerate(num_points_list) for _ in range(n)],
            dtype=torch.long), persistent=False)

        self.sampling_offsets = nn.Linear(embed_dim, self.total_points * 2)
        self.attention_weights = nn.Linear(embed_dim, self.total_points)
        self.value_proj = nn.Linear(embed_dim, embed_dim)
        self.output_proj = nn.Linear(embed_dim, embed_dim)
        self.ms_deformable_attn_core = functools.partial(deformable_attention_core_func_v2,
                                                         method=method)
        self._reset_parameters()
        if method == "discrete":  # nearest sampling passes no gradient to the offsets
            for p in self.sampling_offsets.parameters():
                p.requires_grad = False

    __prepare_scriptable__ = _not_scriptable  # say what works instead

    def _reset_parameters(self):
        # Deformable DETR's offsets, each level's points k = 1, 2, ... of its own count
        init.constant_(self.sampling_offsets.weight, 0)
        offsets = initial_sampling_offsets(self.num_heads, self.num_points_list)
        with torch.no_grad():
            self.sampling_offsets.bias.copy_(offsets.flatten())
        init.constant_(self.attention_weights.weight, 0)
        init.constant_(self.attention_weights.bias, 0)
        init.xavier_uniform_(self.value_proj.weight)
        init.constant_(self.value_proj.bias, 0)
        init.xavier_uniform_(self.output_proj.weight)
        init.constant_(self.output_proj.bias, 0)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # RT-DETR (v1)'s MSDeformableAttention has the same parameters but no num_points_scale
        # buffer; the buffer follows from num_points, so such a checkpoint loads (strict too).
        key = prefix + "num_points_scale"
        if key not in state_dict and prefix + "sampling_offsets.weight" in state_dict:
            state_dict[key] = self.num_points_scale.detach().clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def forward(self, query, reference_points, value, value_spatial_shapes, value_mask=None):
        bs, len_q = query.shape[:2]
        len_v = value.shape[1]
        points = sum(self.num_points_list)
        value = self.value_proj(value)
        if value_mask is not None:
            value = value * value_mask.to(value.dtype).unsqueeze(-1)
        value = value.reshape(bs, len_v, self.num_heads, self.head_dim)
        offsets = self.sampling_offsets(query).reshape(bs, len_q, self.num_heads, points, 2)
        weights = F.softmax(self.attention_weights(query).reshape(
            bs, len_q, self.num_heads, points), dim=-1)

        # reference_points per level (n_levels) or shared (1): one row per point either way
        ref = reference_points
        if ref.shape[2] != 1:
            ref = ref[:, :, self._level_of_point]  # (bs, Lq, points, 2 or 4)
        ref = ref[:, :, None]  # (bs, Lq, 1, 1 or points, 2 or 4)
        if ref.shape[-1] == 2:
            shapes = torch.as_tensor(value_spatial_shapes, dtype=offsets.dtype,
                                     device=offsets.device).reshape(-1, 2)
            normalizer = shapes.flip(-1)[self._level_of_point]  # (points, 2) as (W, H)
            locations = ref + offsets / normalizer
        elif ref.shape[-1] == 4:
            scale = self.num_points_scale.to(offsets.dtype)[:, None]
            locations = ref[..., :2] + offsets * scale * ref[..., 2:] * self.offset_scale
        else:
            raise ValueError("Last dim of reference_points must be 2 or 4, but got "
                             f"{reference_points.shape[-1]}")
        output = self.ms_deformable_attn_core(value, value_spatial_shapes, locations, weights,
                                              self.num_points_list)
        return self.output_proj(output)

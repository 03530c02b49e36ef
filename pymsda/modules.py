"""nn.Modules built on the op."""
import math
import warnings
from typing import Optional

import torch
from torch import nn

from ._args import shapes_tensor
from .ops import ms_deform_attn

__all__ = ["MSDeformAttn", "initial_sampling_offsets"]


def initial_sampling_offsets(num_heads, num_points_list, dtype=torch.float32, device=None):
    """Deformable DETR's initial sampling offsets, the bias of its sampling_offsets layer: a
    (num_heads, sum(num_points_list), 2) tensor of (x, y) offsets in pixels of each level,
    level 0's points first. Head h looks along the angle 2*pi*h/num_heads, that direction
    scaled so its larger component is 1, and the k-th point of each level (k = 1, 2, ...)
    starts k times as far, so the heads fan out around the reference point before training.
    MSDeformAttn, mmcv's and RT-DETRv2's modules and the benchmark's realistic inputs all start
    from it (each with its own layout of levels and points: reshape, do not recompute)."""
    angles = torch.arange(num_heads, dtype=dtype, device=device) * (2.0 * math.pi / num_heads)
    direction = torch.stack([angles.cos(), angles.sin()], -1)
    direction = direction / direction.abs().max(-1, keepdim=True).values
    steps = torch.cat([torch.arange(1, n + 1, dtype=dtype, device=device)
                       for n in num_points_list])
    return direction[:, None, :] * steps[None, :, None]


class MSDeformAttn(nn.Module):
    """Deformable DETR's multi-scale deformable attention module.

    Same constructor, parameter names (sampling_offsets, attention_weights, value_proj,
    output_proj), initialisation and forward signature as Deformable DETR's MSDeformAttn, so its
    checkpoints load unchanged. torch.jit.script compiles it (input_spatial_shapes a tensor),
    the MSDA as the op pymsda::ms_deform_attn (pymsda/_script.py).
    """

    def __init__(self, d_model=256, n_levels=4, n_heads=8, n_points=4):
        super().__init__()
        if d_model % n_heads != 0:
            raise ValueError(
                f"d_model must be divisible by n_heads, but got {d_model} and {n_heads}")
        head_dim = d_model // n_heads
        if head_dim & (head_dim - 1) != 0:
            warnings.warn("d_model / n_heads is not a power of 2; pymsda handles any size, "
                          "but powers of 2 are the fastest", stacklevel=2)
        self.im2col_step = 64  # kept for compatibility; pymsda ignores it
        self.d_model, self.n_levels, self.n_heads, self.n_points = d_model, n_levels, n_heads, n_points
        self.sampling_offsets = nn.Linear(d_model, n_heads * n_levels * n_points * 2)
        self.attention_weights = nn.Linear(d_model, n_heads * n_levels * n_points)
        self.value_proj = nn.Linear(d_model, d_model)
        self.output_proj = nn.Linear(d_model, d_model)
        self._reset_parameters()

    def _reset_parameters(self):
        nn.init.constant_(self.sampling_offsets.weight.data, 0.0)
        offsets = initial_sampling_offsets(self.n_heads, [self.n_points] * self.n_levels)
        with torch.no_grad():
            self.sampling_offsets.bias = nn.Parameter(offsets.flatten())
        nn.init.constant_(self.attention_weights.weight.data, 0.0)
        nn.init.constant_(self.attention_weights.bias.data, 0.0)
        nn.init.xavier_uniform_(self.value_proj.weight.data)
        nn.init.constant_(self.value_proj.bias.data, 0.0)
        nn.init.xavier_uniform_(self.output_proj.weight.data)
        nn.init.constant_(self.output_proj.bias.data, 0.0)

    def forward(self, query, reference_points, input_flatten, input_spatial_shapes,
                input_level_start_index, input_padding_mask: Optional[torch.Tensor] = None):
        """
        query (N, Len_q, d_model); reference_points (N, Len_q, n_levels, 2) as (x, y) in [0, 1]
        (top-left (0, 0), bottom-right (1, 1)) or (N, Len_q, n_levels, 4) as (x, y, w, h) boxes;
        input_flatten (N, S, d_model); input_spatial_shapes (n_levels, 2) rows (H, W);
        input_level_start_index (n_levels,); input_padding_mask (N, S), True for padding.
        Returns (N, Len_q, d_model).
        """
        N, Len_q, _ = query.shape
        N, Len_in, _ = input_flatten.shape
        value = self.value_proj(input_flatten)
        if input_padding_mask is not None:
            value = value.masked_fill(input_padding_mask[..., None], 0.0)
        value = value.view(N, Len_in, self.n_heads, self.d_model // self.n_heads)
        sampling_offsets = self.sampling_offsets(query).view(
            N, Len_q, self.n_heads, self.n_levels, self.n_points, 2)
        attention_weights = self.attention_weights(query).view(
            N, Len_q, self.n_heads, self.n_levels * self.n_points)
        attention_weights = attention_weights.softmax(-1).view(
            N, Len_q, self.n_heads, self.n_levels, self.n_points)
        if reference_points.shape[-1] == 2:
            # offsets are in pixels of each level: normalise by (W, H)
            shapes = shapes_tensor(input_spatial_shapes, query.device)
            normalizer = torch.stack([shapes[..., 1], shapes[..., 0]], -1).to(sampling_offsets)
            sampling_locations = (reference_points[:, :, None, :, None, :]
                                  + sampling_offsets / normalizer[None, None, None, :, None, :])
        elif reference_points.shape[-1] == 4:
            sampling_locations = (reference_points[:, :, None, :, None, :2]
                                  + sampling_offsets / self.n_points
                                  * reference_points[:, :, None, :, None, 2:] * 0.5)
        else:
            raise ValueError("Last dim of reference_points must be 2 or 4, but get "
                             f"{reference_points.shape[-1]} instead.")
        output = ms_deform_attn(value, input_spatial_shapes, input_level_start_index,
                                sampling_locations, attention_weights, self.im2col_step)
        return self.output_proj(output)

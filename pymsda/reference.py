"""The pure-PyTorch MSDA (grid_sample), the reference pymsda is tested against and the fallback
for devices the C library does not serve. Runs on any device and dtype grid_sample supports."""
import torch
import torch.nn.functional as F

from ._checks import check_sampling
from ._torch_private import script_unsupported_because

__all__ = ["ms_deform_attn_pytorch"]


def _pairs(spatial_shapes):
    if isinstance(spatial_shapes, torch.Tensor):
        return [tuple(p) for p in spatial_shapes.tolist()]
    return [(int(h), int(w)) for h, w in spatial_shapes]


def _nearest_sample(v, loc, h, w):
    """v (N, C, h, w), loc (N, Q, P, 2) in [0, 1] -> (N, C, Q, P): the pixel
    (clamp(floor(x*w + 0.5), 0, w-1), clamp(floor(y*h + 0.5), 0, h-1)), or 0 where the location
    is not finite. Positions are computed in float64 (exact for any float location)."""
    N, C = v.shape[:2]
    _, Q, P, _ = loc.shape
    exact = loc.to(torch.float32 if loc.device.type == "mps" else torch.float64)
    finite = torch.isfinite(exact).all(-1)  # (N, Q, P)
    exact = torch.nan_to_num(exact, nan=0.0, posinf=0.0, neginf=0.0)
    x = torch.floor(exact[..., 0] * w + 0.5).clamp(0, w - 1).long()
    y = torch.floor(exact[..., 1] * h + 0.5).clamp(0, h - 1).long()
    index = (y * w + x).reshape(N, 1, Q * P).expand(N, C, Q * P)
    sampled = v.reshape(N, C, h * w).gather(2, index).reshape(N, C, Q, P)
    return sampled * finite[:, None].to(v.dtype)


def ms_deform_attn_pytorch(value, spatial_shapes, sampling_locations, attention_weights, *,
                           num_points_list=None, sampling="bilinear", softmax=False):
    """value (B, S, H, C), spatial_shapes (L, 2) tensor or list of (H, W), sampling_locations
    (B, Q, H, L, P, 2) in [0, 1], attention_weights (B, Q, H, L, P) -> (B, Q, H*C).

    Each level is sampled with grid_sample(bilinear, zeros padding, align_corners=False) at
    grid = 2 * loc - 1, which puts x = loc_x * W - 0.5 in pixel units.

    The options of pymsda.ms_deform_attn, written with plain torch ops:
      num_points_list: L per-level point counts; sampling_locations is then (B, Q, H, N, 2) and
        attention_weights (B, Q, H, N), N = sum(num_points_list), level 0's points first.
      sampling="nearest": read the pixel (clamp(floor(x*W + 0.5), 0, W-1), clamp(floor(y*H +
        0.5), 0, H-1)) (RT-DETRv2's "discrete"); a non-finite location reads 0. No location
        gradient flows.
      softmax=True: attention_weights are logits, softmaxed over all points of each (b, q, h).
    """
    check_sampling(sampling)
    B, S, H, C = value.shape
    Q = sampling_locations.shape[1]
    pairs = _pairs(spatial_shapes)
    L = len(pairs)
    if num_points_list is None:
        P = sampling_locations.shape[4]
        counts = [P] * L
        sampling_locations = sampling_locations.flatten(3, 4)
        attention_weights = attention_weights.flatten(3, 4)
    else:
        counts = [int(n) for n in num_points_list]
        if len(counts) != L:
            raise ValueError(f"num_points_list has {len(counts)} entries for {L} levels")
    N = sum(counts)
    if softmax:  # in float32 at least (torch 1.13 has no half softmax on the CPU)
        dtype = attention_weights.dtype
        attention_weights = torch.softmax(attention_weights, -1, dtype=torch.promote_types(
            dtype, torch.float32)).to(dtype)
    per_level = value.split([h * w for h, w in pairs], dim=1)
    locations = sampling_locations.split(counts, dim=3)  # (B, Q, H, P_l, 2) each
    samples = []
    for level, (h, w) in enumerate(pairs):
        P_l = counts[level]
        # (B, h*w, H, C) -> (B*H, C, h, w)
        v = per_level[level].permute(0, 2, 3, 1).reshape(B * H, C, h, w)
        # (B, Q, H, P_l, 2) -> (B*H, Q, P_l, 2)
        loc = locations[level].transpose(1, 2).reshape(B * H, Q, P_l, 2)
        if P_l == 0:
            samples.append(v.new_zeros(B * H, C, Q, 0))
        elif sampling == "nearest":
            samples.append(_nearest_sample(v, loc, h, w))
        else:
            samples.append(F.grid_sample(v, 2 * loc - 1, mode="bilinear", padding_mode="zeros",
                                         align_corners=False))  # (B*H, C, Q, P_l)
    sampled = torch.cat(samples, dim=-1)  # (B*H, C, Q, N)
    weights = attention_weights.transpose(1, 2).reshape(B * H, 1, Q, N)
    out = (sampled * weights).sum(-1)  # (B*H, C, Q)
    return out.view(B, H * C, Q).transpose(1, 2).contiguous()


script_unsupported_because(ms_deform_attn_pytorch, "the pure-PyTorch MSDA reads the level sizes on the "
                    "host, as mmcv's and Deformable DETR's do")


def rel_l2(actual, expected):
    """||actual - expected|| / ||expected|| in float64 (expected usually a float64 reference):
    the error measure of the self-check and the bench."""
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300)).item()

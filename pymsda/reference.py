"""The pure-PyTorch MSDA (grid_sample), the reference pymsda is tested against and the fallback
for devices the C library does not serve. Runs on any device and dtype grid_sample supports."""
import torch
import torch.nn.functional as F

__all__ = ["ms_deform_attn_pytorch"]


def _pairs(spatial_shapes):
    if isinstance(spatial_shapes, torch.Tensor):
        return [tuple(p) for p in spatial_shapes.tolist()]
    return [(int(h), int(w)) for h, w in spatial_shapes]


def ms_deform_attn_pytorch(value, spatial_shapes, sampling_locations, attention_weights):
    """value (B, S, H, C), spatial_shapes (L, 2) tensor or list of (H, W), sampling_locations
    (B, Q, H, L, P, 2) in [0, 1], attention_weights (B, Q, H, L, P) -> (B, Q, H*C).

    Each level is sampled with grid_sample(bilinear, zeros padding, align_corners=False) at
    grid = 2 * loc - 1, which puts x = loc_x * W - 0.5 in pixel units."""
    B, S, H, C = value.shape
    _, Q, _, L, P, _ = sampling_locations.shape
    pairs = _pairs(spatial_shapes)
    per_level = value.split([h * w for h, w in pairs], dim=1)
    grids = 2 * sampling_locations - 1
    samples = []
    for level, (h, w) in enumerate(pairs):
        # (B, h*w, H, C) -> (B*H, C, h, w)
        v = per_level[level].permute(0, 2, 3, 1).reshape(B * H, C, h, w)
        # (B, Q, H, P, 2) -> (B*H, Q, P, 2)
        g = grids[:, :, :, level].transpose(1, 2).reshape(B * H, Q, P, 2)
        samples.append(F.grid_sample(v, g, mode="bilinear", padding_mode="zeros",
                                     align_corners=False))  # (B*H, C, Q, P)
    sampled = torch.stack(samples, dim=-2).flatten(-2)  # (B*H, C, Q, L*P)
    weights = attention_weights.transpose(1, 2).reshape(B * H, 1, Q, L * P)
    out = (sampled * weights).sum(-1)  # (B*H, C, Q)
    return out.view(B, H * C, Q).transpose(1, 2).contiguous()

"""The benchmark's problems: the named shapes (shapes.json) and their inputs, drawn as
Deformable DETR's layers see them ("realistic") or uniformly."""
import json
import os

import torch

from ..modules import initial_sampling_offsets

DISTRIBUTIONS = ("realistic", "uniform")
SHAPES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shapes.json")


def load_shapes():
    """shapes.json as a dict: groups "gpu" and "cpu" of {name: spec}, and "locations"."""
    with open(SHAPES_FILE, encoding="utf-8") as f:
        return json.load(f)


def pixel_centres(levels, dtype=torch.float64, device="cpu"):
    """(S, 2) normalised (x, y) of every value position's pixel centre, level by level, row-major."""
    centres = []
    for h, w in levels:
        ys = (torch.arange(h, dtype=dtype, device=device) + 0.5) / h
        xs = (torch.arange(w, dtype=dtype, device=device) + 0.5) / w
        grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
        centres.append(torch.stack([grid_x.reshape(-1), grid_y.reshape(-1)], -1))
    return torch.cat(centres)


def make_inputs(spec, dtype=torch.float32, device="cpu", dist="realistic", seed=0, noise=1.0,
                points32=False):
    """One input set for a shapes.json spec: a dict with value (B, S, H, C), spatial_shapes
    (a list of (H_l, W_l)), sampling_locations (B, Q, H, L, P, 2), attention_weights
    (B, Q, H, L, P) and grad_output (B, Q, H*C), all of `dtype` on `device`. `noise` is the
    standard deviation, in pixels, of the realistic offsets' noise. points32 (a half dtype):
    locations and weights stay float32, as under autocast, and value_exact holds the value
    before its rounding to `dtype`."""
    device = torch.device(device)
    levels = [(int(h), int(w)) for h, w in spec["levels"]]
    B, H, C, P, L = spec["B"], spec["H"], spec["C"], spec["P"], len(levels)
    S = sum(h * w for h, w in levels)
    encoder = spec.get("Q") is None
    Q = S if encoder else spec["Q"]
    draw = dict(generator=torch.Generator(device=device).manual_seed(seed), device=device,
                dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    value = torch.randn(B, S, H, C, **draw)
    if dist == "realistic":
        if encoder:
            reference = pixel_centres(levels, draw["dtype"], device).expand(B, Q, 2)
        else:
            reference = 0.05 + 0.9 * torch.rand(B, Q, 2, **draw)
        start = initial_sampling_offsets(H, [P] * L, draw["dtype"], device).view(H, L, P, 2)
        pixels = start + noise * torch.randn(B, Q, H, L, P, 2, **draw)
        level_sizes = torch.tensor([[w, h] for h, w in levels], dtype=draw["dtype"], device=device)
        locations = reference[:, :, None, None, None, :] + pixels / level_sizes[:, None, :]
        weights = torch.randn(B, Q, H, L * P, **draw).softmax(-1).view(B, Q, H, L, P)
    elif dist == "uniform":
        locations = torch.rand(B, Q, H, L, P, 2, **draw) * 1.1 - 0.05
        weights = torch.rand(B, Q, H, L, P, **draw)
        weights = weights / weights.sum((-2, -1), keepdim=True)
    else:
        raise ValueError(f"dist must be one of {DISTRIBUTIONS}, got {dist!r}")
    grad_output = torch.randn(B, Q, H * C, **draw)
    points = torch.float32 if points32 else dtype
    inputs = dict(value=value.to(dtype), spatial_shapes=levels,
                  sampling_locations=locations.to(points), attention_weights=weights.to(points),
                  grad_output=grad_output.to(dtype))
    if points32:
        inputs["value_exact"] = value
    return inputs

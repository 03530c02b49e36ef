"""MSDA written with plain torch operators that every ONNX exporter maps to standard ONNX ops:
what the op records under torch.onnx.export (both exporters) and, on a torch without
torch.library.custom_op, under torch.jit.trace (pymsda/export.py routes there).

Two forms, same numbers (math: c/msda.h; options as in ops.ms_deform_attn):

  "gather"       bilinear by hand: for every point the four corner pixels' row numbers in value
                 viewed as (B*S*H, C) and their weights (bilinear weight x attention weight x
                 inside-the-map), one Gather of all rows of all levels, one weighted sum. Needs
                 only opset 11 ops (Gather, Range, Floor, Clip, Where). value is read in its own
                 (B, S, H, C) layout: no transpose of value or of the output.
  "grid_sample"  per level: value as (B*H, C, H_l, W_l), GridSample (opset 16) at 2*loc - 1,
                 weighted sum over the points: the reference's structure (pymsda.reference).

Level sizes are Python ints (the graph is built for them); batch and query sizes stay symbolic
(dynamic axes). Half precision is computed in float32 (as the kernels accumulate) and the output
cast to value's dtype; float32 points with a half value are read as float32 (the dtype rule).
A non-finite location contributes nothing, as in the kernels: it is moved outside the map before
any index is computed (so no NaN reaches an integer cast), and so is any location beyond
[-1, 2], which is outside every level anyway.
"""
import torch
import torch.nn.functional as F

from ._args import level_starts

_FAR = -1.0  # a location outside every level: x = -W - 0.5, all four corners at x < 0


def _compute_dtype(value):
    """float64 for a float64 value, else float32 (the kernels accumulate half in float32, and
    read float32 points with a half value as float32)."""
    return torch.float64 if value.dtype == torch.float64 else torch.float32


def _finite_locations(loc):
    """(x, y, finite): loc's coordinates, (B, Q, H, N) each, with the points that have a
    non-finite coordinate moved to _FAR (outside every level) and every coordinate clamped to
    [-1, 2] (beyond it a point is outside every level anyway, and no index can overflow), and
    the mask of points whose coordinates were finite. Written without a broadcast condition,
    which ONNX Runtime's Where runs 50x slower than a same-shape one."""
    x, y = loc[..., 0], loc[..., 1]
    finite = (x - x + (y - y)) == 0  # NaN - NaN and inf - inf are NaN
    far = torch.full((), _FAR, dtype=loc.dtype, device=loc.device)
    x = torch.where(finite, torch.clamp(x, -1.0, 2.0), far)
    y = torch.where(finite, torch.clamp(y, -1.0, 2.0), far)
    return x, y, finite


def decompose(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
              counts=None, nearest=False, method="gather"):
    """MSDA in torch operators, (B, Q, H*C) in value's dtype. spatial_shapes: a list of (H, W)
    ints (constants of the graph) or an (L, 2) integer tensor (read by the graph when it runs,
    so level sizes may change; "gather" only); level_start_index: an (L,) tensor or None
    (derived); counts: per-level point counts (num_points_list) or None for the
    (B, Q, H, L, P, 2) layout."""
    if counts is None:
        L, P = sampling_locations.shape[3], sampling_locations.shape[4]
        counts = [P] * L
        sampling_locations = sampling_locations.flatten(3, 4)
        attention_weights = attention_weights.flatten(3, 4)
    counts = [int(n) for n in counts]
    dtype = _compute_dtype(value)
    v = value.to(dtype)
    loc = sampling_locations.to(dtype)
    attn = attention_weights.to(dtype)
    if nearest or method == "gather":
        out = _gather_form(v, spatial_shapes, level_start_index, loc, attn, counts, nearest)
    elif method == "grid_sample":
        if isinstance(spatial_shapes, torch.Tensor):
            raise ValueError("the grid_sample form needs spatial_shapes as a list of (H, W) "
                             "ints; the default form ('gather') takes a tensor")
        out = _grid_sample_form(v, spatial_shapes, loc, attn, counts)
    else:
        raise ValueError(f"method must be 'gather' or 'grid_sample', got {method!r}")
    return out.to(value.dtype)


def _level_vectors(spatial_shapes, level_start_index, counts, dtype, device):
    """Each point's level width and height (dtype) and start in S (int64), (N,) vectors:
    constants for a list of shapes, gathered from the tables when they are tensors."""
    level_of = [level for level, n in enumerate(counts) for _ in range(n)]
    if not isinstance(spatial_shapes, torch.Tensor):
        starts = level_starts(spatial_shapes)
        return (torch.tensor([float(spatial_shapes[l][1]) for l in level_of], dtype=dtype,
                             device=device),
                torch.tensor([float(spatial_shapes[l][0]) for l in level_of], dtype=dtype,
                             device=device),
                torch.tensor([starts[l] for l in level_of], dtype=torch.int64, device=device))
    shapes = spatial_shapes.to(device=device, dtype=torch.int64)
    if level_start_index is None:
        level_start_index = level_starts(shapes)
    # each point's level, built without torch.tensor (whose constant run_decompositions of an
    # ExportedProgram cannot functionalize: pymsda/export.py, exported_forward)
    which = torch.cat([torch.full((n,), level, dtype=torch.int64, device=device)
                       for level, n in enumerate(counts) if n])
    per_point = shapes.index_select(0, which)
    return (per_point[:, 1].to(dtype), per_point[:, 0].to(dtype),
            level_start_index.to(device=device, dtype=torch.int64).index_select(0, which))


def _split_levels(loc, attn, counts):
    """Per level (loc (B, Q, H, P_l, 2), attn (B, Q, H, P_l)), levels without points left out."""
    locs = loc.split(counts, dim=3)
    attns = attn.split(counts, dim=3)
    return [(level, locs[level], attns[level]) for level in range(len(counts)) if counts[level]]


def _gather_form(v, spatial_shapes, level_start_index, loc, attn, counts, nearest):
    """All levels at once: each point's level size and start are (N,) vectors, so the index
    arithmetic runs once over (B, Q, H, N)."""
    B, S, H, C = v.shape[0], v.shape[1], v.shape[2], v.shape[3]
    width, height, start = _level_vectors(spatial_shapes, level_start_index, counts,
                                          loc.dtype, v.device)
    x, y, finite = _finite_locations(loc)
    x, y = x * width, y * height  # (B, Q, H, N), in pixels from the level's corner
    if nearest:
        # a clamped index reads the border, so the non-finite points' weights are dropped here
        column = torch.minimum(torch.clamp(torch.floor(x + 0.5), min=0.0), width - 1)
        line = torch.minimum(torch.clamp(torch.floor(y + 0.5), min=0.0), height - 1)
        pixel = (line * width + column).unsqueeze(-1)  # (B, Q, H, N, 1)
        coefficient = torch.where(finite, attn, attn.new_zeros(())).unsqueeze(-1)
    else:
        pixel, coefficient = _bilinear_corners(x - 0.5, y - 0.5, attn, width, height)
    # the row of value viewed as (B*S*H, C): b*S*H + pixel*H + (start*H + h)
    offset = (start * H + torch.arange(H, dtype=torch.int64, device=v.device)[:, None])
    batches = torch.arange(B, dtype=torch.int64, device=v.device) * (S * H)
    row = (pixel.to(torch.int64) * H + offset.unsqueeze(-1)) + batches.reshape(-1, 1, 1, 1, 1)
    K = sum(counts) * (1 if nearest else 4)
    picked = v.reshape(-1, C).index_select(0, row.reshape(-1))  # (B*Q*H*K, C)
    out = torch.matmul(coefficient.reshape(-1, 1, K), picked.reshape(-1, K, C))
    return out.reshape(B, -1, H * C)


def _bilinear_corners(x, y, attn, width, height):
    """(pixel, coefficient), each (B, Q, H, N, 4): the four corners of each point at pixel
    coordinates (x, y) (finite, from _finite_locations): their positions in the level, clamped
    into it, and bilinear weight x attention weight, 0 for a corner outside the map. A point
    with no corner inside has its weight replaced by 0, so a NaN weight there adds nothing."""
    x0, y0 = torch.floor(x), torch.floor(y)
    fx, fy = x - x0, y - y0
    columns, weights_x = _axis_corners(x0, fx, width)
    lines, weights_y = _axis_corners(y0, fy, height)
    any_inside = ((x0 >= -1) & (x0 <= width - 1) & (y0 >= -1) & (y0 <= height - 1))
    attn = torch.where(any_inside, attn, attn.new_zeros(()))
    pixel = torch.stack([line * width + column for line in lines for column in columns], -1)
    coefficient = torch.stack([weight_y * weight_x for weight_y in weights_y
                               for weight_x in weights_x], -1) * attn.unsqueeze(-1)
    return pixel, coefficient


def _axis_corners(first, fraction, size):
    """Along one axis: the two neighbours' positions clamped into [0, size - 1] and their
    linear weights, 0 where the neighbour is outside."""
    second = first + 1
    weights = []
    for corner, weight in ((first, 1 - fraction), (second, fraction)):
        inside = (corner >= 0) & (corner <= size - 1)
        weights.append(weight * inside.to(weight.dtype))
    positions = [torch.minimum(torch.clamp(corner, min=0.0), size - 1)
                 for corner in (first, second)]
    return positions, weights


def _grid_sample_form(v, pairs, loc, attn, counts):
    B, H, C = v.shape[0], v.shape[2], v.shape[3]
    x, y, finite = _finite_locations(loc)
    loc = torch.stack([x, y], -1)
    # a non-finite location contributes nothing, even with a NaN weight
    attn = torch.where(finite, attn, attn.new_zeros(()))
    per_level = v.split([h * w for h, w in pairs], dim=1)
    out = None
    for level, loc_l, attn_l in _split_levels(loc, attn, counts):
        h, w = pairs[level]
        image = per_level[level].permute(0, 2, 3, 1).reshape(-1, C, h, w)  # (B*H, C, h, w)
        grid = loc_l.transpose(1, 2).flatten(0, 1)  # (B*H, Q, P_l, 2)
        sampled = F.grid_sample(image, 2 * grid - 1, mode="bilinear", padding_mode="zeros",
                                align_corners=False)  # (B*H, C, Q, P_l)
        weights = attn_l.transpose(1, 2).flatten(0, 1).unsqueeze(1)  # (B*H, 1, Q, P_l)
        term = (sampled * weights).sum(-1)  # (B*H, C, Q)
        out = term if out is None else out + term
    return out.reshape(B, H * C, -1).transpose(1, 2)

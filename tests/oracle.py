"""tests/oracle.py: a plain numpy float64 MSDA, forward and the three gradients, written from the
math alone (no torch, no pymsda), so the C/CPU path is checked against something that shares no
code with it.

    x = loc_x * W_l - 0.5,  y = loc_y * H_l - 0.5,  x0 = floor(x), y0 = floor(y)
    lx = x - x0, ly = y - y0, hx = 1 - lx, hy = 1 - ly
    bilinear = hy*hx*v(y0,x0) + hy*lx*v(y0,x0+1) + ly*hx*v(y0+1,x0) + ly*lx*v(y0+1,x0+1)
    (a corner outside the level reads 0)
    out[b,q,h,:] = sum_{l,p} A[b,q,h,l,p] * bilinear

Gradients, with g = grad_out[b,q,h,:]:
    dA          = <bilinear, g>
    dvalue      += A * w_corner * g            (scattered to each in-map corner)
    dloc_x      = A * W_l * <g, hy*(v01 - v00) + ly*(v11 - v10)>
    dloc_y      = A * H_l * <g, hx*(v10 - v00) + lx*(v11 - v01)>

Everything is vectorised over (b, q, h, l, p) and channels; sizes in the tests are small.
"""
import numpy as np


def _as_f64(array):
    return np.asarray(array, dtype=np.float64)


def level_start_index_of(spatial_shapes):
    spatial_shapes = np.asarray(spatial_shapes, dtype=np.int64).reshape(-1, 2)
    sizes = spatial_shapes[:, 0] * spatial_shapes[:, 1]
    return np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)


def _corners(value, spatial_shapes, sampling_locations):
    """For each sample and each of the 4 corners: bilinear weight, gathered values, and the
    (batch, flat index, head) triple needed to scatter gradients, with a validity mask."""
    value = _as_f64(value)
    spatial_shapes = np.asarray(spatial_shapes, dtype=np.int64).reshape(-1, 2)
    loc = _as_f64(sampling_locations)
    B, S, H, C = value.shape
    _, Q, _, L, P, _ = loc.shape
    starts = level_start_index_of(spatial_shapes)

    heights = spatial_shapes[:, 0].astype(np.float64)[None, None, None, :, None]
    widths = spatial_shapes[:, 1].astype(np.float64)[None, None, None, :, None]
    x = loc[..., 0] * widths - 0.5
    y = loc[..., 1] * heights - 0.5
    x0 = np.floor(x)
    y0 = np.floor(y)
    lx = x - x0
    ly = y - y0
    hx = 1.0 - lx
    hy = 1.0 - ly

    shape5 = (B, Q, H, L, P)
    b_index = np.broadcast_to(np.arange(B)[:, None, None, None, None], shape5)
    h_index = np.broadcast_to(np.arange(H)[None, None, :, None, None], shape5)
    level_h = np.broadcast_to(spatial_shapes[:, 0][None, None, None, :, None], shape5)
    level_w = np.broadcast_to(spatial_shapes[:, 1][None, None, None, :, None], shape5)
    level_start = np.broadcast_to(starts[None, None, None, :, None], shape5)

    corners = {}
    for name, dy, dx, weight in (
        ("00", 0, 0, hy * hx),
        ("01", 0, 1, hy * lx),
        ("10", 1, 0, ly * hx),
        ("11", 1, 1, ly * lx),
    ):
        cx = (x0 + dx).astype(np.int64)
        cy = (y0 + dy).astype(np.int64)
        valid = (cx >= 0) & (cx < level_w) & (cy >= 0) & (cy < level_h)
        flat = np.where(valid, level_start + cy * level_w + cx, 0)
        gathered = value[b_index, flat, h_index, :]  # (B, Q, H, L, P, C)
        gathered = np.where(valid[..., None], gathered, 0.0)
        corners[name] = dict(weight=weight, v=gathered, valid=valid, flat=flat)
    geometry = dict(lx=lx, ly=ly, hx=hx, hy=hy, widths=widths, heights=heights,
                    b_index=b_index, h_index=h_index)
    return corners, geometry


def _bilinear(corners):
    return sum(c["weight"][..., None] * c["v"] for c in corners.values())


def forward(value, spatial_shapes, sampling_locations, attention_weights):
    """(B, S, H, C), (L, 2), (B, Q, H, L, P, 2), (B, Q, H, L, P) -> (B, Q, H*C), float64."""
    value = _as_f64(value)
    weights = _as_f64(attention_weights)
    corners, _ = _corners(value, spatial_shapes, sampling_locations)
    sampled = _bilinear(corners)  # (B, Q, H, L, P, C)
    out = (weights[..., None] * sampled).sum(axis=(3, 4))  # (B, Q, H, C)
    B, Q, H, C = out.shape
    return out.reshape(B, Q, H * C)


def backward(value, spatial_shapes, sampling_locations, attention_weights, grad_output):
    """Returns (grad_value, grad_sampling_locations, grad_attention_weights), float64.
    grad_output is (B, Q, H*C)."""
    value = _as_f64(value)
    weights = _as_f64(attention_weights)
    B, S, H, C = value.shape
    Q = weights.shape[1]
    grad = _as_f64(grad_output).reshape(B, Q, H, C)[:, :, :, None, None, :]  # bcast over l, p
    corners, geo = _corners(value, spatial_shapes, sampling_locations)

    grad_weights = (_bilinear(corners) * grad).sum(-1)

    v00, v01, v10, v11 = (corners[k]["v"] for k in ("00", "01", "10", "11"))
    hx, hy, lx, ly = (geo[k][..., None] for k in ("hx", "hy", "lx", "ly"))
    d_dx = hy * (v01 - v00) + ly * (v11 - v10)
    d_dy = hx * (v10 - v00) + lx * (v11 - v01)
    grad_x = weights * geo["widths"] * (grad * d_dx).sum(-1)
    grad_y = weights * geo["heights"] * (grad * d_dy).sum(-1)
    grad_locations = np.stack([grad_x, grad_y], axis=-1)

    grad_value = np.zeros_like(value)
    scaled = weights[..., None] * grad  # (B, Q, H, L, P, C)
    for corner in corners.values():
        contribution = corner["weight"][..., None] * scaled
        contribution = np.where(corner["valid"][..., None], contribution, 0.0)
        np.add.at(grad_value, (geo["b_index"], corner["flat"], geo["h_index"]), contribution)
    return grad_value, grad_locations, grad_weights


# ---- per-level point counts, nearest sampling, fused softmax ------------------------------------
#
# The same math over a flat list of N points per (b, q, h), point i belonging to level
# level_of[i] (with num_points_list: level 0's points first, then level 1's, ...):
#     nearest:  the pixel (clamp(floor(loc_x*W + 0.5), 0, W-1), clamp(floor(loc_y*H + 0.5), 0,
#               H-1)), weight 1; d sample / d loc = 0
#     softmax:  A = softmax(z) over the N points; dz_i = A_i * (dA_i - sum_j A_j dA_j)

def _level_of_points(spatial_shapes, num_points_list, points_per_level):
    levels = len(np.asarray(spatial_shapes).reshape(-1, 2))
    counts = list(num_points_list) if num_points_list is not None else [points_per_level] * levels
    assert len(counts) == levels
    return np.repeat(np.arange(levels), counts)


def _flat_points(sampling_locations, attention_weights, spatial_shapes, num_points_list):
    """Locations (B, Q, H, N, 2), weights (B, Q, H, N) and the level of each of the N points."""
    loc = _as_f64(sampling_locations)
    weights = _as_f64(attention_weights)
    if num_points_list is None:  # (B, Q, H, L, P, 2) layout
        B, Q, H, L, P, _ = loc.shape
        loc = loc.reshape(B, Q, H, L * P, 2)
        weights = weights.reshape(B, Q, H, L * P)
        level_of = _level_of_points(spatial_shapes, None, P)
    else:
        level_of = _level_of_points(spatial_shapes, num_points_list, None)
    assert loc.shape[3] == len(level_of)
    return loc, weights, level_of


def _point_corners(value, spatial_shapes, loc, level_of, nearest):
    """Per point and corner: weight, gathered value row, validity and flat index; plus the
    point's level (W, H) for the location gradient. loc is (B, Q, H, N, 2)."""
    value = _as_f64(value)
    spatial_shapes = np.asarray(spatial_shapes, dtype=np.int64).reshape(-1, 2)
    B, S, H, C = value.shape
    _, Q, _, N, _ = loc.shape
    starts = level_start_index_of(spatial_shapes)[level_of]
    heights = spatial_shapes[level_of, 0]
    widths = spatial_shapes[level_of, 1]
    shape4 = (B, Q, H, N)
    b_index = np.broadcast_to(np.arange(B)[:, None, None, None], shape4)
    h_index = np.broadcast_to(np.arange(H)[None, None, :, None], shape4)
    lx, ly = loc[..., 0], loc[..., 1]

    def gather(cx, cy, valid):
        valid = valid & (cx >= 0) & (cx < widths) & (cy >= 0) & (cy < heights)
        flat = np.where(valid, starts + cy * widths + cx, 0)
        rows = np.where(valid[..., None], value[b_index, flat, h_index, :], 0.0)
        return dict(v=rows, valid=valid, flat=flat)

    corners = {}
    if nearest:
        finite = np.isfinite(lx) & np.isfinite(ly)
        px = np.floor(np.where(finite, lx, 0.0) * widths + 0.5)
        py = np.floor(np.where(finite, ly, 0.0) * heights + 0.5)
        px = np.clip(px, 0, widths - 1).astype(np.int64)
        py = np.clip(py, 0, heights - 1).astype(np.int64)
        corners["pixel"] = gather(px, py, finite)
        corners["pixel"]["weight"] = np.ones(shape4)
        geometry = None
    else:
        x = lx * widths - 0.5
        y = ly * heights - 0.5
        x0, y0 = np.floor(x), np.floor(y)
        fx, fy = x - x0, y - y0
        for name, dy, dx, weight in (("00", 0, 0, (1 - fy) * (1 - fx)),
                                     ("01", 0, 1, (1 - fy) * fx),
                                     ("10", 1, 0, fy * (1 - fx)),
                                     ("11", 1, 1, fy * fx)):
            cx = (x0 + dx).astype(np.int64)
            cy = (y0 + dy).astype(np.int64)
            corners[name] = gather(cx, cy, np.ones(shape4, dtype=bool))
            corners[name]["weight"] = weight
        geometry = dict(fx=fx, fy=fy, widths=widths.astype(np.float64),
                        heights=heights.astype(np.float64))
    return corners, geometry, b_index, h_index


def _softmax(z):
    e = np.exp(z - z.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def forward_general(value, spatial_shapes, sampling_locations, attention_weights,
                    num_points_list=None, nearest=False, softmax=False):
    """The op with pymsda.ms_deform_attn's options, float64. Without num_points_list the inputs
    have the (B, Q, H, L, P, ...) layout, with it (B, Q, H, N, ...). Returns (B, Q, H*C)."""
    loc, weights, level_of = _flat_points(sampling_locations, attention_weights, spatial_shapes,
                                          num_points_list)
    if softmax:
        weights = _softmax(weights)
    corners, _, _, _ = _point_corners(value, spatial_shapes, loc, level_of, nearest)
    sampled = sum(c["weight"][..., None] * c["v"] for c in corners.values())  # (B, Q, H, N, C)
    out = (weights[..., None] * sampled).sum(axis=3)
    B, Q, H, C = out.shape
    return out.reshape(B, Q, H * C)


def backward_general(value, spatial_shapes, sampling_locations, attention_weights, grad_output,
                     num_points_list=None, nearest=False, softmax=False):
    """(grad_value, grad_sampling_locations, grad_attention_weights) of forward_general, float64,
    in the inputs' layouts; with softmax the weight gradient is the logits'."""
    value = _as_f64(value)
    loc, logits, level_of = _flat_points(sampling_locations, attention_weights, spatial_shapes,
                                         num_points_list)
    weights = _softmax(logits) if softmax else logits
    B, S, H, C = value.shape
    Q = loc.shape[1]
    grad = _as_f64(grad_output).reshape(B, Q, H, C)[:, :, :, None, :]  # bcast over points
    corners, geo, b_index, h_index = _point_corners(value, spatial_shapes, loc, level_of, nearest)

    sampled = sum(c["weight"][..., None] * c["v"] for c in corners.values())
    grad_weights = (sampled * grad).sum(-1)  # d out / d A
    if softmax:
        grad_weights = weights * (grad_weights
                                  - (weights * grad_weights).sum(-1, keepdims=True))

    if nearest:
        grad_locations = np.zeros(loc.shape)
    else:
        v00, v01, v10, v11 = (corners[k]["v"] for k in ("00", "01", "10", "11"))
        fx, fy = geo["fx"][..., None], geo["fy"][..., None]
        d_dx = (1 - fy) * (v01 - v00) + fy * (v11 - v10)
        d_dy = (1 - fx) * (v10 - v00) + fx * (v11 - v01)
        grad_locations = np.stack([weights * geo["widths"] * (grad * d_dx).sum(-1),
                                   weights * geo["heights"] * (grad * d_dy).sum(-1)], axis=-1)

    grad_value = np.zeros_like(value)
    scaled = weights[..., None] * grad
    for corner in corners.values():
        contribution = np.where(corner["valid"][..., None],
                                corner["weight"][..., None] * scaled, 0.0)
        np.add.at(grad_value, (b_index, corner["flat"], h_index), contribution)
    return (grad_value, grad_locations.reshape(np.shape(sampling_locations)),
            grad_weights.reshape(np.shape(attention_weights)))

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


def rel_l2(actual, expected):
    """||actual - expected|| / ||expected|| in float64."""
    actual = _as_f64(actual)
    expected = _as_f64(expected)
    denominator = np.linalg.norm(expected.ravel())
    return float(np.linalg.norm((actual - expected).ravel()) / max(denominator, 1e-300))

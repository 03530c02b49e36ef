"""Problems at the 32-bit limits, every CUDA backward route (c/msda.h: msda_route), every dtype.

Each case runs the forward and backward once on inputs of more than 2^31 value elements (the
generic kernel, the only one that serves them) or just under it (the fast kernels, whose offsets
are int32; in float32 that is past 2^32 bytes, as are the float32 and fixed-point workspaces),
in memory the caching allocator hands out full of NaN, and checks against a float64 computation:
  (a) every grad_value element that no point touches is exactly 0 (and every output row that
      no point reaches);
  (b) every touched element, and every output, location and weight gradient, within a bound
      that follows from the arithmetic: (k + 1) roundings of the dtype and of float32 on the
      element's absolute mass (the sum of |term| over its k terms), plus the fixed-point
      quantum of the deterministic route;
  (c) that the route asked for is the one the library takes (pymsda.routes.backward_route).
The sampling points lie in a band of rows at the end of the map (the last elements of value),
most of each encoder-like problem's points outside the map altogether: the aggregated route
needs Q * L * P >= 2 * S, and this keeps each touched element's term count small.

Every input the kernels read is generated in its own dtype, and the float64 computation reads
those very numbers: the bound is on the computation, not on how the inputs were rounded.

Memory: each case states what it needs (about 12 to 60 GB) and skips where the GPU has less free;
an 80 GB card runs them all. Marked `huge`: the sanitizer runs of tests/gpu_reliability.sh leave
them out (too slow instrumented; the same routes run there on small problems, tests/test_routes.py).

Two more problems pass 2^31 elements: more than 2^30 items of one point each (a fast kernel's
block index times its items), and a float16 value and output each just over 2^31 elements (one
level, one point: each output row is one bilinear sample), whose rows nearest the ends, and
their gradients, are checked against a direct computation.
"""
import math

import pytest
import torch

import pymsda
from conftest import requires_cuda
from factories import seed_of

pytestmark = [requires_cuda, pytest.mark.huge]
DEVICE = "cuda"

H = 8
OVER = (2900, 2900)  # x H x 32 channels: 2,152,960,000 value elements, over 2^31 (generic kernel)
UNDER = (2896, 2896)  # x H x 32: 2,147,024,896, the most under 2^31 a square map of these has
AGG_SIDE, AGG_C = (1448, 1448), 128  # x H x 128: the same 2,147,024,896 elements
assert OVER[0] * OVER[1] * H * 32 > 2 ** 31 > UNDER[0] * UNDER[1] * H * 32
assert AGG_SIDE[0] * AGG_SIDE[1] * AGG_C == UNDER[0] * UNDER[1] * 32
BAND = 40  # rows at the end of the map that the points sample
AGG_Q, AGG_P = AGG_SIDE[0] * AGG_SIDE[1], 2  # an encoder, Q = S, Q * P = 2 * S: aggregated
AGG_INSIDE = 1 / 4096  # share of the aggregated cases' points inside the map

UNIT = {torch.float64: 2.0 ** -53, torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11,
        torch.bfloat16: 2.0 ** -8}
NAMES = {torch.float64: "f64", torch.float32: "f32", torch.float16: "f16",
         torch.bfloat16: "bf16"}


def _case(kernel, dtype, det=False, side=UNDER, C=32, Q=256, P=4, inside=1.0):
    return dict(kernel=kernel, dtype=dtype, det=det, side=side, C=C, Q=Q, P=P, inside=inside)


def _cases():
    cases = {}
    for dtype in (torch.float64, torch.float32, torch.float16, torch.bfloat16):
        for det in (False, True):
            cases[("generic", dtype, det)] = _case("generic", dtype, det, side=OVER)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        # plain decoders of at most 4 points an item take the direct kernel; f16 ones of more
        # than 16 points the per-point kernel, f32 ones with 128 channels (the pipelined form
        # has up to 64) and 2^17 lanes; plain bf16 decoders never do (pipelined)
        cases[("direct", dtype, False)] = _case("direct", dtype)
        if dtype == torch.float16:
            cases[("point", dtype, False)] = _case("point", dtype, P=20)
        elif dtype == torch.float32:
            cases[("point", dtype, False)] = _case("point", dtype, side=AGG_SIDE, C=AGG_C,
                                                   Q=512, P=6)
        cases[("point", dtype, True)] = _case("point", dtype, det=True)
        if dtype != torch.float16:  # (f16's sliced points take the per-point kernel, above)
            cases[("point_sliced", dtype, False)] = _case("point_sliced", dtype, P=20)
        for det in (False, True):
            cases[("aggregated", dtype, det)] = _case("aggregated", dtype, det, side=AGG_SIDE,
                                                      C=AGG_C, Q=AGG_Q, P=AGG_P,
                                                      inside=AGG_INSIDE)
    for dtype in (torch.float32, torch.bfloat16):
        # (f32: 2^17 lanes, 128 items a block, are 4096 items; bf16: more than 4 points)
        cases[("point_pipelined", dtype, False)] = _case("point_pipelined", dtype, Q=2048,
                                                         P=6)
    return cases


CASES = _cases()


def _case_id(key):
    kernel, dtype, det = key
    return f"{kernel}-{NAMES[dtype]}" + ("-deterministic" if det else "")


def _element_size(dtype):
    return torch.tensor([], dtype=dtype).element_size()


def _sizes(case):
    rows, cols = case["side"]
    e = _element_size(case["dtype"])
    n_value = rows * cols * H * case["C"]
    n_points = case["Q"] * H * case["P"]
    n_out = case["Q"] * H * case["C"]
    workspace = n_value * 8 if case["det"] else (n_value * 4 if e == 2 else 0)
    # what the op allocates: output, the three gradients, the workspace
    made = n_out * e + n_value * e + 3 * n_points * e + workspace
    # the float64 computation: band (expected, mass, count), outputs, points, a chunk's temporaries
    band = (BAND + 4) * cols * H * case["C"] * (8 + 8) + (BAND + 4) * cols * H * 4
    check = band + 2 * n_out * 8 + 8 * n_points * 8 + (3 << 30)
    inputs = n_value * e + 3 * n_points * 4 + n_out * e
    return made, inputs + made + check


def _half_in_f32():
    """Whether this GPU's code sums a half-precision grad_value in float32 (code older than
    sm_90: the f32-workspace route), asked of the chooser with a one-pixel problem."""
    return pymsda.routes.backward_route(1, 1, 1, 4, 1, 1, 1, torch.float16).f32_workspace


def _sync():
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def _free_bytes():
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0]


def _poison(nbytes):
    """Leaves nbytes of the caching allocator's free memory filled with 0xFF bytes (NaN in
    every float dtype), for the next allocations to get."""
    junk = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    junk.fill_(0xFF)
    del junk


def test_allocator_hands_out_the_poisoned_memory():
    # the premise of the checks below: memory freed full of NaN comes back full of NaN
    torch.cuda.empty_cache()
    _poison(3 << 28)
    first = torch.empty(1 << 28, dtype=torch.float16, device=DEVICE)
    second = torch.empty(1 << 26, dtype=torch.float32, device=DEVICE)
    assert torch.isnan(first).all() and torch.isnan(second).all()


def _inputs(case, generator):
    """value, locations, weights and grad_output on the GPU in the
    case's dtype. Points: within the last BAND rows (pixel y in [rows - BAND - 0.5, rows - 0.1),
    so some bottom corners fall outside), x across the whole width and a little past both
    edges; with inside < 1 the others sit at (1.5, 1.5), outside the map."""
    dtype, Q, P, C = case["dtype"], case["Q"], case["P"], case["C"]
    rows, cols = case["side"]
    value = torch.randn(1, rows * cols, H, C, device=DEVICE, dtype=dtype, generator=generator)
    shape = (1, Q, H, 1, P)
    u = torch.rand(shape + (2,), device=DEVICE, generator=generator)
    x = (u[..., 0] * (cols + 1.8) - 0.9 + 0.5) / cols
    y = (rows - BAND - 0.5 + u[..., 1] * (BAND + 0.4) + 0.5) / rows
    loc = torch.stack([x, y], -1)
    del u, x, y
    if case["inside"] < 1:
        outside = torch.rand(shape, device=DEVICE, generator=generator) >= case["inside"]
        loc[outside] = 1.5
    loc = loc.to(dtype)
    attn = torch.rand(shape, device=DEVICE, generator=generator).to(dtype)
    # grad_output / 16 (exact): location gradients, ~ A * side * <g, dv>, stay inside float16
    grad_output = (torch.randn(1, Q, H * C, device=DEVICE, generator=generator) / 16).to(dtype)
    return value, loc, attn, grad_output


class _Reference:
    """float64 forward and gradients of a list of N points, with each result's absolute mass
    (the sum of |term| over its terms) and, for grad_value, its term count: the error bound's
    inputs. value (1, S, Hh, C) on a map of side (rows, cols); per point: loc (N, 2) and the
    attention weight a (N,), head (N,), item (N,) (a compact
    index of the point's (q, h), < n_items) and g (N, C) (its grad_output row). grad_value is
    kept for the rows from the first the points reach to the end of the map."""

    def __init__(self, value, side, loc, a, head, item, g, n_items, chunk_elements=1 << 24):
        rows, cols = side
        _, S, Hh, C = value.shape
        N = loc.shape[0]
        y = loc[:, 1] * rows - 0.5
        self.first = max(int(torch.floor(y.min())), 0) if N else rows
        band_rows = (rows - self.first) * cols * Hh  # value rows (pixel, head) in the band
        self.grad_value = torch.zeros(band_rows, C, dtype=torch.float64, device=DEVICE)
        self.mass = torch.zeros(band_rows, C, dtype=torch.float64, device=DEVICE)
        self.geo_mass = torch.zeros(band_rows, C, dtype=torch.float64, device=DEVICE)
        self.count = torch.zeros(band_rows, dtype=torch.int32, device=DEVICE)
        self.out = torch.zeros(n_items, C, dtype=torch.float64, device=DEVICE)
        self.out_mass = torch.zeros(n_items, C, dtype=torch.float64, device=DEVICE)
        self.out_geo = torch.zeros(n_items, C, dtype=torch.float64, device=DEVICE)
        self.out_terms = torch.zeros(n_items, 1, dtype=torch.float64, device=DEVICE)
        self.d_attn = torch.empty(N, dtype=torch.float64, device=DEVICE)
        self.attn_mass = torch.empty(N, dtype=torch.float64, device=DEVICE)
        self.attn_geo = torch.empty(N, dtype=torch.float64, device=DEVICE)
        self.grad_loc = torch.empty(N, 2, dtype=torch.float64, device=DEVICE)
        self.loc_mass = torch.empty(N, 2, dtype=torch.float64, device=DEVICE)
        value_rows = value.view(-1, C)  # row = pixel * Hh + h
        step = max(chunk_elements // C, 1)
        for i0 in range(0, N, step):
            i1 = min(N, i0 + step)
            x, y = loc[i0:i1, 0] * cols - 0.5, loc[i0:i1, 1] * rows - 0.5
            x0, y0 = torch.floor(x), torch.floor(y)
            fx, fy = x - x0, y - y0
            ai, gi, hi, it = a[i0:i1], g[i0:i1], head[i0:i1], item[i0:i1]
            vs, ws, hit = [], [], torch.zeros_like(ai, dtype=torch.bool)
            for dy in (0, 1):
                for dx in (0, 1):
                    xx, yy = x0 + dx, y0 + dy
                    inside = (xx >= 0) & (xx < cols) & (yy >= 0) & (yy < rows)
                    row = torch.where(inside, yy * cols + xx, 0.0).long() * Hh + hi
                    v = value_rows[row].double() * inside.unsqueeze(-1)
                    w = (fx if dx else 1 - fx) * (fy if dy else 1 - fy)
                    vs.append(v), ws.append(w)
                    hit |= inside
                    term = (ai * w).unsqueeze(-1) * gi
                    local = row[inside] - self.first * cols * Hh
                    self.grad_value.index_add_(0, local, term[inside])
                    self.mass.index_add_(0, local, term[inside].abs())
                    self.geo_mass.index_add_(0, local, (ai.abs().unsqueeze(-1) * gi.abs())[inside])
                    self.count.index_add_(0, local, torch.ones_like(local, dtype=torch.int32))
                    self.out_terms.index_add_(0, it[inside], torch.ones_like(
                        local, dtype=torch.float64).unsqueeze(-1))
            bil = sum(w.unsqueeze(-1) * v for w, v in zip(ws, vs))
            bil_abs = sum(w.unsqueeze(-1) * v.abs() for w, v in zip(ws, vs))
            self.out.index_add_(0, it, ai.unsqueeze(-1) * bil)
            self.out_mass.index_add_(0, it, ai.abs().unsqueeze(-1) * bil_abs)
            self.out_geo.index_add_(0, it, ai.abs().unsqueeze(-1) * sum(v.abs() for v in vs))
            self.d_attn[i0:i1] = (gi * bil).sum(-1)
            self.attn_mass[i0:i1] = (gi.abs() * bil_abs).sum(-1)
            sx = (1 - fy).unsqueeze(-1) * (vs[1] - vs[0]) + fy.unsqueeze(-1) * (vs[3] - vs[2])
            sy = (1 - fx).unsqueeze(-1) * (vs[2] - vs[0]) + fx.unsqueeze(-1) * (vs[3] - vs[1])
            spread = (gi.abs() * sum(v.abs() for v in vs)).sum(-1)
            self.grad_loc[i0:i1, 0] = torch.where(hit, ai * cols * (gi * sx).sum(-1), 0.0)
            self.grad_loc[i0:i1, 1] = torch.where(hit, ai * rows * (gi * sy).sum(-1), 0.0)
            self.loc_mass[i0:i1, 0] = ai.abs() * cols * spread
            self.loc_mass[i0:i1, 1] = ai.abs() * rows * spread
            self.attn_geo[i0:i1] = spread


# Bilinear weights come from the in-cell fraction, which the kernels compute to about one float32
# ulp (kernels/common.cuh, locate): each weight is off by at most a few units of float32, however
# small the weight itself.
GEOMETRY_ULPS = 4
# float16's subnormals (below 2^-14) are spaced 2^-24 apart: each rounding there is off by up to
# half that, whatever the value's magnitude.
SUBNORMAL = {torch.float16: 2.0 ** -24}


def _bound(mass, terms, dtype, ref=None, quantum=0.0, geometry=None):
    """|error| allowed: (terms + 1) roundings of the dtype (twice: a half-precision atomic
    rounds its operand and its sum) and two of float32 on the absolute mass, the final rounding
    of the result, GEOMETRY_ULPS float32 units on `geometry` (the sum of |term| with each
    bilinear weight taken as 1), and `quantum` per term (fixed point)."""
    unit = UNIT[dtype]
    acc = UNIT[torch.float32] if dtype != torch.float64 else unit
    tol = (2 * unit + 2 * acc) * (terms + 1) * mass + quantum * terms
    tol = tol + 2 * SUBNORMAL.get(dtype, 0.0) * (terms + 1)
    if geometry is not None:
        tol = tol + GEOMETRY_ULPS * acc * geometry
    if ref is not None:
        tol = tol + unit * ref.abs()
    return tol + 1e-300


def _assert_within(name, got, ref, tol):
    got = got.double()
    bad = ~(torch.abs(got - ref) <= tol)  # NaN fails
    count = int(bad.sum())
    if count:
        idx = torch.nonzero(bad.reshape(-1))[:5, 0]
        raise AssertionError(
            f"{name}: {count} of {ref.numel()} elements outside the bound; first at flat "
            f"indices {idx.tolist()}: got {got.reshape(-1)[idx].tolist()}, expected "
            f"{ref.reshape(-1)[idx].tolist()}, bound {tol.reshape(-1)[idx].tolist()}")


def _assert_zero(name, t):
    nonzero = int(torch.count_nonzero(t))  # NaN counts
    assert nonzero == 0, f"{name}: {nonzero} of {t.numel()} elements not 0"


def _deterministic_quantum(case, attn, grad_output):
    """The fixed-point unit of the deterministic route (kernels/common.cuh det_scale): 2^(e-62)
    with bound = max|g| * max|A| * Q * L * P < 2^e."""
    if not case["det"]:
        return 0.0
    bound = float(grad_output.abs().max()) * float(attn.abs().max()) * case["Q"] * case["P"]
    return 2.0 ** (math.frexp(bound)[1] - 62)


def _check_results(dtype, side, value, loc, attn, grad_output, out, grads, quantum=0.0):
    """(a) and (b) of the module docstring for a problem of one level and one batch, points
    (1, Q, Hh, 1, P, 2); returns the reference's first band row."""
    rows, cols = side
    _, Q, Hh, _, P, _ = loc.shape
    C = value.shape[-1]
    grad_value, grad_loc, grad_attn = grads
    a = attn.double().view(Q, Hh, P)
    locs = loc.double().view(-1, 2)
    picked = locs[:, 1] < 1.2  # the points parked at (1.5, 1.5) contribute nothing
    idx = torch.nonzero(picked)[:, 0]
    item = idx // P  # (q, h) = q * Hh + h
    ref = _Reference(value, side, locs[idx], a.view(-1)[idx], item % Hh, item,
                     grad_output.double().view(-1, C)[item], Q * Hh)
    band_start = ref.first * cols * Hh * C
    # (a) grad_value: exactly 0 before the band and wherever no term lands in it
    flat = grad_value.view(-1)
    _assert_zero("grad_value before the band", flat[:band_start])
    band = flat[band_start:].view(-1, C)
    _assert_zero("untouched grad_value in the band", band[ref.count == 0])
    # (b) the rest against float64
    terms = ref.count.double().unsqueeze(-1)
    _assert_within("grad_value", band, ref.grad_value,
                   _bound(ref.mass, terms, dtype, quantum=quantum, geometry=ref.geo_mass))
    _assert_within("output", out.view(Q * Hh, C), ref.out,
                   _bound(ref.out_mass, ref.out_terms, dtype, ref.out, geometry=ref.out_geo))
    d_attn, attn_mass, attn_geo = ref.d_attn, ref.attn_mass, ref.attn_geo
    got_attn, got_loc = grad_attn.reshape(-1), grad_loc.reshape(-1, 2)
    _assert_within("grad_attention_weights", got_attn[idx], d_attn,
                   _bound(attn_mass, 4 * C * P, dtype, d_attn, geometry=attn_geo))
    _assert_within("grad_sampling_locations", got_loc[idx], ref.grad_loc,
                   _bound(ref.loc_mass, 6 * C, dtype, ref.grad_loc))
    if not bool(picked.all()):  # points outside the map: zero gradients
        _assert_zero("grad_attention_weights outside", got_attn[~picked])
        _assert_zero("grad_sampling_locations outside", got_loc[~picked])
    return ref.first


@pytest.mark.parametrize("key", list(CASES), ids=[_case_id(k) for k in CASES])
def test_forward_and_backward_at_the_32_bit_limits_match_f64_cuda(key):
    case = CASES[key]
    dtype, C, Q, P = case["dtype"], case["C"], case["Q"], case["P"]
    made, need = _sizes(case)
    free = _free_bytes()
    if free < need:
        pytest.skip(f"needs about {need / 2 ** 30:.0f} GiB of free GPU memory, "
                    f"{free / 2 ** 30:.0f} GiB free")
    rows, cols = case["side"]
    route = pymsda.routes.backward_route(1, rows * cols, H, C, 1, Q, P, dtype,
                                         deterministic=case["det"])
    assert route.kernel == case["kernel"] and route.deterministic == case["det"], route
    assert route.f32_workspace == (_element_size(dtype) == 2 and not case["det"]
                                   and _half_in_f32()), route
    generator = torch.Generator(device=DEVICE).manual_seed(seed_of(_case_id(key)))
    value, loc, attn, grad_output = _inputs(case, generator)
    leaves = [t.requires_grad_(True) for t in (value, loc, attn)]
    _sync()
    _poison(made + (1 << 30))  # what the op allocates now comes out of NaN-filled memory
    out = pymsda.ms_deform_attn(value, [(rows, cols)], None, loc, attn,
                                deterministic=case["det"])
    grads = [g.detach() for g in torch.autograd.grad(out, leaves, grad_output)]
    _sync()
    value, loc, attn = (t.detach() for t in leaves)
    first = _check_results(dtype, case["side"], value, loc, attn, grad_output,
                           out.detach(), grads, _deterministic_quantum(case, attn, grad_output))
    # the band is the map's last rows: the elements nearest (or past) 2^31
    assert rows - BAND - 8 <= first < rows - BAND  # (bfloat16 locations: 11-pixel steps)


# ---- more than 2^30 items: a fast kernel's block index times its items passes 2^31 -----------

MANY_Q = 2 ** 30 + 2 ** 20  # items B * Q * H, one point each, C = 4 (one thread an item)
MANY_SIDE = (64, 64)


def test_forward_and_backward_over_2_30_items_match_f64_cuda():
    dtype = torch.float16
    # locations, weights, grad_output, output and the three gradients, 2 bytes an element
    made = MANY_Q * 2 * (4 + 2 + 1)
    need = MANY_Q * 2 * (2 + 1 + 4) + made + (6 << 30)
    free = _free_bytes()
    if free < need:
        pytest.skip(f"needs about {need / 2 ** 30:.0f} GiB of free GPU memory, "
                    f"{free / 2 ** 30:.0f} GiB free")
    rows, cols = MANY_SIDE
    route = pymsda.routes.backward_route(1, rows * cols, 1, 4, 1, MANY_Q, 1, dtype)
    assert route.kernel == "direct", route
    gen = torch.Generator(device=DEVICE).manual_seed(30)
    value = torch.randn(1, rows * cols, 1, 4, device=DEVICE, dtype=dtype, generator=gen)
    loc = torch.rand(1, MANY_Q, 1, 1, 1, 2, device=DEVICE, generator=gen, dtype=dtype)
    # one point in 1024 inside the map, the others at (1.5, 1.5), outside
    loc[torch.rand(1, MANY_Q, 1, 1, 1, device=DEVICE, generator=gen) >= 1 / 1024] = 1.5
    attn = torch.rand(1, MANY_Q, 1, 1, 1, device=DEVICE, generator=gen, dtype=dtype)
    grad_output = torch.randn(1, MANY_Q, 4, device=DEVICE, generator=gen, dtype=dtype) / 16
    leaves = [t.requires_grad_(True) for t in (value, loc, attn)]
    _sync()
    _poison(made + (1 << 30))
    out = pymsda.ms_deform_attn(leaves[0], [(rows, cols)], None, leaves[1], leaves[2])
    grads = [g.detach() for g in torch.autograd.grad(out, leaves, grad_output)]
    _sync()
    value, loc, attn = (t.detach() for t in leaves)
    out = out.detach()
    picked = loc.view(-1, 2)[:, 1] < 1.2
    idx = torch.nonzero(picked)[:, 0]
    # the points outside: every output and point gradient exactly 0 (counted over the whole
    # tensors, NaN included, against the picked rows: a boolean index would copy 8 GB)
    for name, t in (("output", out.view(-1, 4)), ("grad_attention_weights", grads[2].view(-1, 1)),
                    ("grad_sampling_locations", grads[1].view(-1, 2))):
        outside = int(torch.count_nonzero(t)) - int(torch.count_nonzero(t[idx]))
        assert outside == 0, f"{name}: {outside} elements of the points outside not 0"
    # the rest as in the cases above, on the picked items only (an output row per item)
    sub = (loc.view(1, -1, 1, 1, 1, 2)[:, idx], attn.view(1, -1, 1, 1, 1)[:, idx],
           grad_output.view(1, -1, 4)[:, idx])
    sub_grads = [grads[0], grads[1].view(1, -1, 1, 1, 1, 2)[:, idx],
                 grads[2].view(1, -1, 1, 1, 1)[:, idx]]
    _check_results(dtype, MANY_SIDE, value, sub[0], sub[1], sub[2],
                   out.view(1, -1, 4)[:, idx], sub_grads)


# ---- value and output each past 2^31 elements: rows checked against the bilinear sample ------

# value (1, 4100*4100, 2, 64) and output (1, 2^24 + 2^16, 128): each just over 2^31 elements,
# 4.3 GB in float16. One level, one point: each output row is one bilinear sample.
BIG_SIDE, BIG_H, BIG_C, BIG_Q = 4100, 2, 64, 2 ** 24 + 2 ** 16
BIG_S = BIG_SIDE * BIG_SIDE
assert BIG_S * BIG_H * BIG_C > 2 ** 31 and BIG_Q * BIG_H * BIG_C > 2 ** 31


def _big_inputs():
    gen = torch.Generator(device="cuda").manual_seed(31)
    value = torch.randn(1, BIG_S, BIG_H, BIG_C, device="cuda", dtype=torch.float16, generator=gen)
    locations = torch.rand(1, BIG_Q, BIG_H, 1, 1, 2, device="cuda", generator=gen).half()
    weights = torch.rand(1, BIG_Q, BIG_H, 1, 1, device="cuda", generator=gen).half()
    # rows to check: the first and last queries, and points at the far corner of the level,
    # whose corners sit past element 2^31 of value
    checks = [(0, 0), (1, 1), (BIG_Q // 2, 0), (BIG_Q - 2, 1), (BIG_Q - 1, 0), (BIG_Q - 1, 1)]
    far = torch.tensor([1.0 - 0.3 / BIG_SIDE, 1.0 - 0.8 / BIG_SIDE], device="cuda")
    for q, h in checks[-3:]:
        locations[0, q, h, 0, 0] = far.half()
    return value, locations, weights, checks


def _direct_sample(value, locations, weights, q, h):
    """A * bilinear(value) at (q, h) in float64 from the four corners, plus the corners'
    flat indices and weights."""
    lx, ly = locations[0, q, h, 0, 0].double().tolist()
    a = float(weights[0, q, h, 0, 0])
    x, y = lx * BIG_SIDE - 0.5, ly * BIG_SIDE - 0.5
    x0, y0 = math.floor(x), math.floor(y)
    fx, fy = x - x0, y - y0
    total = torch.zeros(BIG_C, dtype=torch.float64)
    corners = []
    for dy in (0, 1):
        for dx in (0, 1):
            xx, yy = x0 + dx, y0 + dy
            if 0 <= xx < BIG_SIDE and 0 <= yy < BIG_SIDE:
                w = (fx if dx else 1 - fx) * (fy if dy else 1 - fy)
                idx = yy * BIG_SIDE + xx
                total += a * w * value[0, idx, h].double().cpu()
                corners.append((idx, w))
    return total, corners, a, (x0, y0, fx, fy)


def test_int32_overflow_forward_half_over_2_31_elements_cuda():
    if _free_bytes() < 14 * 2 ** 30:
        pytest.skip("needs about 14 GB of free GPU memory")
    value, locations, weights, checks = _big_inputs()
    out = pymsda.ms_deform_attn(value, [(BIG_SIDE, BIG_SIDE)], None, locations, weights)
    torch.cuda.synchronize()
    assert out.shape == (1, BIG_Q, BIG_H * BIG_C)
    view = out.view(1, BIG_Q, BIG_H, BIG_C)
    for q, h in checks:
        expected, corners, _, _ = _direct_sample(value, locations, weights, q, h)
        assert corners, (q, h)
        actual = view[0, q, h].double().cpu()
        torch.testing.assert_close(actual, expected, rtol=4e-3, atol=4e-3, msg=f"row {(q, h)}")
    far_offset = (checks[-1][0] * BIG_H + checks[-1][1]) * BIG_C
    assert far_offset > 2 ** 31  # the last rows checked lie past element 2^31 of the output


def test_int32_overflow_backward_half_over_2_31_elements_cuda():
    if _free_bytes() < 34 * 2 ** 30:
        pytest.skip("needs about 34 GB of free GPU memory")
    value, locations, weights, checks = _big_inputs()
    leaves = [t.requires_grad_(True) for t in (value, locations, weights)]
    # grad_output is zero except on the checked rows, so every gradient is known exactly; it is
    # small (1/16) so that the location gradients, ~ A * 4100 * <g, dv>, stay inside float16
    gen = torch.Generator().manual_seed(7)
    grad_output = torch.zeros(1, BIG_Q, BIG_H * BIG_C, dtype=torch.float16, device="cuda")
    grad_rows = {}
    for q, h in checks:
        g = (torch.randn(BIG_C, generator=gen, dtype=torch.float64) / 16).half()
        grad_output.view(1, BIG_Q, BIG_H, BIG_C)[0, q, h] = g.cuda()
        grad_rows[(q, h)] = g.double()
    torch.autograd.backward(
        pymsda.ms_deform_attn(leaves[0], [(BIG_SIDE, BIG_SIDE)], None, leaves[1], leaves[2]),
        grad_output)
    torch.cuda.synchronize()
    grad_value, grad_loc, grad_attn = (t.grad for t in leaves)
    expected_value = {}
    for (q, h), g in grad_rows.items():
        sample, corners, a, (x0, y0, fx, fy) = _direct_sample(value.detach(), locations.detach(),
                                                              weights.detach(), q, h)
        # d/dA = <sample / A, g>; d/dloc from the corners' differences
        v = {}
        for dy in (0, 1):
            for dx in (0, 1):
                xx, yy = x0 + dx, y0 + dy
                inside = 0 <= xx < BIG_SIDE and 0 <= yy < BIG_SIDE
                v[dy, dx] = (value.detach()[0, yy * BIG_SIDE + xx, h].double().cpu() if inside
                             else torch.zeros(BIG_C, dtype=torch.float64))
        bilinear = sum((fx if dx else 1 - fx) * (fy if dy else 1 - fy) * v[dy, dx]
                       for dy in (0, 1) for dx in (0, 1))
        d_attn = float((bilinear * g).sum())
        slope_x = (1 - fy) * (v[0, 1] - v[0, 0]) + fy * (v[1, 1] - v[1, 0])
        slope_y = (1 - fx) * (v[1, 0] - v[0, 0]) + fx * (v[1, 1] - v[0, 1])
        d_x = a * BIG_SIDE * float((slope_x * g).sum())
        d_y = a * BIG_SIDE * float((slope_y * g).sum())
        scale = float(g.abs().sum() * bilinear.abs().max() + 1)
        assert abs(float(grad_attn[0, q, h, 0, 0]) - d_attn) < 4e-3 * scale, (q, h)
        got = grad_loc[0, q, h, 0, 0].double().cpu()
        loc_scale = a * BIG_SIDE * scale
        assert abs(float(got[0]) - d_x) < 4e-3 * loc_scale, (q, h)
        assert abs(float(got[1]) - d_y) < 4e-3 * loc_scale, (q, h)
        for idx, w in corners:
            key = (idx, h)
            expected_value[key] = expected_value.get(key, 0) + a * w * g
    for (idx, h), expected in expected_value.items():
        torch.testing.assert_close(grad_value[0, idx, h].double().cpu(), expected, rtol=4e-3,
                                   atol=1e-5, msg=f"grad_value at {(idx, h)}")
    # nothing else was written into grad_value: its L1 norm is that of the checked corners
    total = float(torch.linalg.vector_norm(grad_value, ord=1, dtype=torch.float32))
    expected_total = sum(float(e.abs().sum()) for e in expected_value.values())
    assert abs(total - expected_total) < 1e-2 * expected_total
    # unchecked points get zero weight and location gradients
    for q in (2, BIG_Q // 3, BIG_Q - 3):
        assert float(grad_attn[0, q].abs().sum()) == 0 and float(grad_loc[0, q].abs().sum()) == 0

"""tests/test_cuda_paths.py: every CUDA kernel variant against the f64 oracle.

The CUDA kernels have a fast path for f32/f16/bf16 when C = 4*G with G a power of two up to 32
(a group of G threads per (b, q, h), 4 channels each) and the pointers are 16-byte aligned, which stages the sampling geometry K points per item at a time in shared memory; a
generic path serves everything else. These cases reach each group size, point counts that are
not a multiple of K (so the last chunk is partial), a batch whose items do not fill the last
block, and an unaligned value that must fall back to the generic path.
"""
import pytest
import torch

import pymsda
from pymsda.reference import ms_deform_attn_pytorch
from conftest import requires_cuda
from factories import (GRAD_NAMES, flat_size, loose_bound, make_inputs, make_point_inputs,
                       oracle_backward, oracle_backward_general, oracle_forward,
                       oracle_forward_general, random_grad_output, random_level_shapes, rel_l2,
                       run_msda)

pytestmark = [requires_cuda]

# (dtype, C) pairs reaching G = 1, 2, 4, 8, 16, 32 threads per item, and C = 256 (G = 64: generic).
GROUPS = [(torch.float32, 4), (torch.float32, 8), (torch.float32, 16), (torch.float32, 32),
          (torch.float32, 64), (torch.float32, 128), (torch.bfloat16, 4), (torch.bfloat16, 16),
          (torch.bfloat16, 32), (torch.float16, 64), (torch.float16, 256)]


def grads_of(inputs, grad_output, function=pymsda.ms_deform_attn):
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES}
    if function is pymsda.ms_deform_attn:
        out = function(leaves["value"], inputs["spatial_shapes"], inputs["level_start_index"],
                       leaves["sampling_locations"], leaves["attention_weights"])
    else:
        out = function(leaves["value"], inputs["spatial_shapes"], leaves["sampling_locations"],
                       leaves["attention_weights"])
    out.backward(grad_output)
    return out.detach(), [leaves[k].grad for k in GRAD_NAMES]


@pytest.mark.parametrize("dtype,channels", GROUPS,
                         ids=[f"{str(d)[6:]}-C{c}" for d, c in GROUPS])
@pytest.mark.parametrize("levels,points", [(4, 4), (3, 7), (1, 1)], ids=["LP16", "LP21", "LP1"])
def test_fast_path_forward_and_gradients_match_f64_oracle(generator, dtype, channels, levels,
                                                          points):
    shapes = random_level_shapes(generator, levels, max_side=9, min_side=2)
    # 3 * 37 * 2 items: never a whole number of blocks, whatever the group size
    inputs = make_inputs(generator, batch=3, queries=37, heads=2, channels=channels,
                         shapes=shapes, points=points, dtype=dtype, device="cuda",
                         kink_free=True)
    grad_output = random_grad_output(generator, run_msda(inputs))
    out, grads = grads_of(inputs, grad_output)
    expected_out = oracle_forward(inputs)
    expected_grads = oracle_backward(inputs, grad_output)
    if dtype == torch.float32:
        assert rel_l2(out, expected_out) < 1e-6
        for name, g, e in zip(GRAD_NAMES, grads, expected_grads):
            assert rel_l2(g, e) < 1e-5, name
    else:
        ref_out, ref_grads = grads_of(inputs, grad_output, ms_deform_attn_pytorch)
        assert rel_l2(out, expected_out) <= loose_bound(rel_l2(ref_out, expected_out))
        for name, g, r, e in zip(GRAD_NAMES, grads, ref_grads, expected_grads):
            assert rel_l2(g, e) <= loose_bound(rel_l2(r, e)), name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_unaligned_value_takes_the_generic_path_and_stays_correct(generator, dtype):
    inputs = make_inputs(generator, batch=2, queries=13, heads=2, channels=32,
                         shapes=[(5, 7), (3, 4)], points=3, dtype=dtype, device="cuda",
                         kink_free=True)
    value = inputs["value"]
    storage = torch.empty(value.numel() + 1, dtype=dtype, device="cuda")
    shifted = storage[1:].view(value.shape)  # contiguous, but 2 or 4 bytes off 16-byte alignment
    shifted.copy_(value)
    assert shifted.data_ptr() % 16 != 0
    inputs = dict(inputs, value=shifted)
    grad_output = random_grad_output(generator, run_msda(inputs))
    out, grads = grads_of(inputs, grad_output)
    bound = 1e-6 if dtype == torch.float32 else 2.0 ** -8
    assert rel_l2(out, oracle_forward(inputs)) < bound
    for name, g, e in zip(GRAD_NAMES, grads, oracle_backward(inputs, grad_output)):
        assert rel_l2(g, e) < 10 * bound, name


def test_fast_and_generic_paths_agree(generator):
    # Same numbers through both paths: C = 32 f32 (fast) and the same data with one padding
    # channel made unaligned-free but C = 33 (generic), compared on the first 32 channels.
    inputs = make_inputs(generator, batch=2, queries=29, heads=3, channels=33,
                         shapes=[(9, 6), (4, 5)], points=4, dtype=torch.float32, device="cuda")
    generic = run_msda(inputs).view(2, 29, 3, 33)[..., :32]
    fast = run_msda(dict(inputs, value=inputs["value"][..., :32].contiguous())).view(2, 29, 3, 32)
    assert rel_l2(fast, generic) < 1e-6


def _locations_rounding_onto_an_integer(width, count):
    """f32 locations whose f32 product loc * width - 0.5 lands exactly on an integer n although
    the exact value lies just below n: the cell is then easy to get wrong."""
    import numpy as np
    found = []
    for n in range(1, width - 1):
        for delta in (1e-7, 2e-7, 4e-7, 8e-7):
            loc = np.float32((n + 0.5 - delta) / width)
            rounded = np.float32(loc * np.float32(width)) - np.float32(0.5)
            exact = float(loc) * width - 0.5
            if rounded == n and exact < n:
                found.append(float(loc))
                break
        if len(found) == count:
            break
    return found


@pytest.mark.parametrize("channels", [32, 3], ids=["fast", "generic"])
def test_location_gradient_takes_the_cell_of_the_exact_coordinate(generator, channels):
    width = 150
    xs = _locations_rounding_onto_an_integer(width, 24)
    assert len(xs) >= 8
    inputs = make_inputs(generator, batch=1, queries=len(xs), heads=1, channels=channels,
                         shapes=[(7, width)], points=1, dtype=torch.float32, device="cuda",
                         kink_free=True)
    loc = inputs["sampling_locations"].clone()
    loc[0, :, 0, 0, 0, 0] = torch.tensor(xs, device="cuda")
    inputs = dict(inputs, sampling_locations=loc)
    grad_output = random_grad_output(generator, run_msda(inputs))
    _, grads = grads_of(inputs, grad_output)
    expected = oracle_backward(inputs, grad_output)[1]
    assert rel_l2(grads[1][..., 0], expected[..., 0]) < 1e-5


# Encoders (Q = S, Q * NP >= 2 * S) take the aggregated backward, which merges the corners of a
# block's points that land on the same value row before touching memory; decoders take the
# per-point or direct kernels, with atomics on crowded rows here. "dense": a small map under many
# queries (many corners a row); "spread": a larger map; "decoder": few
# queries; "tiled": an encoder whose queries are the value's pixels (Q == S, the levels covering
# [0, S) in order), whose backward gives each block a tile of neighbouring pixels instead of a run
# of one pixel row (kernels/common.cuh, tiled_query): its levels have whole tiles, a right strip,
# a bottom strip and sides smaller than a tile for every group size (tiles of 16 x 16 down to
# 2 x 4 pixels); a query processed twice or never would leave the gradients wrong. Every option
# combination goes through both kernels.
TILED_SHAPES = [(18, 19), (4, 8), (3, 5)]
AGG_CASES = {"dense": ([(4, 5), (3, 3), (2, 2)], 300), "spread": ([(16, 20), (8, 10), (3, 3)], 400),
             "decoder": ([(4, 5), (3, 3), (2, 2)], 5),
             # 4 points a level: an item's 12 points sliced over 3 blocks (MSDA_ROUTE_POINT_SLICED)
             "sliced": ([(4, 5), (3, 3), (2, 2)], 5, 4),
             "tiled": (TILED_SHAPES, sum(h * w for h, w in TILED_SHAPES))}
AGG_FEATURES = {"plain": (None, "bilinear"), "counts": ([3, 0, 2], "bilinear"),
                "nearest": (None, "nearest"), "counts_nearest": ([1, 3, 2], "nearest")}


def agg_inputs(generator, case, feature, dtype, channels):
    """Inputs, op options and oracle options of an AGG_CASES case with an AGG_FEATURES feature."""
    shapes, queries, *per_level = AGG_CASES[case]
    num_points_list, sampling = AGG_FEATURES[feature]
    counts = num_points_list or [per_level[0] if per_level else 2] * len(shapes)
    assert (queries * sum(counts) >= 2 * flat_size(shapes)) == (case not in ("decoder", "sliced"))
    inputs = make_point_inputs(generator, 2, queries, 3, channels, shapes, counts, dtype=dtype,
                               device="cuda")
    if num_points_list is None:  # the plain (B, Q, H, L, P, ...) layout
        B, Q, H, N = inputs["attention_weights"].shape
        inputs["sampling_locations"] = inputs["sampling_locations"].reshape(B, Q, H, len(shapes),
                                                                            N // len(shapes), 2)
        inputs["attention_weights"] = inputs["attention_weights"].reshape(B, Q, H, len(shapes),
                                                                          N // len(shapes))
    options = dict(num_points_list=num_points_list, sampling=sampling)
    oracle_opts = dict(num_points_list=num_points_list, nearest=sampling == "nearest")
    return inputs, options, oracle_opts


def agg_grads(inputs, grad_output, function):
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES}
    out = function(leaves["value"], inputs["spatial_shapes"], leaves["sampling_locations"],
                   leaves["attention_weights"])
    out.backward(grad_output)
    return out.detach(), [leaves[k].grad for k in GRAD_NAMES]


def agg_op(inputs, **options):
    return lambda v, shapes, loc, attn: pymsda.ms_deform_attn(
        v, shapes, inputs["level_start_index"], loc, attn, **options)


@pytest.mark.parametrize("dtype,channels", GROUPS,
                         ids=[f"{str(d)[6:]}-C{c}" for d, c in GROUPS])
@pytest.mark.parametrize("feature", list(AGG_FEATURES))
@pytest.mark.parametrize("case", list(AGG_CASES))
def test_aggregated_and_per_point_backward_match_f64_oracle(generator, dtype, channels, feature,
                                                            case):
    inputs, options, oracle_opts = agg_inputs(generator, case, feature, dtype, channels)
    mine = agg_op(inputs, **options)
    grad_output = random_grad_output(generator, mine(inputs["value"], inputs["spatial_shapes"],
                                                     inputs["sampling_locations"],
                                                     inputs["attention_weights"]))
    out, got = agg_grads(inputs, grad_output, mine)
    expected_out = oracle_forward_general(inputs, **oracle_opts)
    expected = oracle_backward_general(inputs, grad_output, **oracle_opts)
    if dtype == torch.float32:
        assert rel_l2(out, expected_out) < 1e-6
        for name, g, e in zip(GRAD_NAMES, got, expected):
            if g is None:  # nearest: no location gradient (None, not zeros)
                assert options["sampling"] == "nearest" and name == "sampling_locations"
                continue
            assert rel_l2(g, e) < 1e-5, name
    else:
        ref_out, ref = agg_grads(inputs, grad_output,
                                 lambda v, s, loc, attn: ms_deform_attn_pytorch(v, s, loc, attn,
                                                                                **options))
        assert rel_l2(out, expected_out) <= loose_bound(rel_l2(ref_out, expected_out))
        for name, g, r, e in zip(GRAD_NAMES, got, ref, expected):
            if r is None:  # nearest: no location gradient, in the reference or here
                assert not e.any() and g is None, name
            else:
                assert rel_l2(g, e) <= loose_bound(rel_l2(r, e)), name


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "deterministic"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("case", ["spread", "tiled", "decoder", "sliced"])
def test_grad_value_is_zeroed_whatever_its_memory_held(generator, monkeypatch, case, dtype,
                                                      deterministic):
    # grad_value comes from new_empty; the library zeroes it on the stream before scattering
    # (cudaMemsetAsync, or zero_kernel with the aggregated kernel, or the per-point kernel of
    # sliced points ("decoder"), as its programmatic dependent). Here new_empty hands out memory full of NaN: an element left unzeroed stays
    # NaN, and the value rows no point touches must come out exactly 0.
    inputs, options, oracle_opts = agg_inputs(generator, case, "plain", dtype, 32)
    poisoned = []
    new_empty = torch.Tensor.new_empty

    def nan_filled(self, *args, **kwargs):
        t = new_empty(self, *args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
            poisoned.append(tuple(t.shape))
        return t

    mine = agg_op(inputs, deterministic=deterministic, **options)
    grad_output = random_grad_output(generator, mine(inputs["value"], inputs["spatial_shapes"],
                                                     inputs["sampling_locations"],
                                                     inputs["attention_weights"]))
    monkeypatch.setattr(torch.Tensor, "new_empty", nan_filled)
    _, got = agg_grads(inputs, grad_output, mine)
    monkeypatch.undo()
    assert tuple(inputs["value"].shape) in poisoned  # the poison reached grad_value
    expected = oracle_backward_general(inputs, grad_output, **oracle_opts)[0]
    assert torch.isfinite(got[0]).all()
    assert not got[0][expected == 0].any()
    assert rel_l2(got[0], expected) < (1e-5 if dtype == torch.float32 else 2.0 ** -5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("channels", [16, 32, 128])
@pytest.mark.parametrize("feature", list(AGG_FEATURES))
@pytest.mark.parametrize("case", ["dense", "tiled"])
def test_deterministic_aggregated_backward_repeats_bitwise_and_matches_oracle(
        generator, dtype, channels, feature, case):
    # deterministic=True on an encoder-like problem: the aggregated kernel with fixed-point sums
    inputs, options, oracle_opts = agg_inputs(generator, case, feature, dtype, channels)
    mine = agg_op(inputs, deterministic=True, **options)
    grad_output = random_grad_output(generator, mine(inputs["value"], inputs["spatial_shapes"],
                                                     inputs["sampling_locations"],
                                                     inputs["attention_weights"]))
    _, first = agg_grads(inputs, grad_output, mine)
    for _ in range(3):
        _, again = agg_grads(inputs, grad_output, mine)
        for name, a, b in zip(GRAD_NAMES, first, again):
            assert (a is None and b is None) or torch.equal(a, b), name
    expected = oracle_backward_general(inputs, grad_output, **oracle_opts)
    _, default = agg_grads(inputs, grad_output, agg_op(inputs, **options))
    for name, g, d, e in zip(GRAD_NAMES, first, default, expected):
        if g is None:  # nearest: no location gradient at all
            assert "nearest" in feature and name == "sampling_locations" and d is None, name
        elif dtype == torch.float32:
            assert rel_l2(g, e) < 1e-5, name
        elif e.any():  # bf16: as close to the oracle as the default (float-atomic) backward
            assert rel_l2(g, e) <= 1.5 * rel_l2(d, e) + 1e-3, name


@pytest.mark.parametrize("channels", [16, 32, 128])
def test_aggregated_backward_point_gradients_are_bitwise_repeatable(generator, channels):
    # Which walker sums a value row depends on the order the rows were filed in, which varies
    # from run to run; the location and weight gradients must not.
    shapes, queries = AGG_CASES["dense"]
    inputs = make_inputs(generator, batch=2, queries=queries, heads=3, channels=channels,
                         shapes=shapes, points=2, dtype=torch.float32, device="cuda")
    grad_output = random_grad_output(generator, run_msda(inputs))
    first = grads_of(inputs, grad_output)[1]
    for _ in range(5):
        again = grads_of(inputs, grad_output)[1]
        for name, a, b in zip(GRAD_NAMES, first, again):
            if name != "value":  # grad_value is summed with atomics
                assert torch.equal(a, b), name


# ---- decoders' backward at its edges --------------------------------------------------------------
#
# Decoder-like problems (Q * NP < 2 * S) take the per-point backward, f32 at C = 32 with 2
# channels a thread (kernels/backward_point.cuh). Its gradients against the oracle where points crowd,
# spread or leave the maps: "plain", a decoder with points outside the maps; "crowded", every
# point of a head within a pixel or two (hundreds of corners on one value row); "wide", levels
# wider than 1536 pixels; "tiny", 1 x 1, 1 x N and N x 1 levels and one query; "skewed", most
# points on one level's last row and past its right edge. A gather of grad_value by tiles of
# value rows was measured for these problems and not shipped (kernels/TUNING.md, v48); these
# cases were written for it.
DECODER_CASES = {
    "plain": (2, 60, 3, [(20, 30), (10, 15), (5, 8), (3, 4)], 4),
    "crowded": (1, 400, 2, [(32, 32)], 4),
    "wide": (1, 50, 2, [(2, 2000), (3, 700)], 2),
    "tiny": (3, 1, 1, [(1, 1), (1, 7), (5, 1)], 3),
    "skewed": (2, 90, 2, [(12, 40), (6, 20)], 3),
}


def decoder_inputs(generator, case):
    batch, queries, heads, shapes, points = DECODER_CASES[case]
    assert queries * len(shapes) * points < 2 * flat_size(shapes)  # a decoder: not aggregated
    inputs = make_inputs(generator, batch=batch, queries=queries, heads=heads, channels=32,
                         shapes=shapes, points=points, dtype=torch.float32, device="cuda",
                         loc_low=-0.15, loc_high=1.15)
    loc = inputs["sampling_locations"]
    if case == "crowded":  # within a pixel of the map's centre
        loc = 0.5 + (loc - 0.5) * 0.05
    elif case == "skewed":  # level 0: most points on its last row and outside the right edge
        loc = loc.clone()
        loc[:, :, :, 0, :, 1] = loc[:, :, :, 0, :, 1] * 0.05 + 0.97
        loc[:, ::3, :, 0, :, 0] += 0.3
    return dict(inputs, sampling_locations=loc.contiguous())


@pytest.mark.parametrize("wanted", ["all", "value", "value_loc"])
@pytest.mark.parametrize("case", list(DECODER_CASES))
def test_decoder_backward_matches_f64_oracle_where_points_crowd_or_leave(generator, case, wanted):
    inputs = decoder_inputs(generator, case)
    names = {"all": GRAD_NAMES, "value": ("value",),
             "value_loc": ("value", "sampling_locations")}[wanted]
    leaves = {k: inputs[k].detach().clone().requires_grad_(k in names) for k in GRAD_NAMES}
    out = run_msda(inputs, **leaves)
    grad_output = random_grad_output(generator, out)
    out.backward(grad_output)
    expected = oracle_backward(inputs, grad_output)
    for name, e in zip(GRAD_NAMES, expected):
        if name in names:
            assert rel_l2(leaves[name].grad, e) < 1e-5, name
    # rows no corner touches are exactly zero
    assert not leaves["value"].grad[torch.as_tensor(expected[0]) == 0].any()


@pytest.mark.parametrize("loc", [(float("nan"), 0.5), (0.5, float("inf")), (-0.5, 0.5),
                                 (0.0, 0.0), (1.0, 1.0), (0.5, 1.0 + 1e-3)],
                         ids=["nan", "inf", "left_of_map", "top_left_edge", "bottom_right_edge",
                              "below_map"])
def test_decoder_backward_points_on_and_off_the_edges(generator, loc):
    # Every seventh query's second point moved onto an edge, off the map or to a non-finite
    # location: points with no corner inside get zero location and weight gradients and add
    # nothing to grad_value; points on an edge keep the corners they have.
    inputs = decoder_inputs(generator, "plain")
    bad = inputs["sampling_locations"].clone()
    bad[:, ::7, :, :, 1] = torch.tensor(loc, device="cuda")
    inputs = dict(inputs, sampling_locations=bad)
    finite = torch.isfinite(bad).all(-1)
    safe = dict(inputs, sampling_locations=torch.where(finite[..., None], bad, 0.5),
                attention_weights=inputs["attention_weights"] * finite)
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES}
    out = run_msda(inputs, **leaves)
    grad_output = random_grad_output(generator, out)
    out.backward(grad_output)
    expected = oracle_backward(safe, grad_output)
    expected[1][~finite.cpu().numpy()] = 0
    expected[2][~finite.cpu().numpy()] = 0
    for name, e in zip(GRAD_NAMES, expected):
        assert rel_l2(leaves[name].grad, e) < 1e-5, name
    assert not leaves["sampling_locations"].grad[~finite].any()
    assert not leaves["attention_weights"].grad[~finite].any()


# Device tables that do not cover [0, S) level after level (overlapping or shifted levels, sums
# short of S): the CUDA kernels read them unchecked (no synchronisation) and bounds-check every
# corner. Where sides and starts stay inside what the fast kernels accept, they compute the same
# corners as the C library's CPU kernels (a corner counts when it is inside its level and its
# position inside [0, S)), so the gradients must agree, not merely stay finite.
LYING_DECODER_TABLES = [
    ([(20, 30), (10, 15)], [0, 500], 750),   # levels overlap
    ([(20, 30), (10, 15)], [150, 0], 750),   # out of order, overlapping
    ([(20, 30), (10, 15)], [0, 600], 900),   # short of S: rows no level reaches
    ([(20, 30), (10, 15)], [0, 700], 760),   # level 1 runs past S
    # without level_start_index (derived by the kernels and by the C library alike)
    ([(20, 30), (10, 15)], None, 900),       # short of S
    ([(20, 30), (10, 15)], None, 700),       # level 1 runs past S
    ([(30, 30), (10, 15)], None, 800),       # level 0 runs past S: level 1 starts at S
]


@pytest.mark.parametrize("shapes,starts,S", LYING_DECODER_TABLES,
                         ids=["overlap", "unordered", "short", "past_S", "derived_short",
                              "derived_past_S", "derived_level0_past_S"])
def test_decoder_backward_with_lying_device_tables_matches_the_c_cpu_kernels(
        generator, shapes, starts, S):
    from pymsda import _clib
    B, Q, H, C, L, P = 2, 40, 2, 32, len(shapes), 3
    value = torch.randn(B, S, H, C, generator=generator)
    loc = torch.rand(B, Q, H, L, P, 2, generator=generator) * 1.3 - 0.15
    attn = torch.rand(B, Q, H, L, P, generator=generator)
    grad_out = torch.randn(B, Q, H * C, generator=generator)
    shapes_t = torch.tensor(shapes)
    leaves = [t.cuda().requires_grad_(True) for t in (value, loc, attn)]
    out = pymsda.ms_deform_attn(leaves[0], shapes_t.cuda(),
                                None if starts is None else torch.tensor(starts).cuda(),
                                leaves[1], leaves[2])
    out.backward(grad_out.cuda())
    if starts is None:  # the C library's own derivation, on the host
        starts_t = torch.empty(L, dtype=torch.int64)
        assert _clib.lib.msda_level_starts(L, S, _clib.INDEX_I64, -1, shapes_t.data_ptr(),
                                          starts_t.data_ptr(), None) == _clib.OK
    else:
        starts_t = torch.tensor(starts)
    grads = [torch.full(t.shape, float("nan")) for t in (value, loc, attn)]
    args = _clib.pack_args(
        B=B, S=S, H=H, C=C, L=L, Q=Q, P=P, dtype=_clib.DTYPE_F32, index_dtype=_clib.INDEX_I64,
        device=-1, num_threads=2, value=value.data_ptr(), spatial_shapes=shapes_t.data_ptr(),
        level_start_index=starts_t.data_ptr(), sampling_locations=loc.data_ptr(),
        attention_weights=attn.data_ptr(), grad_output=grad_out.data_ptr(),
        **{f"grad_{name}": g.data_ptr() for name, g in zip(GRAD_NAMES, grads)})
    assert _clib.lib.msda_backward(args) == _clib.OK
    for name, leaf, expected in zip(GRAD_NAMES, leaves, grads):
        assert rel_l2(leaf.grad, expected.double()) < 1e-5, name


# The half-precision forward of a problem of >= 65536 (b, q, h) items takes 8 channels a thread
# (c/routes.c, MSDA_FWD_WIDE_MIN_ITEMS): group sizes C / 8 = 1, 4 and 16.
WIDE = [(torch.bfloat16, 8), (torch.bfloat16, 32), (torch.float16, 32), (torch.float16, 128)]


@pytest.mark.parametrize("dtype,channels", WIDE, ids=[f"{str(d)[6:]}-C{c}" for d, c in WIDE])
def test_wide_half_forward_of_large_problems_matches_f64_oracle(generator, dtype, channels):
    # 1 * 8203 * 8 = 65624 items: above the threshold, and not a whole number of blocks
    inputs = make_inputs(generator, batch=1, queries=8203, heads=8, channels=channels,
                         shapes=[(6, 5), (3, 4)], points=3, dtype=dtype, device="cuda",
                         kink_free=True)
    out = pymsda.ms_deform_attn(inputs["value"], inputs["spatial_shapes"],
                                inputs["level_start_index"], inputs["sampling_locations"],
                                inputs["attention_weights"])
    expected = oracle_forward_general(inputs)
    ref = ms_deform_attn_pytorch(inputs["value"], inputs["spatial_shapes"],
                                 inputs["sampling_locations"], inputs["attention_weights"])
    assert out.dtype == dtype and torch.isfinite(out).all()
    assert rel_l2(out, expected) <= loose_bound(rel_l2(ref, expected))
    # The f32 op on the same (rounded) inputs sums every channel in the same order, so only the
    # output's rounding differs
    out32 = pymsda.ms_deform_attn(inputs["value"].float(), inputs["spatial_shapes"],
                                  inputs["level_start_index"],
                                  inputs["sampling_locations"].float(),
                                  inputs["attention_weights"].float())
    assert torch.equal(out, out32.to(dtype))


# ---- half-precision grad_value through the f32 buffer (code for GPUs before sm_90) ---------------

_F32_BUFFER_SCRIPT = r"""
import json, sys
import torch
sys.path.insert(0, sys.argv[1])
import pymsda
from pymsda import _clib
from factories import GRAD_NAMES, make_inputs, oracle_backward, random_grad_output, rel_l2, run_msda
errors = {}
for name, queries in (("aggregated", 60), ("per_point", 5)):
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        generator = torch.Generator().manual_seed(7)
        inputs = make_inputs(generator, 2, queries, 2, 32, [(6, 8), (3, 4)], 2, dtype=dtype,
                             device="cuda", kink_free=True)
        leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES}
        out = run_msda(inputs, **leaves)
        grad_output = random_grad_output(generator, out)
        out.backward(grad_output)
        expected = oracle_backward(inputs, grad_output)
        errors[f"{name}/{dtype}"] = [rel_l2(leaves[k].grad, e) for k, e in zip(GRAD_NAMES, expected)]
code = _clib.DTYPE_BF16
need = _clib.lib.msda_backward_workspace_size(_clib.pack_args(
    B=2, S=60, H=2, C=32, L=2, Q=60, P=2, dtype=code, device=0))
print(json.dumps({"errors": errors, "workspace": need, "library": pymsda.library_path()}))
"""


@pytest.mark.own_library  # (tests/gpu_reliability.sh runs such a library under memcheck itself)
def test_half_grad_value_without_sm90_code_goes_through_the_f32_buffer(tmp_path):
    # Code built for GPUs before sm_90 (no half-precision vector atomics) accumulates a half
    # grad_value in an f32 buffer: a library with only sm_80 code (PTX compiled for this GPU
    # at load) asks for a workspace of 4 bytes per value element and rounds grad_value once,
    # in the aggregated (encoder) and direct (decoder) kernels. f32 rides along: without sm_90
    # code its grad_value is zeroed by cudaMemsetAsync, not by zero_kernel with the aggregated
    # kernel as its programmatic dependent. Builds that library (about a minute); needs nvcc
    # and make.
    import json
    import os
    import shutil
    import subprocess
    import sys
    if shutil.which("nvcc") is None or shutil.which("make") is None:
        pytest.skip("needs nvcc and make to build an sm_80 library")
    if torch.cuda.get_device_capability() < (8, 0):
        pytest.skip("an sm_80 library does not run on this GPU")
    tests = os.path.dirname(os.path.abspath(__file__))
    build = tmp_path / "build-sm80"
    made = subprocess.run(["make", "-C", os.path.dirname(tests), "CUDA_ARCHS=80",
                           f"BUILD={build}", f"-j{os.cpu_count() or 2}"],
                          capture_output=True, text=True, timeout=900)
    assert made.returncode == 0, made.stdout[-2000:] + made.stderr[-2000:]
    env = dict(os.environ, PYMSDA_LIBRARY=str(build / "libpymsda.so"))
    done = subprocess.run([sys.executable, "-c", _F32_BUFFER_SCRIPT, tests], env=env,
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert os.path.realpath(result["library"]) == os.path.realpath(build / "libpymsda.so")
    assert result["workspace"] == 2 * 60 * 2 * 32 * 4
    for case, errors in result["errors"].items():
        bound = 2.0 ** -8 if "bfloat16" in case else 2.0 ** -11 if "float16" in case else 1e-5
        for name, error in zip(GRAD_NAMES, errors):
            assert error < bound, (case, name, error)

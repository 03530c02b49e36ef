"""The CUDA forward's and backward's routes (c/routes.c, c/msda.h: msda_fwd_route, msda_route),
table by table.

On every machine: the choice itself, asked of the library for a table of problems that each rule
of the chooser decides; the backward's with the device stated (an H100's 132 multiprocessors and
sm_90 code, an A100's 108 and older code), the forward's needs none. With a GPU: one small problem
per route, kernel and dtype, whose route is asserted before its output (and for the backward its
three gradients) is checked against the float64 oracle; tests/gpu_reliability.sh runs these under
compute-sanitizer, so every route is instrumented there.
"""
import pytest
import torch

import pymsda
from pymsda.reference import ms_deform_attn_pytorch
from pymsda.routes import ALL_GRADS, Route, backward_route, forward_route
from conftest import requires_cuda
from factories import (GRAD_NAMES, loose_bound, make_point_inputs, oracle_backward_general,
                       oracle_forward_general, random_grad_output, rel_l2)

H100 = dict(multiprocessors=132, sm90_code=True)
A100 = dict(multiprocessors=108, sm90_code=False)

# Deformable DETR's four levels (S = 19947), 8 heads, 32 channels, 4 points a level
DDETR = dict(B=2, S=19947, H=8, C=32, L=4, P=4)
f32, f16, bf16, f64 = torch.float32, torch.float16, torch.bfloat16, torch.float64


def route(dtype, device=H100, Q=300, **changes):
    sizes = dict(DDETR, **{k: v for k, v in changes.items() if k in DDETR})
    options = {k: v for k, v in changes.items() if k not in DDETR}
    return backward_route(sizes["B"], sizes["S"], sizes["H"], sizes["C"], sizes["L"], Q,
                          sizes["P"], dtype, **device, **options)


def R(kernel, deterministic=False, f32_workspace=False):
    return Route(kernel, deterministic, f32_workspace)


# (name, arguments of route(), expected route)
TABLE = [
    # the generic kernel: f64, channel counts the fast kernels lack, sizes past int32 offsets,
    # too many levels, misaligned tensors
    ("f64", dict(dtype=f64, Q=900), R("generic")),
    ("f64 deterministic", dict(dtype=f64, Q=900, deterministic=True), R("generic", True)),
    ("C=5", dict(dtype=f32, Q=900, C=5), R("generic")),
    ("C=12", dict(dtype=f32, Q=900, C=12), R("generic")),
    ("C=256", dict(dtype=f32, Q=900, C=256), R("generic")),
    ("2^31 value elements", dict(dtype=f16, B=1, S=2 ** 23, Q=256), R("generic")),
    ("2^31 - 1023 items", dict(dtype=f16, B=1, H=1, C=4, L=1, P=1, Q=2 ** 31 - 1023),
     R("generic")),
    ("2^31 - 1024 items", dict(dtype=f16, B=1, H=1, C=4, L=1, P=1, Q=2 ** 31 - 1024),
     R("direct")),
    ("17 levels", dict(dtype=f32, Q=900, L=17), R("generic")),
    ("misaligned", dict(dtype=f32, Q=900, aligned=False), R("generic")),
    # the per-point kernel: f16 decoders of many lanes, decoders with options, deterministic
    # decoders, 128 channels in f32, G < 4 encoders (no aggregated kernel for 1 or 2 threads an
    # item)
    ("f16 decoder of 2^17 lanes", dict(dtype=f16, Q=1024), R("point")),
    ("f16 rtdetr_dec_b8", dict(dtype=f16, B=8, S=8400, L=3, Q=300), R("point")),
    ("bf16 decoder nearest", dict(dtype=bf16, Q=900, sampling="nearest"), R("point")),
    ("f32 decoder per-level points", dict(dtype=f32, Q=900, P=16, num_points_list=[1, 3, 5, 7]),
     R("point")),
    ("f32 decoder deterministic", dict(dtype=f32, Q=900, deterministic=True), R("point", True)),
    ("f32 C=128 decoder", dict(dtype=f32, Q=900, C=128), R("point")),
    ("f32 C=8 encoder", dict(dtype=f32, Q=19947, C=8), R("point")),
    ("sliced decoder deterministic", dict(dtype=bf16, Q=300, deterministic=True),
     R("point", True)),
    # the direct kernel: plain decoders of few points an item (at most 4: BEVFormer's decoder),
    # and f32 / f16 decoders of fewer than 2^17 lanes (items times C / 4) whose items have at
    # most 16 points (4 a lane); bf16 keeps its pipelined kernel (below)
    ("f32 ddetr_dec", dict(dtype=f32, Q=300), R("direct")),
    ("f16 ddetr_dec", dict(dtype=f16, Q=300), R("direct")),
    ("f32 dino_dec900", dict(dtype=f32, Q=900), R("direct")),
    ("f16 dino_dec900", dict(dtype=f16, Q=900), R("direct")),
    ("f32 one point a level", dict(dtype=f32, Q=300, P=1), R("direct")),
    ("bf16 bev_dec (4 points)", dict(dtype=bf16, B=1, S=40000, L=1, Q=900), R("direct")),
    ("bf16 4 points, many lanes", dict(dtype=bf16, B=8, S=40000, L=1, Q=9000), R("direct")),
    ("f32 just under 2^17 lanes", dict(dtype=f32, Q=1023), R("direct")),
    ("f32 at 2^17 lanes", dict(dtype=f32, Q=1024), R("point_pipelined")),
    ("f32 32 points an item (8 a lane)", dict(dtype=f32, Q=300, P=8), R("point_sliced")),
    ("f32 no value positions", dict(dtype=f32, S=0, Q=300), R("point_sliced")),
    ("f16 A100 decoder", dict(dtype=f16, Q=300, device=A100), R("direct", False, True)),
    # sliced points: too few blocks for the GPU (Deformable DETR's 300 queries), bf16
    ("bf16 ddetr_dec", dict(dtype=bf16, Q=300), R("point_sliced")),
    ("bf16 ddetr_dec A100", dict(dtype=bf16, Q=300, device=A100), R("point_sliced", False, True)),
    # pipelined: plain f32 (up to 64 channels) and bf16 decoders that fill the GPU, or whose
    # items have fewer than 8 points (never sliced)
    ("f32 rtdetr_dec_b8", dict(dtype=f32, B=8, S=8400, L=3, Q=300), R("point_pipelined")),
    ("bf16 dino_dec900", dict(dtype=bf16, Q=900), R("point_pipelined")),
    ("f32 C=64 decoder", dict(dtype=f32, Q=900, C=64), R("point_pipelined")),
    ("bf16 C=128 decoder", dict(dtype=bf16, Q=900, C=128), R("point_pipelined")),
    ("bf16 A100 decoder", dict(dtype=bf16, Q=900, device=A100), R("point_pipelined", False, True)),
    # aggregated: encoders (Q * L * P >= 2 * S) with 16 or more channels
    ("f32 ddetr_enc", dict(dtype=f32, Q=19947), R("aggregated")),
    ("f16 ddetr_enc", dict(dtype=f16, Q=19947), R("aggregated")),
    # float32 points with a half value (autocast's call): the all-half call's route, for every
    # route (grad_value summed as that call sums it: in float32 only where the code predates
    # sm_90)
    ("bf16 ddetr_enc f32 points", dict(dtype=bf16, Q=19947, points_dtype=f32), R("aggregated")),
    ("f16 ddetr_enc f32 points", dict(dtype=f16, Q=19947, points_dtype=f32), R("aggregated")),
    ("f16 dino_dec900 f32 points", dict(dtype=f16, Q=900, points_dtype=f32), R("direct")),
    ("bf16 dino_dec900 f32 points", dict(dtype=bf16, Q=900, points_dtype=f32),
     R("point_pipelined")),
    ("bf16 ddetr_dec f32 points", dict(dtype=bf16, Q=300, points_dtype=f32), R("point_sliced")),
    ("f16 ddetr_dec f32 points", dict(dtype=f16, Q=300, points_dtype=f32), R("direct")),
    ("bf16 ddetr_dec f32 points A100", dict(dtype=bf16, Q=300, points_dtype=f32, device=A100),
     R("point_sliced", False, True)),
    ("bf16 dino_dec900 f32 points A100", dict(dtype=bf16, Q=900, points_dtype=f32,
                                              device=A100), R("point_pipelined", False, True)),
    ("f16 encoder f32 points A100", dict(dtype=f16, Q=19947, points_dtype=f32, device=A100),
     R("aggregated", False, True)),
    ("bf16 ddetr_dec f32 points deterministic", dict(dtype=bf16, Q=300, points_dtype=f32,
                                                     deterministic=True), R("point", True)),
    ("bf16 f32 points without grad_value", dict(dtype=bf16, Q=900, points_dtype=f32,
                                                grads=("sampling_locations",)),
     R("point_pipelined")),
    ("bf16 C=12 f32 points", dict(dtype=bf16, Q=900, C=12, points_dtype=f32), R("generic")),
    ("bf16 ddetr_enc", dict(dtype=bf16, Q=19947), R("aggregated")),
    ("f32 encoder deterministic", dict(dtype=f32, Q=19947, deterministic=True),
     R("aggregated", True)),
    ("f16 encoder A100", dict(dtype=f16, Q=19947, device=A100), R("aggregated", False, True)),
    ("f16 encoder A100 deterministic", dict(dtype=f16, Q=19947, device=A100, deterministic=True),
     R("aggregated", True)),
    # aggregated: encoders only (Q = S), from Q * L * P = 2 * S on; a decoder of as many points
    # (BEVFormer's spatial cross-attention, scattered queries) takes a per-point kernel
    ("encoder of one point, under Q * L * P = 2 * S", dict(dtype=f32, L=1, P=1, Q=19947),
     R("direct")),
    ("decoder at Q * L * P = 2 * S", dict(dtype=f32, Q=2494), R("point_pipelined")),
    ("bev_sca", dict(dtype=f32, B=6, S=30825, P=8, Q=9000), R("point_pipelined")),
    ("bev_sca f16", dict(dtype=f16, B=6, S=30825, P=8, Q=9000), R("point")),
    # no queries: grad_value is only zeroed
    ("no queries", dict(dtype=f32, Q=0), R("none")),
    ("no queries, f16 on an A100", dict(dtype=f16, Q=0, device=A100), R("none", False, True)),
    ("no batch, deterministic", dict(dtype=f32, B=0, deterministic=True), R("none")),
    # the gradients wanted: no grad_value, nothing to accumulate in a workspace
    ("f16 A100 without grad_value", dict(dtype=f16, Q=900, device=A100,
                                         grads=("sampling_locations",)), R("direct")),
    ("deterministic without grad_value", dict(dtype=f32, Q=900, deterministic=True,
                                              grads=("attention_weights",)), R("direct")),
]


@pytest.mark.parametrize("name,args,expected", TABLE, ids=[t[0] for t in TABLE])
def test_backward_route_follows_the_chooser_table(name, args, expected):
    assert route(**args) == expected


def test_every_route_appears_in_the_table():
    kernels = {expected.kernel for _, _, expected in TABLE}
    assert kernels == set(pymsda._clib.ROUTE_KERNELS.values())
    assert any(e.deterministic for _, _, e in TABLE) and any(e.f32_workspace for _, _, e in TABLE)


# ---- the forward: (name, arguments of forward_route beyond DDETR's sizes, expected kernel) ------

def fwd(dtype, Q=300, **changes):
    sizes = dict(DDETR, **{k: v for k, v in changes.items() if k in DDETR})
    options = {k: v for k, v in changes.items() if k not in DDETR}
    return forward_route(sizes["B"], sizes["S"], sizes["H"], sizes["C"], sizes["L"], Q,
                         sizes["P"], dtype, **options)


ENCODER = 19947  # Q = S: 2 * 19947 * 8 = 319152 items, past the wide form's 65536
FORWARD_TABLE = [
    # G = C / 4 threads an item, every group size: float32 takes 4 channels a thread always
    *[(f"f32 encoder C={4 * G}", dict(dtype=f32, Q=ENCODER, C=4 * G), "fast")
      for G in (1, 2, 4, 8, 16, 32)],
    *[(f"f32 decoder C={4 * G}", dict(dtype=f32, Q=900, C=4 * G),
       "direct" if 14400 * G < 2 ** 16 else "fast") for G in (1, 2, 4, 8, 16, 32)],
    # half types: 8 channels a thread (C / 8 threads an item) from 65536 items on, C >= 8
    *[(f"{str(d)[6:]} encoder C={4 * G}", dict(dtype=d, Q=ENCODER, C=4 * G),
       "fast" if G == 1 else "wide") for d in (f16, bf16) for G in (1, 2, 4, 8, 16, 32)],
    *[(f"{str(d)[6:]} decoder C={4 * G}", dict(dtype=d, Q=900, C=4 * G),
       "direct" if 14400 * G < 2 ** 16 else "fast")
      for d in (f16, bf16) for G in (1, 2, 4, 8, 16, 32)],
    # the direct kernel: plain problems of at most 4 points an item (bev_tsa, bev_dec), or of
    # fewer than 2^16 lanes (items times C / 4: ddetr_dec's 38400)
    ("f32 ddetr_dec", dict(dtype=f32, Q=300), "direct"),
    ("bf16 ddetr_dec", dict(dtype=bf16, Q=300), "direct"),
    ("f32 just under 2^16 lanes", dict(dtype=f32, B=1, Q=1023), "direct"),
    ("f32 at 2^16 lanes", dict(dtype=f32, B=1, Q=1024), "fast"),
    ("f16 bev_tsa (4 points an item)", dict(dtype=f16, B=2, S=40000, L=1, Q=40000), "direct"),
    ("f32 encoder of 4 points an item", dict(dtype=f32, Q=ENCODER, P=1), "direct"),
    ("f32 encoder of 8 points an item", dict(dtype=f32, Q=ENCODER, P=2), "fast"),
    ("f32 decoder nearest", dict(dtype=f32, sampling="nearest"), "fast"),
    ("f32 decoder without value positions", dict(dtype=f32, S=0), "fast"),
    ("bf16 65528 items", dict(dtype=bf16, B=1, Q=8191), "fast"),
    ("bf16 65536 items", dict(dtype=bf16, B=1, Q=8192), "wide"),
    ("f16 65536 items C=4", dict(dtype=f16, B=1, Q=8192, C=4), "fast"),
    # options and float32 points (autocast's call) take the plain call's kernel
    ("bf16 encoder nearest", dict(dtype=bf16, Q=ENCODER, sampling="nearest"), "wide"),
    ("f16 encoder per-level points", dict(dtype=f16, Q=ENCODER, P=16,
                                          num_points_list=[1, 3, 5, 7]), "wide"),
    ("f32 decoder per-level points", dict(dtype=f32, P=16, num_points_list=[1, 3, 5, 7]),
     "fast"),
    ("bf16 encoder f32 points", dict(dtype=bf16, Q=ENCODER, points_dtype=f32), "wide"),
    ("f16 decoder f32 points", dict(dtype=f16, points_dtype=f32), "direct"),
    # the generic kernel: f64, channel counts the fast kernels lack, sizes past int32 offsets,
    # too many levels, misaligned tensors
    *[(f"f64 C={C}", dict(dtype=f64, Q=ENCODER, C=C), "generic") for C in (4, 32, 128)],
    *[(f"{str(d)[6:]} C={C}", dict(dtype=d, Q=ENCODER, C=C), "generic")
      for d in (f32, f16, bf16) for C in (1, 3, 5, 12, 48, 96, 256)],
    ("bf16 C=12 f32 points", dict(dtype=bf16, Q=ENCODER, C=12, points_dtype=f32), "generic"),
    ("2^31 value elements", dict(dtype=f16, B=1, S=2 ** 23, Q=ENCODER), "generic"),
    ("just under 2^31 value elements", dict(dtype=f16, B=1, S=2 ** 23 - 1, Q=ENCODER), "wide"),
    ("2^31 - 1023 items", dict(dtype=f16, B=1, H=1, C=4, L=1, P=1, Q=2 ** 31 - 1023), "generic"),
    ("2^31 - 1024 items", dict(dtype=f16, B=1, H=1, C=4, L=1, P=1, Q=2 ** 31 - 1024), "direct"),
    ("2^31 - 1024 items C=8", dict(dtype=bf16, B=1, H=1, C=8, L=1, P=1, Q=2 ** 31 - 1024,
                                   S=1), "direct"),
    ("2^31 - 1024 items of 8 points", dict(dtype=bf16, B=1, H=1, C=8, L=1, P=8,
                                           Q=2 ** 31 - 1024, S=1), "wide"),
    ("17 levels", dict(dtype=bf16, Q=ENCODER, L=17), "generic"),
    ("16 levels", dict(dtype=bf16, Q=ENCODER, L=16), "wide"),
    ("f32 misaligned", dict(dtype=f32, aligned=False), "generic"),
    ("bf16 encoder misaligned", dict(dtype=bf16, Q=ENCODER, aligned=False), "generic"),
    # nothing to compute
    ("no queries", dict(dtype=f32, Q=0), "none"),
    ("no batch", dict(dtype=bf16, B=0, Q=ENCODER), "none"),
]


@pytest.mark.parametrize("name,args,expected", FORWARD_TABLE, ids=[t[0] for t in FORWARD_TABLE])
def test_forward_route_follows_the_chooser_table(name, args, expected):
    assert fwd(**args) == expected


def test_every_forward_route_appears_in_the_table():
    kernels = {expected for _, _, expected in FORWARD_TABLE}
    assert kernels == set(pymsda._clib.FWD_ROUTE_KERNELS.values())


@pytest.mark.parametrize("bad,error,match", [
    (dict(C=0), ValueError, "C = 0"),
    (dict(sampling="cubic"), ValueError, "sampling"),
    (dict(num_points_list=[1, 2, 3, 4]), ValueError, "sums to 10"),
    (dict(dtype=torch.int32), TypeError, "dtype"),
    (dict(dtype=f32, points_dtype=f16), None, None),  # a narrower points dtype: value's route
])
def test_forward_route_refuses_bad_arguments_naming_them(bad, error, match):
    args = dict(dict(B=2, S=19947, H=8, C=32, L=4, Q=300, P=4, dtype=f32), **bad)
    sizes = [args.pop(k) for k in ("B", "S", "H", "C", "L", "Q", "P", "dtype")]
    if error is None:
        assert forward_route(*sizes, **args) == "direct"
        return
    with pytest.raises(error, match=match):
        forward_route(*sizes, **args)


# ---- the backward's refusals -------------------------------------------------------------------

@pytest.mark.parametrize("bad,match", [
    (dict(grads=("weights",)), "grads"),
    (dict(multiprocessors=0, sm90_code=True), "multiprocessors"),
    (dict(C=0), "C = 0"),
    (dict(sampling="cubic"), "sampling"),
    (dict(num_points_list=[1, 2, 3, 4]), "sums to 10"),
])
def test_backward_route_refuses_bad_arguments_naming_them(bad, match):
    args = dict(dict(B=2, S=19947, H=8, C=32, L=4, Q=300, P=4, dtype=f32), **H100)
    args.update(bad)
    sizes = [args.pop(k) for k in ("B", "S", "H", "C", "L", "Q", "P", "dtype")]
    with pytest.raises(ValueError, match=match):
        backward_route(*sizes, **args)


# ---- on the GPU: one small problem per route ------------------------------------------------

SHAPES = [(9, 11), (5, 6), (3, 3)]  # S = 138
S_SMALL = sum(h * w for h, w in SHAPES)
# (kernel, dtypes, channels, queries, points a level, options, deterministic); the queries and
# points pick the route whatever the GPU's multiprocessor count: direct needs at most 16 points
# an item (f32, f16; 4 in bf16) and fewer than 2^17 lanes (2 * Q * 3 items times C / 4);
# sliced 8 or more points an item and few items; pipelined fewer than 8 (no slicing);
# aggregated an encoder, Q = S = 138
GPU_CASES = [
    ("generic", (f64, f32, f16, bf16), 3, 7, 2, {}, False),
    ("generic", (f64, f32, bf16), 6, 7, 2, {}, True),
    ("direct", (f32, f16), 32, 7, 2, {}, False),  # 6 points: 2 lane groups an item
    ("direct", (f32, f16), 32, 7, 5, {}, False),  # 15 points: 4 lane groups of 4 points
    ("direct", (f32, f16, bf16), 32, 7, 1, {}, False),
    ("direct", (f32,), 128, 7, 1, {}, False),  # 32 lanes of 4 channels, 1 lane group
    ("direct", (f16,), 16, 7, 4, {}, False),
    ("point", (f16,), 32, 2731, 2, {}, False),  # 2^17 lanes
    ("point", (f32, bf16), 32, 7, 2, dict(sampling="nearest"), False),
    ("point", (f32, f16), 128, 7, 2, dict(sampling="nearest"), False),
    ("point", (f32, f16, bf16), 32, 7, 2, {}, True),
    ("point_sliced", (f32, bf16), 32, 7, 6, {}, False),
    ("point", (f16,), 32, 7, 6, {}, False),  # f16 points sliced through the per-point kernel
    ("point_pipelined", (f32, bf16), 16, 5462, 2, {}, False),  # 2^17 lanes
    ("point_pipelined", (bf16,), 16, 7, 2, {}, False),
    ("point_pipelined", (f32,), 64, 1366, 2, {}, False),
    ("aggregated", (f32, f16, bf16), 32, S_SMALL, 2, {}, False),
    ("aggregated", (f32, bf16), 64, S_SMALL, 2, dict(sampling="nearest"), False),
    ("aggregated", (f32, f16, bf16), 16, S_SMALL, 2, {}, True),
    ("none", (f32, f16), 32, 0, 2, {}, False),
]
GRADS = {"all": ALL_GRADS, "value": ("value",), "points": ("sampling_locations",
                                                          "attention_weights")}
# (deterministic concerns grad_value only: without it the route is another's); half dtypes
# also with float32 points (MSDA_POINTS_F32, autocast's inputs), which take the same routes
GPU_PARAMS = [(kernel, dtype, C, Q, P, options, det, grads, points32)
              for kernel, dtypes, C, Q, P, options, det in GPU_CASES for dtype in dtypes
              for grads in GRADS if not (det and grads == "points")
              for points32 in ((False, True) if dtype in (f16, bf16) else (False,))]


def _gpu_id(p):
    kernel, dtype, C, Q, P, options, det, grads, points32 = p
    extra = "".join(f"-{k}={v}" for k, v in options.items())
    return (f"{kernel}-{str(dtype)[6:]}-C{C}{extra}" + ("-deterministic" if det else "")
            + f"-grads={grads}" + ("-points=f32" if points32 else ""))


@requires_cuda
@pytest.mark.parametrize("case", GPU_PARAMS, ids=[_gpu_id(p) for p in GPU_PARAMS])
def test_each_route_matches_f64_oracle_cuda(generator, case):
    kernel, dtype, C, Q, P, options, det, grads, points32 = case
    grads = GRADS[grads]
    L = len(SHAPES)
    got_route = backward_route(2, S_SMALL, 3, C, L, Q, P, dtype, deterministic=det,
                               grads=grads, points_dtype=f32 if points32 else None, **options)
    assert got_route.kernel == kernel and got_route.deterministic == (det and "value" in grads
                                                                      and Q > 0), got_route
    # the f32 workspace: half precision, grad_value wanted, atomic, code older than sm_90
    half_in_f32 = backward_route(1, 1, 1, 4, 1, 1, 1, f16).f32_workspace
    assert got_route.f32_workspace == (dtype in (f16, bf16) and "value" in grads and not det
                                       and half_in_f32), got_route
    nearest = options.get("sampling") == "nearest"
    inputs = make_point_inputs(generator, 2, Q, 3, C, SHAPES, [P] * L,
                               dtype=f32 if points32 else dtype, device="cuda")
    if points32:
        inputs["value"] = inputs["value"].to(dtype)
    shape = (2, Q, 3, L, P)
    inputs["sampling_locations"] = inputs["sampling_locations"].reshape(shape + (2,))
    inputs["attention_weights"] = inputs["attention_weights"].reshape(shape)
    leaves = {k: inputs[k].detach().clone().requires_grad_(k in grads) for k in GRAD_NAMES}

    def run(function, **extra):
        args = [leaves["value"], inputs["spatial_shapes"], leaves["sampling_locations"],
                leaves["attention_weights"]]
        out = function(*args, **extra)
        wanted = [leaves[k] for k in GRAD_NAMES if k in grads]
        return out, dict(zip([k for k in GRAD_NAMES if k in grads],
                             torch.autograd.grad(out, wanted, grad_output, allow_unused=True)))

    out = pymsda.ms_deform_attn(leaves["value"], inputs["spatial_shapes"], None,
                                leaves["sampling_locations"], leaves["attention_weights"],
                                deterministic=det, **options)
    grad_output = random_grad_output(generator, out)
    out, got = run(lambda *a: pymsda.ms_deform_attn(a[0], a[1], None, a[2], a[3],
                                                    deterministic=det, **options))
    oracle_opts = dict(nearest=nearest)
    expected_out = oracle_forward_general(inputs, **oracle_opts)
    expected = dict(zip(GRAD_NAMES, oracle_backward_general(inputs, grad_output, **oracle_opts)))
    if Q == 0:
        assert out.numel() == 0
        if "value" in got:
            assert got["value"].abs().sum() == 0
        return
    if points32:
        # the oracle has the very inputs: the output and grad_value differ from it by their
        # rounding to half precision, the point gradients, summed in f32 from float32 points,
        # as an f32 call's do. A half grad_value summed in its own type (sm_90) rounds once per
        # contribution: a random walk of n roundings, n the corners that land on an element
        unit = 2.0 ** -8 if dtype == bf16 else 2.0 ** -11
        n = Q * L * P * 4 / S_SMALL
        value_bound = unit * max(4.0, n ** 0.5)
        assert rel_l2(out, expected_out) < unit
        for name, g in got.items():
            if nearest and name == "sampling_locations":
                assert g is None  # piecewise constant: no gradient (as RT-DETRv2's)
            else:
                assert g.dtype == (dtype if name == "value" else f32), name
                assert rel_l2(g, expected[name]) < (value_bound if name == "value" else 1e-5), name
        return
    if dtype in (f64, f32):
        bound = 1e-12 if dtype == f64 else 1e-5
        assert rel_l2(out, expected_out) < bound / 10
        for name, g in got.items():
            if nearest and name == "sampling_locations":
                assert g is None  # piecewise constant: no gradient (as RT-DETRv2's)
            else:
                assert rel_l2(g, expected[name]) < bound, name
        return
    ref_out, ref = run(lambda *a: ms_deform_attn_pytorch(a[0], a[1], a[2], a[3], **options))
    assert rel_l2(out, expected_out) <= loose_bound(rel_l2(ref_out, expected_out))
    for name, g in got.items():
        if ref.get(name) is None:  # nearest: the reference gives no location gradient
            assert g is None, name
        else:
            assert rel_l2(g, expected[name]) <= loose_bound(rel_l2(ref[name], expected[name])), \
                name


# (kernel, dtypes, channels, queries, points a level, options): one small problem per forward
# route and dtype, half types also with float32 points; the wide form needs 65536 items
# (2 * Q * 3 heads) of more than 4 points, the fast ones 2^16 lanes (items times C / 4)
FWD_GPU_CASES = [
    ("generic", (f64, f32, f16, bf16), 3, 7, 2, {}),
    ("fast", (f32, f16, bf16), 32, 1366, 2, {}),
    ("fast", (f32, bf16), 16, 7, 2, dict(sampling="nearest")),
    ("wide", (f16, bf16), 16, 10923, 2, {}),
    ("wide", (f16, bf16), 8, 10923, 2, dict(sampling="nearest")),
    ("direct", (f32, f16, bf16), 32, 7, 2, {}),  # 4 lane groups an item
    ("direct", (f32, f16, bf16), 32, 683, 1, {}),  # 2^15 lanes: 1 lane group
    ("direct", (f32, bf16), 128, 7, 1, {}),
    ("direct", (f16,), 4, 7, 5, {}),
]
FWD_GPU_PARAMS = [(kernel, dtype, C, Q, P, options, points32)
                  for kernel, dtypes, C, Q, P, options in FWD_GPU_CASES for dtype in dtypes
                  for points32 in ((False, True) if dtype in (f16, bf16) else (False,))]


def _fwd_gpu_id(p):
    kernel, dtype, C, Q, P, options, points32 = p
    extra = "".join(f"-{k}={v}" for k, v in options.items())
    return (f"{kernel}-{str(dtype)[6:]}-C{C}-Q{Q}-P{P}{extra}"
            + ("-points=f32" if points32 else ""))


@requires_cuda
@pytest.mark.parametrize("case", FWD_GPU_PARAMS, ids=[_fwd_gpu_id(p) for p in FWD_GPU_PARAMS])
def test_each_forward_route_matches_f64_oracle_cuda(generator, case):
    kernel, dtype, C, Q, P, options, points32 = case
    L = len(SHAPES)
    assert forward_route(2, S_SMALL, 3, C, L, Q, P, dtype,
                         points_dtype=f32 if points32 else None, **options) == kernel
    inputs = make_point_inputs(generator, 2, Q, 3, C, SHAPES, [P] * L,
                               dtype=f32 if points32 else dtype, device="cuda")
    if points32:
        inputs["value"] = inputs["value"].to(dtype)
    inputs["sampling_locations"] = inputs["sampling_locations"].reshape(2, Q, 3, L, P, 2)
    inputs["attention_weights"] = inputs["attention_weights"].reshape(2, Q, 3, L, P)
    args = (inputs["value"], inputs["spatial_shapes"], inputs["sampling_locations"],
            inputs["attention_weights"])
    out = pymsda.ms_deform_attn(args[0], args[1], None, *args[2:], **options)
    expected = oracle_forward_general(inputs, nearest=options.get("sampling") == "nearest")
    if points32:  # the output differs from the oracle by its rounding to half precision
        assert rel_l2(out, expected) < (2.0 ** -8 if dtype == bf16 else 2.0 ** -11)
    elif dtype in (f64, f32):
        assert rel_l2(out, expected) < (1e-13 if dtype == f64 else 1e-6)
    else:
        reference = ms_deform_attn_pytorch(*args, **options)
        assert rel_l2(out, expected) <= loose_bound(rel_l2(reference, expected))


def test_route_codes_match_the_header():
    import re
    from pathlib import Path
    header = (Path(__file__).resolve().parent.parent / "c" / "msda.h").read_text()
    codes = {name: int(value, 0) for name, value in
             re.findall(r"MSDA_ROUTE_(\w+)\s*=\s*(0x[0-9a-fA-F]+|\d+)", header)}
    kernels = {name.lower(): code for name, code in codes.items()
               if code <= 0xFF and name != "KERNEL_MASK"}
    assert kernels == {name: code for code, name in pymsda._clib.ROUTE_KERNELS.items()}
    assert codes["KERNEL_MASK"] == pymsda._clib.ROUTE_KERNEL_MASK
    assert codes["DETERMINISTIC"] == pymsda._clib.ROUTE_DETERMINISTIC
    assert codes["F32_WORKSPACE"] == pymsda._clib.ROUTE_F32_WORKSPACE
    forward = {name.lower(): int(value) for name, value in
               re.findall(r"MSDA_FWD_ROUTE_(\w+)\s*=\s*(\d+)", header)}
    assert forward == {name: code for code, name in pymsda._clib.FWD_ROUTE_KERNELS.items()}

"""tests/test_forward.py: pymsda.ms_deform_attn forward against the numpy f64 oracle and the
pure-PyTorch reference, on the CPU always and on CUDA where there is a GPU.

Tolerances (DESIGN.md section 4): f64 ~1e-12; f32 rel-L2 < 1e-6; f16/bf16 no worse than twice the
error of the reference run in the same dtype. The oracle is fed the inputs as rounded to the
dtype under test, so what is measured is the computation's error.

Why f32 maps stay <= 16 pixels a side for the 1e-6 bound: the pixel coordinate loc*W - 0.5 is
itself rounded to f32, an absolute error of ~W * 2^-25 pixels that bilinear turns into a relative
output error of the same order; torch's own f32 grid_sample reaches ~8e-7 at 32 pixels a side.
Larger maps are checked against twice the f32 reference's error instead.
"""
import pytest
import torch

import pymsda
from pymsda.reference import ms_deform_attn_pytorch
from conftest import DEVICES, requires_cuda
from factories import (ARG_NAMES, HALF_DTYPES, loose_bound, make_inputs, oracle_forward,
                       random_level_shapes, reference_in_dtype, rel_l2, run_msda)




def run_reference(inputs):
    return ms_deform_attn_pytorch(inputs["value"], inputs["spatial_shapes"],
                                  inputs["sampling_locations"], inputs["attention_weights"])


def random_case(generator, max_side=12, levels=3):
    """A mid-sized case with rectangular levels and odd C."""
    return dict(batch=2, queries=13, heads=3, channels=7, points=4,
                shapes=random_level_shapes(generator, levels, max_side=max_side, min_side=2))


# ---- accuracy per dtype ------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_forward_matches_f64_oracle_f64(generator, device):
    inputs = make_inputs(generator, **random_case(generator), dtype=torch.float64, device=device)
    out = run_msda(inputs)
    assert out.dtype == torch.float64 and out.device.type == device
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_forward_matches_reference_f64(generator, device):
    inputs = make_inputs(generator, **random_case(generator), dtype=torch.float64, device=device)
    assert rel_l2(run_msda(inputs), run_reference(inputs)) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_forward_matches_f64_oracle_f32(generator, device):
    for _ in range(3):  # three fresh input sets
        inputs = make_inputs(generator, **random_case(generator, max_side=16),
                             dtype=torch.float32, device=device)
        out = run_msda(inputs)
        assert out.dtype == torch.float32
        assert rel_l2(out, oracle_forward(inputs)) < 1e-6


@pytest.mark.parametrize("device", DEVICES)
def test_forward_f32_large_maps_no_worse_than_reference(generator, device):
    case = random_case(generator, max_side=40)
    case["shapes"][0] = (40, 37)
    inputs = make_inputs(generator, **case, dtype=torch.float32, device=device)
    expected = oracle_forward(inputs)
    reference_error = rel_l2(run_reference(inputs), expected)
    assert rel_l2(run_msda(inputs), expected) <= max(2 * reference_error, 1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["f16", "bf16"])
def test_forward_half_within_twice_reference_error(generator, device, dtype):
    for _ in range(2):
        inputs = make_inputs(generator, **random_case(generator), dtype=dtype, device=device)
        out = run_msda(inputs)
        assert out.dtype == dtype and out.shape == (2, 13, 21)
        expected = oracle_forward(inputs)
        reference_error = rel_l2(reference_in_dtype(ms_deform_attn_pytorch, inputs), expected)
        error = rel_l2(out, expected)
        assert error <= loose_bound(reference_error), (error, reference_error)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["f16", "bf16"])
def test_forward_half_error_is_one_rounding(generator, device, dtype):
    # DESIGN: f16/bf16 accumulate in f32, so the only sizeable error left is the final rounding
    # of each output to the dtype: rel-L2 below the dtype's unit roundoff (2^-11 for f16, 2^-8
    # for bf16; a single rounding measures ~0.3-0.5 of it). Accumulating the L*P samples in the
    # half type itself lands at 2-4x that (like the reference in the same dtype).
    unit_roundoff = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    case = random_case(generator)
    case["points"] = 8
    inputs = make_inputs(generator, **case, dtype=dtype, device=device)
    assert rel_l2(run_msda(inputs), oracle_forward(inputs)) < unit_roundoff


@pytest.mark.parametrize("device", DEVICES)
def test_forward_function_apply_matches_ms_deform_attn(generator, device):
    inputs = make_inputs(generator, **random_case(generator), device=device)
    out = pymsda.MSDeformAttnFunction.apply(*(inputs[k] for k in ARG_NAMES), 64)
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12
    assert torch.equal(out, run_msda(inputs))


# ---- exact values ------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_forward_at_pixel_centres_reads_the_pixel(generator, device):
    # loc = (j + 0.5) / W lands on pixel j exactly: the output is that pixel's value.
    shapes = [(3, 5)]
    value = torch.randn(1, 15, 2, 4, generator=generator, dtype=torch.float64)
    rows, cols = torch.meshgrid(torch.arange(3.0, dtype=torch.float64),
                                torch.arange(5.0, dtype=torch.float64), indexing="ij")
    locations = torch.stack([(cols.reshape(-1) + 0.5) / 5, (rows.reshape(-1) + 0.5) / 3], -1)
    locations = locations.reshape(1, 15, 1, 1, 1, 2).expand(1, 15, 2, 1, 1, 2)
    weights = torch.ones(1, 15, 2, 1, 1, dtype=torch.float64)
    out = pymsda.ms_deform_attn(value.to(device), shapes, None, locations.to(device),
                                weights.to(device))
    torch.testing.assert_close(out.cpu(), value.reshape(1, 15, 8), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_forward_far_outside_the_map_is_zero(generator, device):
    case = random_case(generator)
    inputs = make_inputs(generator, **case, dtype=torch.float32, device=device)
    far = inputs["sampling_locations"].clone()
    far[0] = far[0] + 3.0   # batch 0: beyond the right / bottom edges
    far[1] = far[1] - 3.0   # batch 1: beyond the left / top edges
    out = run_msda(inputs, sampling_locations=far)
    assert torch.count_nonzero(out) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_forward_is_linear_in_attention_weights(generator, device):
    inputs = make_inputs(generator, **random_case(generator), device=device)
    doubled = run_msda(inputs, attention_weights=2 * inputs["attention_weights"])
    zero = run_msda(inputs, attention_weights=torch.zeros_like(inputs["attention_weights"]))
    assert rel_l2(doubled, 2 * run_msda(inputs)) < 1e-13
    assert torch.count_nonzero(zero) == 0


# ---- shape variety (f64, so every difference is a bug, not rounding) ---------------------------

SHAPE_CASES = {
    "C1": dict(batch=2, queries=5, heads=2, channels=1, points=2, levels=2),
    "C3": dict(batch=2, queries=5, heads=2, channels=3, points=2, levels=2),
    "C20": dict(batch=2, queries=5, heads=2, channels=20, points=2, levels=2),
    "C32": dict(batch=2, queries=5, heads=2, channels=32, points=2, levels=2),
    "C64": dict(batch=1, queries=5, heads=2, channels=64, points=2, levels=2),
    "L1": dict(batch=2, queries=6, heads=3, channels=5, points=3, levels=1),
    "L5": dict(batch=2, queries=6, heads=3, channels=5, points=3, levels=5),
    "P1": dict(batch=2, queries=6, heads=3, channels=5, points=1, levels=3),
    "P8": dict(batch=2, queries=6, heads=3, channels=5, points=8, levels=3),
    "B1": dict(batch=1, queries=6, heads=2, channels=5, points=3, levels=3),
    "B5": dict(batch=5, queries=6, heads=2, channels=5, points=3, levels=3),
    "Q1": dict(batch=2, queries=1, heads=2, channels=5, points=3, levels=3),
    "H1": dict(batch=2, queries=6, heads=1, channels=5, points=3, levels=3),
    "H8": dict(batch=1, queries=4, heads=8, channels=4, points=2, levels=2),
    "all_ones": dict(batch=1, queries=1, heads=1, channels=1, points=1, levels=1),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(SHAPE_CASES.values()), ids=list(SHAPE_CASES))
def test_forward_shape_variety_matches_f64_oracle(generator, device, case):
    case = dict(case)
    shapes = random_level_shapes(generator, case.pop("levels"), max_side=9)
    inputs = make_inputs(generator, **case, shapes=shapes, device=device)
    out = run_msda(inputs)
    assert out.shape == (case["batch"], case["queries"], case["heads"] * case["channels"])
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_forward_single_pixel_and_thin_levels(generator, device):
    shapes = [(1, 1), (1, 7), (6, 1), (2, 2)]
    inputs = make_inputs(generator, 2, 9, 2, 3, shapes, 3, device=device, loc_low=-0.5,
                         loc_high=1.5)
    assert rel_l2(run_msda(inputs), oracle_forward(inputs)) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_forward_rectangular_levels_are_not_transposed(generator, device):
    # A (2, 9) level read as (9, 2) would give different numbers; guard H/W order explicitly.
    shapes = [(2, 9), (5, 3)]
    inputs = make_inputs(generator, 1, 20, 1, 2, shapes, 2, device=device)
    out = run_msda(inputs)
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12
    swapped = torch.tensor([(9, 2), (3, 5)])
    assert rel_l2(out, oracle_forward(dict(inputs, spatial_shapes=swapped))) > 1e-3


# ---- ways of passing the arguments --------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32], ids=["int64", "int32"])
def test_forward_index_dtypes(generator, device, index_dtype):
    inputs = make_inputs(generator, **random_case(generator), device=device,
                         index_dtype=index_dtype)
    assert inputs["spatial_shapes"].dtype == index_dtype
    assert rel_l2(run_msda(inputs), oracle_forward(inputs)) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_forward_shapes_as_list_and_start_index_none(generator, device):
    case = random_case(generator)
    inputs = make_inputs(generator, **case, device=device)
    expected = oracle_forward(inputs)
    as_list = [list(pair) for pair in case["shapes"]]
    assert rel_l2(run_msda(inputs, spatial_shapes=as_list), expected) < 1e-12
    assert rel_l2(run_msda(inputs, spatial_shapes=case["shapes"], level_start_index=None),
                  expected) < 1e-12
    assert rel_l2(run_msda(inputs, level_start_index=None), expected) < 1e-12


@requires_cuda
def test_forward_cuda_value_with_host_spatial_shapes(generator):
    case = random_case(generator)
    inputs = make_inputs(generator, **case, device="cuda")
    out = run_msda(inputs, spatial_shapes=inputs["spatial_shapes"].cpu(),
              level_start_index=inputs["level_start_index"].cpu())
    assert out.is_cuda
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_forward_non_contiguous_inputs(generator, device):
    case = random_case(generator)
    inputs = make_inputs(generator, **case, device=device)
    B, Q, H, C, P = (case[k] for k in ("batch", "queries", "heads", "channels", "points"))
    L = len(case["shapes"])
    value_bhsc = inputs["value"].permute(0, 2, 1, 3).contiguous()
    value = value_bhsc.transpose(1, 2)  # (B, S, H, C) view of (B, H, S, C) memory
    wide = torch.zeros(B, Q, H, L, 2 * P, 2, dtype=torch.float64, device=device)
    wide[..., ::2, :] = inputs["sampling_locations"]
    locations = wide[..., ::2, :]
    weights = inputs["attention_weights"].transpose(0, 1).contiguous().transpose(0, 1)
    shapes = inputs["spatial_shapes"].t().contiguous().t()
    starts = torch.stack([inputs["level_start_index"]] * 2, -1)[:, 1]
    for tensor in (value, locations, weights, shapes, starts):
        assert not tensor.is_contiguous()
    out = pymsda.ms_deform_attn(value, shapes, starts, locations, weights)
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12
    # and the inputs were not modified
    assert torch.equal(value, inputs["value"]) and torch.equal(locations,
                                                               inputs["sampling_locations"])


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("im2col_step", [1, 2, 3, 64])
def test_forward_im2col_step_ignored_for_any_batch(generator, device, im2col_step):
    case = random_case(generator)
    case["batch"] = 5
    inputs = make_inputs(generator, **case, device=device)
    out = run_msda(inputs, im2col_step=im2col_step)
    assert out.shape[0] == 5
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12


@pytest.mark.parametrize("device", DEVICES)
def test_forward_mixed_float_dtypes_follow_value(generator, device):
    inputs = make_inputs(generator, **random_case(generator), dtype=torch.float32, device=device)
    # f64 locations and f16 weights, as AMP or a careless caller might pass them
    locations64 = inputs["sampling_locations"].double()
    weights16 = inputs["attention_weights"].half()
    out = run_msda(inputs, sampling_locations=locations64, attention_weights=weights16)
    assert out.dtype == torch.float32
    same_dtype = run_msda(inputs, attention_weights=weights16.float())
    assert rel_l2(out, same_dtype) < 1e-7

    half_value = inputs["value"].half()
    out = run_msda(inputs, value=half_value)  # f32 locations and weights with an f16 value
    assert out.dtype == torch.float16
    expected = oracle_forward(dict(inputs, value=half_value,
                                   sampling_locations=inputs["sampling_locations"].half(),
                                   attention_weights=inputs["attention_weights"].half()))
    assert rel_l2(out, expected) < 1e-2


@pytest.mark.parametrize("device", DEVICES)
def test_forward_does_not_require_grad_without_grad_inputs(generator, device):
    inputs = make_inputs(generator, **random_case(generator), device=device)
    out = run_msda(inputs)
    assert not out.requires_grad
    with torch.no_grad():
        leaf = inputs["value"].clone().requires_grad_(True)
        assert not run_msda(inputs, value=leaf).requires_grad

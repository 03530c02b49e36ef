"""Mixed dtypes (ms_deform_attn's dtype rule, c/msda.h: MSDA_POINTS_F32).

The rule: output and grad_value in value's dtype; sampling_locations and attention_weights (the
points) read in value's dtype when both have it, else, with a float16/bfloat16 value, as float32
(autocast's float32 points are never rounded to half precision); a point dtype narrower than
value's is widened to it. Gradients come back in each input's own dtype.

Checked on the CPU and on CUDA:
- every combination of the four float dtypes for value, locations and weights gives exactly
  what the call with the points cast by the rule gives (dtypes of output and gradients too);
- autocast's combination (half value, float32 points), plain and with every option: the forward
  and the location and weight gradients within 1.5x of the error that rounding value alone to
  its dtype gives (the f64 oracle with value rounded and exact points, its result rounded to
  value's dtype), and far below the error of the same call with its points rounded to half;
  grad_value, summed as the all-half call sums it, within 1.1x of that call's error at the same
  inputs (deterministic=True: within 1.5x of the single rounding, as the forward).
"""
import itertools

import pytest
import torch

import pymsda
from conftest import requires_cuda
from factories import (GRAD_NAMES, make_point_inputs, oracle_backward_general,
                       oracle_forward_general, rel_l2)

f64, f32, f16, bf16 = torch.float64, torch.float32, torch.float16, torch.bfloat16
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]
SHAPES = [(9, 11), (5, 6), (3, 3)]
POINTS = [2, 3, 2]


def _rule(value_dtype, point_dtype, other_dtype):
    """The dtype the op reads a point tensor in (ms_deform_attn's docstring)."""
    if point_dtype == value_dtype and other_dtype == value_dtype:
        return value_dtype
    return f32 if value_dtype in (f16, bf16) else value_dtype


def _call(value, loc, attn, grad_output, **options):
    leaves = [t.detach().clone().requires_grad_(True) for t in (value, loc, attn)]
    out = pymsda.ms_deform_attn(leaves[0], SHAPES, None, leaves[1], leaves[2],
                                num_points_list=POINTS, **options)
    return out.detach(), torch.autograd.grad(out, leaves, grad_output, allow_unused=True)


@pytest.mark.parametrize("device", DEVICES)
def test_every_dtype_combination_follows_the_rule(generator, device):
    inputs = make_point_inputs(generator, 2, 5, 2, 8, SHAPES, POINTS, device=device)
    dtypes = (f64, f32, f16, bf16)
    for value_dtype, loc_dtype, attn_dtype in itertools.product(dtypes, repeat=3):
        value = inputs["value"].to(value_dtype)
        loc = inputs["sampling_locations"].to(loc_dtype)
        attn = inputs["attention_weights"].to(attn_dtype)
        grad_output = torch.randn(2, 5, 16, generator=generator, dtype=f64).to(device,
                                                                               value_dtype)
        what = f"value {value_dtype}, locations {loc_dtype}, weights {attn_dtype}"
        out, grads = _call(value, loc, attn, grad_output, deterministic=True)
        assert out.dtype == value_dtype, what
        assert [g.dtype for g in grads] == [value_dtype, loc_dtype, attn_dtype], what
        ruled_loc = loc.to(_rule(value_dtype, loc_dtype, attn_dtype))
        ruled_attn = attn.to(_rule(value_dtype, attn_dtype, loc_dtype))
        expected_out, expected_grads = _call(value, ruled_loc, ruled_attn, grad_output,
                                             deterministic=True)
        assert torch.equal(out, expected_out), what
        for name, got, expected in zip(GRAD_NAMES, grads, expected_grads):
            assert torch.equal(got, expected.to(got.dtype)), f"{what}: {name}"


OPTIONS = {
    "plain": {},
    "softmax": dict(softmax=True),
    "nearest": dict(sampling="nearest"),
    "deterministic": dict(deterministic=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [f16, bf16], ids=["f16", "bf16"])
@pytest.mark.parametrize("option", OPTIONS)
def test_autocast_points_lose_no_precision(generator, device, dtype, option):
    options = OPTIONS[option]
    softmax, nearest = options.get("softmax", False), options.get("sampling") == "nearest"
    exact = make_point_inputs(generator, 2, 40, 2, 16, SHAPES, POINTS, logits=softmax)
    value = exact["value"].to(device, dtype)
    loc, attn = (exact[k].to(device, f32) for k in ("sampling_locations", "attention_weights"))
    grad_output = torch.randn(2, 40, 32, generator=generator, dtype=f64).to(device, dtype)
    oracle_options = dict(num_points_list=POINTS, softmax=softmax, nearest=nearest)

    # the yardstick: only value rounded to its dtype (exact points, exact arithmetic), the
    # results rounded to the dtypes they come back in
    rounded = dict(exact, value=value.double().cpu())
    truth_out = oracle_forward_general(exact, **oracle_options)
    truth = oracle_backward_general(exact, grad_output.cpu(), **oracle_options)
    yard_out = torch.from_numpy(oracle_forward_general(rounded, **oracle_options)).to(dtype)
    yard = [torch.from_numpy(g) for g in
            oracle_backward_general(rounded, grad_output.cpu(), **oracle_options)]
    yard = [yard[0].to(dtype), yard[1].to(f32), yard[2].to(f32)]

    # the all-half call at the same inputs (its points rounded), against its own oracle:
    # grad_value is summed as it sums it (half-precision atomics on sm_90 and newer)
    half_loc, half_attn = loc.to(dtype), attn.to(dtype)
    half_out, half_grads = _call(value, half_loc, half_attn, grad_output, **options)
    half_inputs = dict(exact, sampling_locations=half_loc.double().cpu(),
                       attention_weights=half_attn.double().cpu())
    half_truth = oracle_backward_general(half_inputs, grad_output.cpu(), **oracle_options)
    half_value_error = rel_l2(half_grads[0], half_truth[0])

    out, grads = _call(value, loc, attn, grad_output, **options)
    assert rel_l2(out, truth_out) <= 1.5 * rel_l2(yard_out, truth_out) + 1e-7
    for name, got, expected, yardstick in zip(GRAD_NAMES, grads, truth, yard):
        if nearest and name == "sampling_locations":
            assert got is None  # no location gradient at all
            continue
        if name == "value" and not options.get("deterministic"):
            bound = 1.1 * half_value_error + 1e-7
        else:
            bound = 1.5 * rel_l2(yardstick, expected) + 1e-7
        assert rel_l2(got, expected) <= bound, name

    # what the op did before the rule: points rounded to half precision, an error many times
    # the yardstick's (so the comparison above can fail)
    if not nearest:
        assert rel_l2(half_out, truth_out) > 2 * rel_l2(out, truth_out)

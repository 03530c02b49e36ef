"""tests/test_non_finite.py: non-finite input behaves as ms_deform_attn's docstring documents,
pinned exactly against the f64 oracle, on the CPU and on CUDA:

- a location that is NaN, infinite or far outside the map (either coordinate) contributes
  nothing, and its location and weight gradients are 0;
- a NaN or infinite weight on a point whose corners lie inside the map poisons that point's
  output row, the four corners' grad_value and its location gradient, and nothing else; its own
  weight gradient (the bilinear sample) stays finite;
- a NaN weight on a point outside the map (or at a NaN location) changes nothing, and the
  point's gradients are 0.
"""
import pytest
import torch

from conftest import DEVICES
from factories import (SMALL_SIZES, forward_and_grads, oracle_backward, oracle_forward,
                       random_grad_output, rel_l2, run_msda, small_inputs)

B, Q, H, C, L, P = SMALL_SIZES

POINT = (1, 2, 1, 0, 1)  # (b, q, h, l, p): the point the cases below make non-finite
ROW = POINT[:3]


def _finite_inputs(generator, device):
    return small_inputs(generator, device, dtype=torch.float64, kink_free=True)


def _with(inputs, loc=None, weight=None):
    """inputs with POINT's location and/or weight replaced."""
    inputs = dict(inputs)
    if loc is not None:
        inputs["sampling_locations"] = inputs["sampling_locations"].clone()
        inputs["sampling_locations"][POINT] = torch.tensor(loc, dtype=torch.float64)
    if weight is not None:
        inputs["attention_weights"] = inputs["attention_weights"].clone()
        inputs["attention_weights"][POINT] = weight
    return inputs


def _assert_matches_except(actual, expected, mask, bound=1e-11):
    """actual == expected (rel L2 < bound) wherever mask is False."""
    keep = ~mask
    assert rel_l2(actual[keep], torch.as_tensor(expected)[keep]) < bound


# the pixel coordinate (x, y) = (1.3, 1.6) of level 0 (4 x 5): all four corners inside
INSIDE = ((1.3 + 0.5) / 5, (1.6 + 0.5) / 4)
INSIDE_CORNERS = [(1, 1), (1, 2), (2, 1), (2, 2)]  # (y, x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loc", [(float("nan"), 0.5), (0.5, float("nan")),
                                 (float("nan"), float("nan")), (float("inf"), 0.5),
                                 (0.5, float("-inf")), (float("-inf"), float("inf")),
                                 (1e30, 0.5), (0.5, -1e300)],
                         ids=["nan_x", "nan_y", "nan_xy", "inf_x", "neg_inf_y", "inf_both",
                              "huge_x", "huge_negative_y"])
def test_non_finite_location_contributes_nothing_and_gets_zero_gradients(generator, device, loc):
    inputs = _finite_inputs(generator, device)
    bad = _with(inputs, loc=loc)
    # What the op must equal: the same inputs with that point's weight 0 (location finite).
    expected_inputs = _with(inputs, loc=(0.5, 0.5), weight=0.0)
    grad_output = random_grad_output(generator, run_msda(inputs))
    out, grads = forward_and_grads(bad, grad_output)
    assert rel_l2(out, oracle_forward(expected_inputs)) < 1e-12
    grad_value, grad_loc, grad_attn = grads
    expected_value, expected_loc, expected_attn = oracle_backward(expected_inputs, grad_output)
    assert rel_l2(grad_value, expected_value) < 1e-11
    assert torch.all(grad_loc[POINT] == 0) and grad_attn[POINT] == 0
    expected_loc[POINT] = 0
    expected_attn[POINT] = 0
    assert rel_l2(grad_loc, expected_loc) < 1e-11
    assert rel_l2(grad_attn, expected_attn) < 1e-11


def _corner_mask(value_shape):
    mask = torch.zeros(value_shape, dtype=torch.bool)
    b, _, h, _, _ = POINT
    for y, x in INSIDE_CORNERS:  # level 0 starts at 0 and is 5 wide
        mask[b, y * 5 + x, h, :] = True
    return mask


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("weight", [float("nan"), float("inf"), float("-inf")],
                         ids=["nan", "inf", "neg_inf"])
def test_non_finite_weight_of_an_inside_point_poisons_its_row_only(generator, device, weight):
    inputs = _with(_finite_inputs(generator, device), loc=INSIDE)
    bad = _with(inputs, weight=weight)
    expected_inputs = _with(inputs, weight=0.0)
    grad_output = random_grad_output(generator, run_msda(inputs))
    out, (grad_value, grad_loc, grad_attn) = forward_and_grads(bad, grad_output)
    out, grad_value = out.cpu(), grad_value.cpu()
    grad_loc, grad_attn = grad_loc.cpu(), grad_attn.cpu()
    row = out.view(B, Q, H, C)[ROW]
    if weight != weight:
        assert torch.isnan(row).all()
    else:
        assert not torch.isfinite(row).any()
    row_mask = torch.zeros(B, Q, H, C, dtype=torch.bool)
    row_mask[ROW] = True
    _assert_matches_except(out, oracle_forward(expected_inputs),
                           row_mask.view(B, Q, H * C), bound=1e-12)

    expected_value, expected_loc, expected_attn = oracle_backward(expected_inputs, grad_output)
    corners = _corner_mask(grad_value.shape)
    assert torch.equal(~torch.isfinite(grad_value), corners)
    _assert_matches_except(grad_value, expected_value, corners)
    point_mask = torch.zeros(grad_loc.shape, dtype=torch.bool)
    point_mask[POINT] = True
    assert not torch.isfinite(grad_loc[POINT]).any()
    _assert_matches_except(grad_loc, expected_loc, point_mask)
    # the weight's own gradient is the bilinear sample: finite, as for any weight
    assert rel_l2(grad_attn, expected_attn) < 1e-11


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("loc", [(5.0, 5.0), (float("nan"), 0.5)], ids=["far_outside", "nan"])
def test_non_finite_weight_of_a_point_outside_changes_nothing_else(generator, device, loc):
    inputs = _with(_finite_inputs(generator, device), loc=loc)
    bad = _with(inputs, weight=float("nan"))
    expected_inputs = _with(inputs, loc=(0.5, 0.5), weight=0.0)
    grad_output = random_grad_output(generator, run_msda(inputs))
    out, (grad_value, grad_loc, grad_attn) = forward_and_grads(bad, grad_output)
    assert rel_l2(out, oracle_forward(expected_inputs)) < 1e-12
    expected_value, expected_loc, expected_attn = oracle_backward(expected_inputs, grad_output)
    assert rel_l2(grad_value, expected_value) < 1e-11
    assert grad_attn[POINT] == 0
    expected_attn[POINT] = 0
    assert rel_l2(grad_attn, expected_attn) < 1e-11
    point_mask = torch.zeros(grad_loc.shape, dtype=torch.bool)
    point_mask[POINT] = True
    _assert_matches_except(grad_loc.cpu(), expected_loc, point_mask)
    assert torch.all(grad_loc[POINT] == 0)

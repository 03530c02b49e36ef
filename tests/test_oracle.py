"""tests/test_oracle.py: the numpy f64 oracle is itself right.

It is checked against a hand-worked case and against torch's grid_sample (bilinear, zeros
padding, align_corners=False, grid = 2*loc - 1) in f64, forward and, through torch autograd, all
three gradients. The grid_sample composition here is written out in the test, so these checks
depend neither on pymsda nor on pymsda.reference.
"""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import oracle
from factories import make_inputs, oracle_backward, oracle_forward, random_grad_output, rel_l2


def grid_sample_msda(value, spatial_shapes, sampling_locations, attention_weights):
    """MSDA composed from F.grid_sample, one level at a time: (B, Q, H*C)."""
    B, S, H, C = value.shape
    _, Q, _, L, P, _ = sampling_locations.shape
    out = 0
    start = 0
    for level, (h, w) in enumerate(spatial_shapes):
        level_value = value[:, start:start + h * w]  # (B, h*w, H, C)
        start += h * w
        level_value = level_value.permute(0, 2, 3, 1).reshape(B * H, C, h, w)
        grid = 2 * sampling_locations[:, :, :, level] - 1  # (B, Q, H, P, 2)
        grid = grid.permute(0, 2, 1, 3, 4).reshape(B * H, Q, P, 2)
        sampled = F.grid_sample(level_value, grid, mode="bilinear", padding_mode="zeros",
                                align_corners=False)  # (B*H, C, Q, P)
        weights = attention_weights[:, :, :, level].permute(0, 2, 1, 3).reshape(B * H, 1, Q, P)
        out = out + (sampled * weights).sum(-1)  # (B*H, C, Q)
    return out.reshape(B, H, C, Q).permute(0, 3, 1, 2).reshape(B, Q, H * C)


def test_oracle_hand_worked_case():
    # One 2x3 level (H=2, W=3), one head, two channels; value[pixel] = (pixel, 10*pixel).
    value = np.stack([np.arange(6.0), 10 * np.arange(6.0)], -1).reshape(1, 6, 1, 2)
    shapes = [(2, 3)]
    # x = 0.5*3 - 0.5 = 1.0, y = 0.5*2 - 0.5 = 0.5: halfway between pixels 1 and 4.
    # x = 0.0 -> -0.5 reads pixel 0 and an out-of-map neighbour: half of pixel 0 at y = -0.5
    # where the row above is also outside: 0.25 * v[0] = 0.
    # (x, y) = (5/6, 0.75): x = 2, y = 1 -> exactly pixel 5.
    locations = np.array([[0.5, 0.5], [0.0, 0.0], [5 / 6, 0.75]]).reshape(1, 1, 1, 1, 3, 2)
    weights = np.array([1.0, 1.0, 0.5]).reshape(1, 1, 1, 1, 3)
    out = oracle.forward(value, shapes, locations, weights)
    expected = 1.0 * np.array([2.5, 25.0]) + 0.0 + 0.5 * np.array([5.0, 50.0])
    np.testing.assert_allclose(out.reshape(2), expected, rtol=0, atol=1e-12)

    grad_value, grad_locations, grad_weights = oracle.backward(
        value, shapes, locations, weights, np.array([1.0, 0.0]).reshape(1, 1, 2))
    np.testing.assert_allclose(grad_weights.reshape(3), [2.5, 0.0, 5.0], atol=1e-12)
    # First sample: d out_0 / d loc_x = W * (right - left) along the row blend = 3 * 1 = 3,
    # d / d loc_y = H * (pixel 4 - pixel 1) = 2 * 3 = 6.
    np.testing.assert_allclose(grad_locations.reshape(3, 2)[0], [3.0, 6.0], atol=1e-12)
    expected_grad_value = np.zeros(6)
    expected_grad_value[[1, 4]] += 0.5
    expected_grad_value[5] += 0.5
    # Second sample: x = -0.5, y = -0.5: only pixel 0 is in the map, with weight 0.25.
    expected_grad_value[0] += 0.25
    np.testing.assert_allclose(grad_value[0, :, 0, 0], expected_grad_value, atol=1e-12)
    np.testing.assert_allclose(grad_value[0, :, 0, 1], 0.0, atol=1e-12)


@pytest.mark.parametrize("case", [
    dict(batch=2, queries=7, heads=3, channels=5, shapes=[(4, 6), (3, 2), (1, 1)], points=3),
    dict(batch=1, queries=1, heads=1, channels=1, shapes=[(5, 3)], points=1),
    dict(batch=3, queries=4, heads=2, channels=8, shapes=[(7, 9), (2, 5)], points=4),
])
def test_oracle_forward_matches_grid_sample_f64(generator, case):
    inputs = make_inputs(generator, **case, loc_low=-0.3, loc_high=1.3)
    expected = grid_sample_msda(inputs["value"], case["shapes"], inputs["sampling_locations"],
                                inputs["attention_weights"])
    assert rel_l2(oracle_forward(inputs), expected) < 1e-13


@pytest.mark.parametrize("case", [
    dict(batch=2, queries=5, heads=2, channels=3, shapes=[(4, 6), (3, 2), (1, 1)], points=3),
    dict(batch=1, queries=3, heads=1, channels=4, shapes=[(6, 5)], points=2),
])
def test_oracle_gradients_match_grid_sample_autograd_f64(generator, case):
    inputs = make_inputs(generator, **case, kink_free=True)
    grad_output = random_grad_output(
        generator, torch.empty(case["batch"], case["queries"], case["heads"] * case["channels"],
                               dtype=torch.float64))
    leaves = [inputs[k].clone().requires_grad_(True)
              for k in ("value", "sampling_locations", "attention_weights")]
    out = grid_sample_msda(leaves[0], case["shapes"], leaves[1], leaves[2])
    expected = torch.autograd.grad(out, leaves, grad_output)
    actual = oracle_backward(inputs, grad_output)
    for name, a, e in zip(("value", "sampling_locations", "attention_weights"), actual, expected):
        assert np.any(a != 0), f"grad {name} is all zero: the case tests nothing"
        assert rel_l2(a, e) < 1e-12, name

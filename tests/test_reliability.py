"""tests/test_reliability.py: pymsda takes any input and answers with a correct result or a clear
exception, leaving the process and the GPU usable (issue 6).

- More than 2^31 elements in value and in the output (CUDA, half precision; skipped without the
  memory): sampled outputs and gradients against a direct computation.
"""
import numpy as np
import pytest
import torch

import pymsda
from conftest import requires_cuda


# ---- more than 2^31 elements (CUDA, half precision) --------------------------------------------

# value (1, 4100*4100, 2, 64) and output (1, 2^24 + 2^16, 128): each just over 2^31 elements,
# 4.3 GB in float16. One level, one point: each output row is one bilinear sample.
BIG_SIDE, BIG_H, BIG_C, BIG_Q = 4100, 2, 64, 2 ** 24 + 2 ** 16
BIG_S = BIG_SIDE * BIG_SIDE
assert BIG_S * BIG_H * BIG_C > 2 ** 31 and BIG_Q * BIG_H * BIG_C > 2 ** 31


def _free_gpu_bytes():
    torch.cuda.empty_cache()  # what earlier tests left cached counts as free
    free, _ = torch.cuda.mem_get_info()
    return free


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
    x0, y0 = int(np.floor(x)), int(np.floor(y))
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


@requires_cuda
@pytest.mark.huge
def test_int32_overflow_forward_half_over_2_31_elements_cuda():
    if _free_gpu_bytes() < 14 * 2 ** 30:
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


@requires_cuda
@pytest.mark.huge
def test_int32_overflow_backward_half_over_2_31_elements_cuda():
    if _free_gpu_bytes() < 34 * 2 ** 30:
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

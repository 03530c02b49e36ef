"""tests/test_kinks.py: the location gradient where bilinear sampling has a kink, and which side
each implementation takes there (docs/numerics.md: the rule at the kinks).

Bilinear sampling is continuous but only piecewise linear in the location: its slope along x
jumps where the pixel coordinate x = loc_x * W - 0.5 is an integer (likewise y). The rule, in
float64 and independent of the code under test: the one-sided slope of the tests/oracle.py
forward, a difference quotient over 1/64 pixel (exact within a cell, where the sample is
linear along one axis). pymsda's kernels (c/msda.h: the point is sampled when -1 < x < W and
-1 < y < H, the cell is [floor(x), floor(x) + 1]) take the slope toward larger x (y) at every
kink but x = -1 (y = -1), one pixel outside the left (top) edge, where the point counts as
outside and both of its location gradients are 0: the slope from outside. grid_sample (the
pure-PyTorch reference) takes the slope toward larger x (y) everywhere, the inward one at -1,
and so does tests/oracle.py's backward (its floor-based formula has no -1 test; the other
tests keep their locations off the kinks: factories.kink_free_locations).
"""
import numpy as np
import pytest
import torch

import oracle
import pymsda
from conftest import DEVICES
from pymsda.reference import ms_deform_attn_pytorch

# (H, W): powers of two, so loc = (x + 0.5) / W is exact in float32 and x exact in the kernels
SHAPES = [(4, 8), (8, 2)]
STEP = 2.0 ** -6  # pixels
HEADS, CHANNELS = 2, 3


def kink_locations(height, width):
    """(N, 2) pixel coordinates (x, y): both integers from -1 to the side (one pixel outside
    each edge), and one integer with the other between two pixels."""
    points = []
    for x in range(-1, width + 1):
        for y in range(-1, height + 1):
            points += [(x, y), (x, y + 0.375), (x + 0.625, y)]
    return np.array(points, dtype=np.float64)


def kink_problem(height, width, dtype, seed):
    """One level, one point per (query, head): value (1, H*W, HEADS, CHANNELS), locations
    (1, N, HEADS, 1, 1, 2) at the kink_locations (the same for both heads), weights and
    grad_output, as float64 numpy arrays (values representable in dtype)."""
    generator = torch.Generator().manual_seed(seed)

    def rand(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float64).to(dtype).double()
    pixels = kink_locations(height, width)
    loc = (pixels + 0.5) / np.array([width, height], dtype=np.float64)
    loc = np.broadcast_to(loc[None, :, None, None, None, :], (1, len(pixels), HEADS, 1, 1, 2))
    value = rand(1, height * width, HEADS, CHANNELS).numpy()
    attn = rand(1, len(pixels), HEADS, 1, 1).abs().numpy()
    grad_output = rand(1, len(pixels), HEADS * CHANNELS).numpy()
    return pixels, value, np.ascontiguousarray(loc), attn, grad_output


def one_sided_slopes(value, shape, loc, attn, grad_output):
    """(toward larger, toward smaller): d<grad_output, out>/d loc of each point, (1, N, HEADS,
    1, 1, 2), as float64 difference quotients of the oracle's forward over STEP pixels."""
    height, width = shape
    batch, queries = grad_output.shape[:2]

    def objective(shifted):
        out = oracle.forward(value, [shape], shifted, attn) * grad_output
        return out.reshape(batch, queries, HEADS, CHANNELS).sum(-1)[..., None, None]
    slopes = []
    for sign in (1.0, -1.0):
        per_axis = []
        for axis, size in ((0, width), (1, height)):
            step = STEP / size
            shifted = loc.copy()
            shifted[..., axis] += sign * step
            per_axis.append(sign * (objective(shifted) - objective(loc)) / step)
        slopes.append(np.stack(per_axis, -1))
    return slopes


def location_gradient(function, value, shape, loc, attn, grad_output, dtype, device):
    tensors = [torch.from_numpy(a).to(dtype=dtype, device=device)
               for a in (value, loc, attn, grad_output)]
    value_t, loc_t, attn_t, grad_t = tensors
    loc_t.requires_grad_(True)
    function(value_t, loc_t, attn_t).backward(grad_t)
    return loc_t.grad.double().cpu().numpy()


def pymsda_kernels(path, shape):
    """pymsda's op on its tuned kernels ("plain") or on the general ones (per-level point
    counts: a second, 1x1 level with no point)."""
    if path == "plain":
        return lambda value, loc, attn: pymsda.ms_deform_attn(value, [shape], None, loc, attn)

    def general(value, loc, attn):
        extra_row = torch.zeros_like(value[:, :1])
        return pymsda.ms_deform_attn(torch.cat([value, extra_row], 1), [shape, (1, 1)], None,
                                     loc.flatten(3, 4), attn.flatten(3, 4),
                                     num_points_list=[1, 0])
    return general


def assert_close(actual, expected, dtype):
    bound = (1e-12 if dtype == torch.float64 else 1e-5) * np.abs(expected).max()
    assert np.abs(actual - expected).max() <= bound


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("path", ["plain", "general"])
@pytest.mark.parametrize("shape", SHAPES, ids=["4x8", "8x2"])
def test_kernels_take_the_larger_side_at_kinks_and_zero_one_pixel_outside(device, dtype, path,
                                                                         shape):
    pixels, value, loc, attn, grad_output = kink_problem(*shape, dtype, seed=shape[0])
    larger, smaller = one_sided_slopes(value, shape, loc, attn, grad_output)
    got = location_gradient(pymsda_kernels(path, shape), value, shape, loc, attn, grad_output,
                            dtype, device)
    outside = (pixels == -1).any(-1)  # x or y exactly one pixel outside the left / top edge
    assert (got[0, outside] == 0).all()
    expected = np.where((pixels == -1)[None, :, None, None, None, :], smaller, larger)
    assert_close(got, expected, dtype)
    # the sides differ (real kinks) inside the map, and at -1 the inward slope (grid_sample's)
    # is not 0
    scale = np.abs(larger).max()
    inside = ((pixels >= 0) & (pixels == np.round(pixels))).any(-1) & ~outside
    assert np.abs(larger - smaller)[0, inside].max() > 0.1 * scale
    assert np.abs(larger[0, outside]).max() > 0.1 * scale


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", SHAPES, ids=["4x8", "8x2"])
def test_grid_sample_reference_takes_the_larger_side_everywhere(device, shape):
    """pymsda.reference (grid_sample): the slope toward larger x (y) at every kink, the inward
    one one pixel outside the left / top edge included."""
    pixels, value, loc, attn, grad_output = kink_problem(*shape, torch.float64, seed=shape[0])
    larger, _ = one_sided_slopes(value, shape, loc, attn, grad_output)
    got = location_gradient(lambda v, l, a: ms_deform_attn_pytorch(v, [shape], l, a), value,
                            shape, loc, attn, grad_output, torch.float64, device)
    assert_close(got, larger, torch.float64)

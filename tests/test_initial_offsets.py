"""tests/test_initial_offsets.py: Deformable DETR's initial sampling offsets,
pymsda.modules.initial_sampling_offsets, the one computation that MSDeformAttn, mmcv's and
RT-DETRv2's modules and the benchmark's realistic inputs start from: bit for bit Deformable
DETR's own code, and each of the four gives those bits in its own layout of levels and points.
"""
import math

import pytest
import torch

from pymsda.bench import inputs as bench_inputs
from pymsda.compat import mmcv, rtdetr
from pymsda.modules import MSDeformAttn, initial_sampling_offsets
from conftest import DEVICES

# (heads, levels, points): Deformable DETR's default, head counts that are not powers of 2
# (their directions are not on the axes or diagonals), one level, one point
SIZES = [(8, 4, 4), (6, 3, 2), (3, 1, 5), (12, 2, 1), (1, 2, 3)]


def deformable_detr_grid(heads, levels, points, device=None):
    """MSDeformAttn._reset_parameters' bias in Deformable DETR (models/ops/modules/
    ms_deform_attn.py), as written there (mmcv 2.x's adds the device): (heads, levels, points,
    2) in float32."""
    thetas = torch.arange(heads, dtype=torch.float32, device=device) * (2.0 * math.pi / heads)
    grid_init = torch.stack([thetas.cos(), thetas.sin()], -1)
    grid_init = (grid_init / grid_init.abs().max(-1, keepdim=True)[0]).view(
        heads, 1, 1, 2).repeat(1, levels, points, 1)
    for i in range(points):
        grid_init[:, :, i, :] *= i + 1
    return grid_init


@pytest.mark.parametrize("heads, levels, points", SIZES)
def test_initial_offsets_are_deformable_detrs_bits(heads, levels, points):
    offsets = initial_sampling_offsets(heads, [points] * levels)
    assert offsets.shape == (heads, levels * points, 2) and offsets.dtype == torch.float32
    assert torch.equal(offsets.view(heads, levels, points, 2),
                       deformable_detr_grid(heads, levels, points))


@pytest.mark.parametrize("heads, levels, points", SIZES)
def test_initial_offsets_in_float64_are_the_exact_directions(heads, levels, points):
    """Head h: the direction of angle 2*pi*h/heads with its larger component exactly 1 (in
    magnitude), the k-th point of each level k times that."""
    offsets = initial_sampling_offsets(heads, [points] * levels, torch.float64)
    offsets = offsets.view(heads, levels, points, 2)
    for h in range(heads):
        angle = 2 * math.pi * h / heads
        direction = torch.tensor([math.cos(angle), math.sin(angle)], dtype=torch.float64)
        direction = direction / direction.abs().max()
        for k in range(1, points + 1):
            expected = (direction * k).expand(levels, 2)
            torch.testing.assert_close(offsets[h, :, k - 1], expected, rtol=1e-14, atol=1e-15)
        assert torch.all(offsets[h, :, 0].abs().amax(-1) == 1)


@pytest.mark.parametrize("heads, levels, points", SIZES)
def test_every_module_starts_from_the_initial_offsets(heads, levels, points):
    """MSDeformAttn, mmcv's and RT-DETRv2's modules: the same bits in the sampling_offsets
    bias (heads, then levels, then points, then x and y), and a zero weight."""
    expected = initial_sampling_offsets(heads, [points] * levels).flatten()
    layers = [MSDeformAttn(4 * heads, levels, heads, points).sampling_offsets,
              mmcv.MultiScaleDeformableAttention(4 * heads, heads, levels, points).sampling_offsets,
              rtdetr.MSDeformableAttention(4 * heads, heads, levels, points).sampling_offsets]
    for layer in layers:
        assert torch.equal(layer.bias.detach(), expected)
        assert torch.count_nonzero(layer.weight) == 0


def test_rtdetr_v2_levels_of_other_point_counts_start_from_their_own_counts():
    """RT-DETRv2's per-level point counts: level l's points are points 1..n_l of Deformable
    DETR's offsets for n_l points, levels one after the other (a level of 0 points has none)."""
    counts = [2, 0, 3, 1]
    module = rtdetr.MSDeformableAttention(24, 6, len(counts), counts)
    bias = module.sampling_offsets.bias.detach().view(6, sum(counts), 2)
    assert torch.equal(bias, initial_sampling_offsets(6, counts))
    levels = bias.split(counts, dim=1)
    for level, count in zip(levels, counts):
        assert torch.equal(level, initial_sampling_offsets(6, [count]))


@pytest.mark.parametrize("device", DEVICES)
def test_mmcv_module_computes_the_offsets_on_its_device(device):
    """mmcv 2.x computes them on the weights' device; so does pymsda's module."""
    module = mmcv.MultiScaleDeformableAttention(48, 6, 3, 2).to(device)
    module.init_weights()
    expected = deformable_detr_grid(6, 3, 2, device=device).flatten()
    assert module.sampling_offsets.bias.device == expected.device
    assert torch.equal(module.sampling_offsets.bias.detach(), expected)


def test_benchmark_realistic_inputs_start_from_the_initial_offsets():
    """Without noise, the realistic encoder inputs sample at each query's pixel centre plus
    the initial offsets, divided by each level's (W, H)."""
    spec = {"B": 1, "levels": [[6, 8], [3, 4]], "Q": None, "H": 6, "C": 4, "P": 3}
    inputs = bench_inputs.make_inputs(spec, torch.float64, noise=0.0)
    locations = inputs["sampling_locations"]
    centres = bench_inputs.pixel_centres(spec["levels"])[None, :, None, None, None, :]
    sizes = torch.tensor([[w, h] for h, w in spec["levels"]], dtype=torch.float64)
    pixels = (locations - centres) * sizes[:, None, :]
    expected = initial_sampling_offsets(6, [3, 3], torch.float64).view(6, 2, 3, 2)
    torch.testing.assert_close(pixels, expected.expand_as(pixels), rtol=0, atol=1e-12)

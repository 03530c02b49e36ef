"""tests/test_module.py: pymsda.MSDeformAttn, Deformable DETR's module: parameter names, the
initialisation, and a forward that equals a pure-PyTorch recomputation (Deformable DETR's
MSDeformAttn.forward written out here, sampling with pymsda.reference) from the same parameters.
"""
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import pymsda
from pymsda.reference import ms_deform_attn_pytorch
from conftest import DEVICES
from factories import level_start_index_of, random_level_shapes, rel_l2

STATE_KEYS = {
    "sampling_offsets.weight", "sampling_offsets.bias",
    "attention_weights.weight", "attention_weights.bias",
    "value_proj.weight", "value_proj.bias",
    "output_proj.weight", "output_proj.bias",
}


def recompute(module, query, reference_points, input_flatten, shapes, padding_mask=None):
    """Deformable DETR's MSDeformAttn.forward, with the reference sampler."""
    d_model, heads = module.d_model, module.n_heads
    levels, points = module.n_levels, module.n_points
    N, Lq, _ = query.shape
    value = module.value_proj(input_flatten)
    if padding_mask is not None:
        value = value.masked_fill(padding_mask[..., None], 0.0)
    value = value.view(N, -1, heads, d_model // heads)
    offsets = module.sampling_offsets(query).view(N, Lq, heads, levels, points, 2)
    weights = module.attention_weights(query).view(N, Lq, heads, levels * points)
    weights = F.softmax(weights, -1).view(N, Lq, heads, levels, points)
    if reference_points.shape[-1] == 2:
        normalizer = torch.stack([shapes[..., 1], shapes[..., 0]], -1).to(query.dtype)
        locations = (reference_points[:, :, None, :, None, :]
                     + offsets / normalizer[None, None, None, :, None, :])
    else:
        locations = (reference_points[:, :, None, :, None, :2]
                     + offsets / points * reference_points[:, :, None, :, None, 2:] * 0.5)
    out = ms_deform_attn_pytorch(value, shapes, locations, weights)
    return module.output_proj(out)


def randomise_parameters(module, generator):
    # At init sampling offsets and attention logits ignore the query; random parameters make the
    # comparison exercise every projection.
    with torch.no_grad():
        for parameter in module.parameters():
            noise = torch.randn(parameter.shape, generator=generator, dtype=torch.float64)
            parameter.copy_(0.1 * noise)


def make_module_inputs(generator, module, batch, queries, shapes, box, dtype, device):
    total = sum(h * w for h, w in shapes)
    levels = len(shapes)

    def randn(*size):
        return torch.randn(*size, generator=generator, dtype=torch.float64).to(device, dtype)

    def rand(*size):
        return torch.rand(*size, generator=generator, dtype=torch.float64).to(device, dtype)

    query = randn(batch, queries, module.d_model)
    input_flatten = randn(batch, total, module.d_model)
    if box:
        reference_points = torch.cat([rand(batch, queries, levels, 2),
                                      0.05 + 0.5 * rand(batch, queries, levels, 2)], -1)
    else:
        reference_points = rand(batch, queries, levels, 2)
    spatial_shapes = torch.tensor(shapes, dtype=torch.int64, device=device)
    start_index = torch.tensor(level_start_index_of(shapes), dtype=torch.int64, device=device)
    return query, reference_points, input_flatten, spatial_shapes, start_index


# ---- parameters and init -----------------------------------------------------------------------

def test_state_dict_keys_are_deformable_detr_names():
    module = pymsda.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=3)
    assert set(module.state_dict()) == STATE_KEYS
    assert isinstance(module.value_proj, torch.nn.Linear)
    assert module.sampling_offsets.weight.shape == (4 * 2 * 3 * 2, 32)
    assert module.attention_weights.weight.shape == (4 * 2 * 3, 32)
    assert module.value_proj.weight.shape == (32, 32)
    assert module.output_proj.weight.shape == (32, 32)


def test_default_sizes_are_deformable_detr_defaults():
    module = pymsda.MSDeformAttn()
    assert (module.d_model, module.n_levels, module.n_heads, module.n_points) == (256, 4, 8, 4)
    assert module.sampling_offsets.bias.shape == (8 * 4 * 4 * 2,)


@pytest.mark.parametrize("d_model,levels,heads,points", [(256, 4, 8, 4), (64, 3, 4, 2),
                                                         (48, 1, 6, 5)])
def test_init_matches_deformable_detr(d_model, levels, heads, points):
    module = pymsda.MSDeformAttn(d_model=d_model, n_levels=levels, n_heads=heads,
                                 n_points=points)
    # sampling offsets: weight 0, bias = unit direction per head (scaled so its largest
    # component is 1) times (point index + 1), the same for every level.
    assert torch.count_nonzero(module.sampling_offsets.weight) == 0
    expected = np.zeros((heads, levels, points, 2))
    for h in range(heads):
        theta = h * 2 * math.pi / heads
        direction = np.array([math.cos(theta), math.sin(theta)])
        direction /= np.abs(direction).max()
        for p in range(points):
            expected[h, :, p, :] = direction * (p + 1)
    bias = module.sampling_offsets.bias.detach().double().numpy()
    # Deformable DETR computes this in f32 (cos/sin, the division): a few f32 ulps of slack.
    np.testing.assert_allclose(bias, expected.reshape(-1), rtol=0, atol=1e-5)
    # attention weights: all zero, so the softmax starts uniform
    assert torch.count_nonzero(module.attention_weights.weight) == 0
    assert torch.count_nonzero(module.attention_weights.bias) == 0
    # projections: xavier uniform weight, bias 0
    bound = math.sqrt(6.0 / (d_model + d_model))
    for projection in (module.value_proj, module.output_proj):
        weight = projection.weight.detach()
        assert weight.abs().max() <= bound
        assert weight.abs().max() > 0.9 * bound  # uniform over the full range, not e.g. std 0.02
        assert abs(weight.double().std().item() - bound / math.sqrt(3)) < 0.15 * bound
        assert torch.count_nonzero(projection.bias) == 0


def test_d_model_not_divisible_by_heads_raises():
    with pytest.raises(ValueError):
        pymsda.MSDeformAttn(d_model=30, n_levels=2, n_heads=8, n_points=2)


# ---- forward and backward ----------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("box", [False, True], ids=["points2", "boxes4"])
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_module_forward_matches_reference_recomputation(generator, device, box, masked):
    module = pymsda.MSDeformAttn(d_model=32, n_levels=3, n_heads=4, n_points=2).double()
    randomise_parameters(module, generator)
    module.to(device)
    shapes = random_level_shapes(generator, 3, max_side=8, min_side=2)
    query, reference_points, input_flatten, spatial_shapes, start_index = make_module_inputs(
        generator, module, 2, 7, shapes, box, torch.float64, device)
    mask = None
    if masked:
        mask = torch.rand(2, input_flatten.shape[1], generator=generator) < 0.3
        mask = mask.to(device)
    out = module(query, reference_points, input_flatten, spatial_shapes, start_index, mask)
    assert out.shape == query.shape and out.dtype == torch.float64
    expected = recompute(module, query, reference_points, input_flatten, spatial_shapes, mask)
    assert rel_l2(out, expected) < 1e-12
    if masked:  # the mask must matter, or the test above proved nothing about it
        unmasked = module(query, reference_points, input_flatten, spatial_shapes, start_index)
        assert rel_l2(unmasked, out) > 1e-3


@pytest.mark.parametrize("device", DEVICES)
def test_module_forward_f32_at_init(generator, device):
    module = pymsda.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=3).to(device)
    shapes = [(6, 5), (3, 4)]
    inputs = make_module_inputs(generator, module, 2, 5, shapes, False, torch.float32, device)
    out = module(*inputs)
    with torch.no_grad():
        module64 = pymsda.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=3)
        module64.load_state_dict(module.state_dict())
        module64 = module64.double().to(device)
        expected = recompute(module64, *(t.double() if t.is_floating_point() else t
                                         for t in inputs[:4]))
    assert out.dtype == torch.float32
    assert rel_l2(out, expected) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_module_backward_matches_reference_recomputation(generator, device):
    module = pymsda.MSDeformAttn(d_model=16, n_levels=2, n_heads=2, n_points=2).double()
    randomise_parameters(module, generator)
    module.to(device)
    shapes = random_level_shapes(generator, 2, max_side=6, min_side=2)
    query, reference_points, input_flatten, spatial_shapes, start_index = make_module_inputs(
        generator, module, 2, 4, shapes, False, torch.float64, device)
    leaves = [t.clone().requires_grad_(True) for t in (query, reference_points, input_flatten)]
    grad_output = torch.randn(query.shape, generator=generator, dtype=torch.float64).to(device)

    module(leaves[0], leaves[1], leaves[2], spatial_shapes, start_index).backward(grad_output)
    actual = [leaf.grad for leaf in leaves] + [p.grad for p in module.parameters()]
    for leaf in leaves:
        leaf.grad = None
    module.zero_grad(set_to_none=True)
    recompute(module, leaves[0], leaves[1], leaves[2], spatial_shapes).backward(grad_output)
    expected = [leaf.grad for leaf in leaves] + [p.grad for p in module.parameters()]
    names = ["query", "reference_points", "input_flatten"] + [n for n, _ in
                                                              module.named_parameters()]
    for name, a, e in zip(names, actual, expected):
        assert a is not None, name
        # Random locations may sit near a bilinear kink, where rounding picks a side: allow it.
        assert rel_l2(a, e) < 1e-8, name

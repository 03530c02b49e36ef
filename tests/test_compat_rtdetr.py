"""tests/test_compat_rtdetr.py: pymsda.compat.rtdetr, RT-DETR's and RT-DETRv2's functions and
RT-DETRv2's MSDeformableAttention module: call shapes, per-level point counts, "discrete"
sampling, parameters, buffers and checkpoints, the f64 oracle's numbers and RT-DETRv2's own math.
CPU always; CUDA where a GPU is present.
"""
import math

import pytest
import torch

import pymsda
from pymsda.compat import rtdetr
from compat_cases import (SHAPES, F64_BOUND, assert_matches_oracle, gradients, parameter_names,
                          plain_inputs)
from conftest import DEVICES
from factories import (GRAD_NAMES, make_point_inputs, oracle_backward_general,
                       oracle_forward_general, random_grad_output, rel_l2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes_as", ["list", "tensor"])
def test_rtdetr_v1_core_func_matches_oracle(generator, device, shapes_as):
    inputs = plain_inputs(generator, device)
    assert parameter_names(rtdetr.deformable_attention_core_func) == [
        "value", "value_spatial_shapes", "sampling_locations", "attention_weights"]
    shapes = SHAPES if shapes_as == "list" else inputs["spatial_shapes"]
    grad_output = random_grad_output(generator, pymsda.ms_deform_attn(**inputs))
    out, grads = gradients(rtdetr.deformable_attention_core_func, inputs, grad_output, shapes)
    assert out.shape == (2, 6, 8)
    assert_matches_oracle(out, grads, inputs, grad_output)


def v2_inputs(generator, device, num_points_list=(3, 1, 2), shapes=SHAPES, **kw):
    case = dict(batch=2, queries=5, heads=2, channels=4)
    case.update(kw)
    return make_point_inputs(generator, **case, shapes=shapes,
                             num_points_list=list(num_points_list), device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["default", "discrete"])
def test_rtdetr_v2_core_func_matches_oracle(generator, device, method):
    assert parameter_names(rtdetr.deformable_attention_core_func_v2) == [
        "value", "value_spatial_shapes", "sampling_locations", "attention_weights",
        "num_points_list", "method"]
    inputs = v2_inputs(generator, device)
    options = dict(num_points_list=[3, 1, 2], nearest=method == "discrete")
    grad_output = random_grad_output(generator, torch.empty(2, 5, 8, dtype=torch.float64,
                                                            device=device))
    out, grads = gradients(rtdetr.deformable_attention_core_func_v2, inputs, grad_output,
                           SHAPES, num_points_list=[3, 1, 2], method=method)
    assert out.shape == (2, 5, 8) and out.dtype == torch.float64
    assert rel_l2(out, oracle_forward_general(inputs, **options)) < F64_BOUND
    expected = oracle_backward_general(inputs, grad_output, **options)
    for name, e in zip(GRAD_NAMES, expected):
        if name == "sampling_locations" and method == "discrete":
            assert grads[name] is None  # as RT-DETRv2's integer cast: no gradient at all
            continue
        assert rel_l2(grads[name], e) < 1e-11, name


@pytest.mark.parametrize("device", DEVICES)
def test_rtdetr_v2_discrete_matches_rtdetrv2_rule_on_square_levels(generator, device):
    """RT-DETRv2's "discrete" truncates loc*size + 0.5 to an integer and clamps both axes to
    [0, H-1]; on square levels that is exactly our per-axis floor-and-clamp, also for locations
    outside [0, 1]."""
    shapes = [(5, 5), (3, 3)]
    counts = [2, 3]
    B, Q, M, C = 2, 7, 2, 3
    value = torch.randn(B, 34, M, C, generator=generator, dtype=torch.float64).to(device)
    loc = (torch.rand(B, Q, M, 5, 2, generator=generator, dtype=torch.float64) * 1.6 - 0.3
           ).to(device)
    attn = torch.rand(B, Q, M, 5, generator=generator, dtype=torch.float64).to(device)
    out = rtdetr.deformable_attention_core_func_v2(value, shapes, loc, attn, counts,
                                                   method="discrete")
    expected = torch.zeros(B, Q, M, C, dtype=torch.float64, device=device)
    point, start = 0, 0
    for (h, w), count in zip(shapes, counts):
        for _ in range(count):
            pixel = (loc[:, :, :, point] * torch.tensor([w, h], device=device) + 0.5).to(
                torch.int64).clamp(0, h - 1)  # (B, Q, M, 2) as (x, y), both to h - 1
            flat = start + pixel[..., 1] * w + pixel[..., 0]
            rows = torch.stack([value[b, flat[b], torch.arange(M, device=device)[None]]
                                for b in range(B)])  # (B, Q, M, C)
            expected += attn[:, :, :, point, None] * rows
            point += 1
        start += h * w
    torch.testing.assert_close(out, expected.reshape(B, Q, M * C), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
def test_rtdetr_v2_value_as_level_list_equals_tensor(generator, device):
    """D-FINE-style forks pass value as per-level (bs, n_head, c, H*W) tensors."""
    inputs = v2_inputs(generator, device)
    value = inputs["value"]
    levels = value.permute(0, 2, 3, 1).split([h * w for h, w in SHAPES], dim=-1)
    args = (SHAPES, inputs["sampling_locations"], inputs["attention_weights"], [3, 1, 2])
    torch.testing.assert_close(rtdetr.deformable_attention_core_func_v2(list(levels), *args),
                               rtdetr.deformable_attention_core_func_v2(value, *args),
                               rtol=0, atol=0)


def test_rtdetr_v2_bad_method_is_refused(generator):
    inputs = v2_inputs(generator, "cpu")
    with pytest.raises(ValueError, match="method must be 'default' or 'discrete'"):
        rtdetr.deformable_attention_core_func_v2(
            inputs["value"], SHAPES, inputs["sampling_locations"], inputs["attention_weights"],
            [3, 1, 2], method="bicubic")
    with pytest.raises(ValueError, match="num_points_list"):
        rtdetr.deformable_attention_core_func_v2(
            inputs["value"], SHAPES, inputs["sampling_locations"], inputs["attention_weights"],
            [3, 1, 1])


def test_rtdetr_v2_module_parameters_buffers_and_init():
    module = rtdetr.MSDeformableAttention(embed_dim=32, num_heads=4, num_levels=3,
                                          num_points=[2, 1, 3])
    total = 4 * 6
    shapes = {k: tuple(v.shape) for k, v in module.state_dict().items()}
    assert shapes == {
        "num_points_scale": (6,),
        "sampling_offsets.weight": (total * 2, 32), "sampling_offsets.bias": (total * 2,),
        "attention_weights.weight": (total, 32), "attention_weights.bias": (total,),
        "value_proj.weight": (32, 32), "value_proj.bias": (32,),
        "output_proj.weight": (32, 32), "output_proj.bias": (32,)}
    torch.testing.assert_close(module.num_points_scale,
                               torch.tensor([1 / 2, 1 / 2, 1, 1 / 3, 1 / 3, 1 / 3]))
    bias = module.sampling_offsets.bias.view(4, 6, 2)
    # head 1 of 4 looks along +y; the k-th point of its level is k steps out
    torch.testing.assert_close(bias[1, :, 1], torch.tensor([1., 2., 1., 1., 2., 3.]))
    torch.testing.assert_close(bias[1, :, 0], torch.zeros(6), atol=1e-6, rtol=0)
    assert torch.count_nonzero(module.attention_weights.weight) == 0
    frozen = rtdetr.MSDeformableAttention(32, 4, 3, 2, method="discrete")
    assert not any(p.requires_grad for p in frozen.sampling_offsets.parameters())
    assert module.load_state_dict(module.state_dict(), strict=True) is not None


@pytest.mark.parametrize("num_points", [4, [3, 1, 2]])
def test_rtdetr_v2_module_init_every_head(num_points):
    """Every head's initial offsets: weight 0; bias = the head's direction (angle 2*pi*h/heads,
    scaled so its larger component is 1) times k for the k-th point (k = 1, 2, ...) of each
    level; int and list point counts give the same state_dict keys (what the original
    registers), and the helper buffer is not among them."""
    heads, levels, dim = 6, 3, 24
    module = rtdetr.MSDeformableAttention(dim, heads, levels, num_points)
    counts = num_points if isinstance(num_points, list) else [num_points] * levels
    total = sum(counts)
    assert set(module.state_dict()) == {
        "num_points_scale", "sampling_offsets.weight", "sampling_offsets.bias",
        "attention_weights.weight", "attention_weights.bias", "value_proj.weight",
        "value_proj.bias", "output_proj.weight", "output_proj.bias"}
    assert module.num_points_list == counts and module.total_points == heads * total
    torch.testing.assert_close(module.num_points_scale, torch.tensor(
        [1.0 / n for n in counts for _ in range(n)]), rtol=0, atol=0)
    assert torch.count_nonzero(module.sampling_offsets.weight) == 0
    bias = module.sampling_offsets.bias.detach().double().view(heads, total, 2)
    for h in range(heads):
        angle = 2 * math.pi * h / heads
        direction = torch.tensor([math.cos(angle), math.sin(angle)], dtype=torch.float64)
        direction = direction / direction.abs().max()
        steps = [k for n in counts for k in range(1, n + 1)]
        expected = torch.stack([direction * k for k in steps])
        torch.testing.assert_close(bias[h], expected, rtol=0, atol=1e-6)
    assert torch.count_nonzero(module.attention_weights.weight) == 0
    assert torch.count_nonzero(module.attention_weights.bias) == 0
    assert torch.count_nonzero(module.value_proj.bias) == 0
    assert torch.count_nonzero(module.output_proj.bias) == 0


def test_rtdetr_v2_module_loads_rtdetr_v1_checkpoints():
    """RT-DETR (v1)'s MSDeformableAttention: the same parameters (uniform point count), no
    num_points_scale buffer. Its checkpoints load strictly; the buffer keeps 1 / num_points;
    a key that is really missing (a parameter) is still reported."""
    module = rtdetr.MSDeformableAttention(32, 4, 3, 2)
    v1 = {k: torch.randn(v.shape) for k, v in module.state_dict().items()
          if k != "num_points_scale"}
    module.load_state_dict(v1, strict=True)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in v1.items())
    torch.testing.assert_close(module.num_points_scale, torch.full((6,), 0.5))
    wrapped = torch.nn.ModuleDict({"cross_attn": rtdetr.MSDeformableAttention(32, 4, 3, 2)})
    wrapped.load_state_dict({"cross_attn." + k: v for k, v in v1.items()}, strict=True)
    incomplete = dict(v1)
    del incomplete["value_proj.bias"]
    with pytest.raises(RuntimeError, match="value_proj.bias"):
        module.load_state_dict(incomplete, strict=True)
    scaled = dict(v1, num_points_scale=torch.full((6,), 0.25))  # a v2 checkpoint's own buffer
    module.load_state_dict(scaled, strict=True)
    torch.testing.assert_close(module.num_points_scale, torch.full((6,), 0.25))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reference", ["boxes", "points_per_level"])
def test_rtdetr_v2_module_sampling_locations_follow_rtdetrv2(generator, device, reference):
    """The module's forward == RT-DETRv2's math written out here in f64 on the pure-PyTorch
    core. Boxes (bs, Lq, 1, 4): loc = (cx, cy) + offset * num_points_scale * (w, h) *
    offset_scale, num_points_scale = 1 / n_l (n_l the point count of the point's level).
    Points (bs, Lq, n_levels, 2): loc = ref_l + offset / (W_l, H_l). value_mask (True = keep)
    zeroes the projected value."""
    counts, heads, dim = [2, 3, 1], 2, 8
    module = rtdetr.MSDeformableAttention(dim, heads, 3, counts, offset_scale=0.7)
    module = module.double().to(device)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype).to(device))
    bs, Lq, S, total = 2, 4, sum(h * w for h, w in SHAPES), sum(counts)
    query = torch.randn(bs, Lq, dim, generator=generator, dtype=torch.float64).to(device)
    memory = torch.randn(bs, S, dim, generator=generator, dtype=torch.float64).to(device)
    mask = (torch.rand(bs, S, generator=generator) > 0.3).to(device)
    if reference == "boxes":
        ref = torch.rand(bs, Lq, 1, 4, generator=generator, dtype=torch.float64).to(device)
    else:
        ref = torch.rand(bs, Lq, 3, 2, generator=generator, dtype=torch.float64).to(device)
    out = module(query, ref, memory, SHAPES, mask)

    value = module.value_proj(memory) * mask[..., None].double()
    value = value.view(bs, S, heads, dim // heads)
    offsets = module.sampling_offsets(query).view(bs, Lq, heads, total, 2)
    weights = module.attention_weights(query).view(bs, Lq, heads, total).softmax(-1)
    level = [l for l, n in enumerate(counts) for _ in range(n)]
    loc = torch.empty_like(offsets)
    for point, l in enumerate(level):
        if reference == "boxes":
            # num_points_scale holds 1 / n_l in float32, as the original's buffer does
            loc[:, :, :, point] = (ref[:, :, None, 0, :2] + offsets[:, :, :, point]
                                   * module.num_points_scale[point] * ref[:, :, None, 0, 2:]
                                   * 0.7)
        else:
            h, w = SHAPES[l]
            size = torch.tensor([w, h], dtype=torch.float64, device=device)
            loc[:, :, :, point] = ref[:, :, None, l] + offsets[:, :, :, point] / size
    expected = module.output_proj(pymsda.reference.ms_deform_attn_pytorch(
        value, SHAPES, loc, weights, num_points_list=counts))
    assert out.shape == (bs, Lq, dim) and out.dtype == torch.float64
    torch.testing.assert_close(out, expected, rtol=1e-11, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["default", "discrete"])
@pytest.mark.parametrize("reference_dim", [2, 4])
def test_rtdetr_v2_module_matches_pure_pytorch_core(generator, device, method, reference_dim):
    """The module on pymsda == the same module with its core swapped for the pure-PyTorch
    reference, forward and parameter gradients, f64."""
    torch.manual_seed(1)
    module = rtdetr.MSDeformableAttention(16, 2, 3, [2, 0, 3], method=method).double()
    module = module.to(device)
    with torch.no_grad():
        for p in module.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=generator, dtype=p.dtype).to(device))
    S = sum(h * w for h, w in SHAPES)
    query = torch.randn(2, 4, 16, generator=generator, dtype=torch.float64).to(device)
    value = torch.randn(2, S, 16, generator=generator, dtype=torch.float64).to(device)
    levels = 1 if reference_dim == 4 else 3
    ref = torch.rand(2, 4, levels, reference_dim, generator=generator,
                     dtype=torch.float64).to(device)
    mask = torch.rand(2, S, generator=generator).to(device) > 0.2

    def run(core):
        module.zero_grad()
        if core is not None:
            module.ms_deformable_attn_core = core
        out = module(query, ref, value, SHAPES, mask)
        out.square().sum().backward()
        return out, {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad}

    out, grads = run(None)
    sampling = "nearest" if method == "discrete" else "bilinear"
    expected, expected_grads = run(
        lambda v, s, loc, attn, counts: pymsda.reference.ms_deform_attn_pytorch(
            v, s, loc, attn, num_points_list=counts, sampling=sampling))
    assert out.shape == (2, 4, 16)
    torch.testing.assert_close(out, expected, rtol=1e-11, atol=1e-12)
    for name in grads:
        torch.testing.assert_close(grads[name], expected_grads[name], rtol=1e-9, atol=1e-11)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("method", ["default", "discrete"])
def test_rtdetr_v2_output_shape_and_dtype(generator, device, dtype, method):
    """(bs, query_length, n_head * c) in value's dtype, from either value layout, equal to
    pymsda.ms_deform_attn with the same options."""
    inputs = v2_inputs(generator, device)
    value = inputs["value"].to(dtype)
    loc, attn = inputs["sampling_locations"].to(dtype), inputs["attention_weights"].to(dtype)
    expected = pymsda.ms_deform_attn(value, SHAPES, None, loc, attn, num_points_list=[3, 1, 2],
                                     sampling="nearest" if method == "discrete" else "bilinear")
    levels = list(value.permute(0, 2, 3, 1).split([h * w for h, w in SHAPES], dim=-1))
    for v in (value, levels):
        out = rtdetr.deformable_attention_core_func_v2(v, SHAPES, loc, attn, [3, 1, 2],
                                                       method=method)
        assert out.shape == (2, 5, 8) and out.dtype == dtype
        assert torch.equal(out, expected)

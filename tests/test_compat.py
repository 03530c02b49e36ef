"""tests/test_compat.py: the drop-in modules of pymsda.compat keep the call shapes, argument
names, output shapes and dtypes, gradients and parameter names of the projects they mirror, and
compute the f64 oracle's numbers (tests/oracle.py). CPU always; CUDA where a GPU is present.
"""
import importlib
import inspect
import sys

import pytest
import torch

import pymsda
import pymsda.compat
from pymsda.compat import deformable_detr, mmcv, paddle, rtdetr, transformers
from conftest import DEVICES
from factories import (GRAD_NAMES, level_start_index_of, make_inputs, make_point_inputs,
                       oracle_backward, oracle_backward_general, oracle_forward,
                       oracle_forward_general, random_grad_output, rel_l2)

SHAPES = [(6, 5), (3, 4), (2, 2)]
F64_BOUND = 1e-12


def plain_inputs(generator, device, dtype=torch.float64, **overrides):
    case = dict(batch=2, queries=6, heads=2, channels=4, shapes=SHAPES, points=3)
    case.update(overrides)
    return make_inputs(generator, **case, dtype=dtype, device=device, kink_free=True)


def gradients(function, inputs, grad_output, *args_before, **kwargs):
    """Gradients of function(value, *args_before, sampling_locations, attention_weights,
    **kwargs) -> dict by name; args_before sit between value and the locations."""
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES}
    out = function(leaves["value"], *args_before, leaves["sampling_locations"],
                   leaves["attention_weights"], **kwargs)
    out.backward(grad_output)
    return out, {k: leaves[k].grad for k in GRAD_NAMES}


def assert_matches_oracle(out, grads, inputs, grad_output, expected_grads=None):
    assert rel_l2(out, oracle_forward(inputs)) < F64_BOUND
    expected_grads = expected_grads or oracle_backward(inputs, grad_output)
    for name, expected in zip(GRAD_NAMES, expected_grads):
        assert grads[name].shape == inputs[name].shape, name
        assert rel_l2(grads[name], expected) < 1e-11, name


def parameter_names(function):
    return list(inspect.signature(function).parameters)


# ---- Deformable DETR ---------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_deformable_detr_function_apply_matches_oracle(generator, device):
    inputs = plain_inputs(generator, device)
    grad_output = random_grad_output(generator, pymsda.ms_deform_attn(**{
        k: inputs[k] for k in inputs}))
    im2col_step = 64
    out, grads = gradients(
        lambda v, s, i, loc, attn: deformable_detr.MSDeformAttnFunction.apply(
            v, s, i, loc, attn, im2col_step),
        inputs, grad_output, inputs["spatial_shapes"], inputs["level_start_index"])
    assert out.shape == (2, 6, 2 * 4) and out.dtype == torch.float64
    assert_matches_oracle(out, grads, inputs, grad_output)


@pytest.mark.parametrize("device", DEVICES)
def test_deformable_detr_core_pytorch_matches_oracle(generator, device):
    inputs = plain_inputs(generator, device)
    assert parameter_names(deformable_detr.ms_deform_attn_core_pytorch) == [
        "value", "value_spatial_shapes", "sampling_locations", "attention_weights"]
    out = deformable_detr.ms_deform_attn_core_pytorch(
        inputs["value"], inputs["spatial_shapes"], inputs["sampling_locations"],
        inputs["attention_weights"])
    assert out.shape == (2, 6, 8)
    assert rel_l2(out, oracle_forward(inputs)) < F64_BOUND


def test_deformable_detr_module_keeps_parameter_names_and_loads_a_checkpoint():
    d_model, n_levels, n_heads, n_points = 64, 3, 4, 2
    module = deformable_detr.MSDeformAttn(d_model, n_levels, n_heads, n_points)
    expected = {
        "sampling_offsets.weight": (n_heads * n_levels * n_points * 2, d_model),
        "sampling_offsets.bias": (n_heads * n_levels * n_points * 2,),
        "attention_weights.weight": (n_heads * n_levels * n_points, d_model),
        "attention_weights.bias": (n_heads * n_levels * n_points,),
        "value_proj.weight": (d_model, d_model), "value_proj.bias": (d_model,),
        "output_proj.weight": (d_model, d_model), "output_proj.bias": (d_model,),
    }
    state = module.state_dict()
    assert {k: tuple(v.shape) for k, v in state.items()} == expected
    checkpoint = {k: torch.randn(shape) for k, shape in expected.items()}
    module.load_state_dict(checkpoint, strict=True)
    assert all(torch.equal(module.state_dict()[k], v) for k, v in checkpoint.items())


@pytest.mark.parametrize("device", DEVICES)
def test_deformable_detr_module_runs_pymsda_and_matches_core_pytorch(generator, device):
    """MSDeformAttn's forward == the same math with ms_deform_attn_core_pytorch, f64."""
    torch.manual_seed(0)
    module = deformable_detr.MSDeformAttn(16, 3, 2, 2).double().to(device)
    with torch.no_grad():  # off the symmetric init, so every point samples somewhere else
        for p in module.parameters():
            p.add_(0.1 * torch.randn(p.shape, generator=generator, dtype=p.dtype).to(device))
    N, Lq, S = 2, 5, sum(h * w for h, w in SHAPES)
    query = torch.randn(N, Lq, 16, dtype=torch.float64, device=device)
    flat = torch.randn(N, S, 16, dtype=torch.float64, device=device)
    ref = torch.rand(N, Lq, 3, 2, dtype=torch.float64, device=device)
    shapes = torch.tensor(SHAPES, device=device)
    starts = torch.tensor(level_start_index_of(SHAPES), device=device)
    out = module(query, ref, flat, shapes, starts)
    assert out.shape == (N, Lq, 16)

    value = module.value_proj(flat).view(N, S, 2, 8)
    offsets = module.sampling_offsets(query).view(N, Lq, 2, 3, 2, 2)
    weights = module.attention_weights(query).view(N, Lq, 2, 6).softmax(-1).view(N, Lq, 2, 3, 2)
    normalizer = torch.stack([shapes[:, 1], shapes[:, 0]], -1).double()
    loc = ref[:, :, None, :, None, :] + offsets / normalizer[None, None, None, :, None, :]
    expected = module.output_proj(
        deformable_detr.ms_deform_attn_core_pytorch(value, shapes, loc, weights))
    torch.testing.assert_close(out, expected, rtol=1e-12, atol=1e-12)


class _ExtensionFunction(torch.autograd.Function):
    """What Deformable DETR's functions/ms_deform_attn_func.py does with the compiled extension
    (written here from its behaviour): forward and backward straight into MSDA."""

    @staticmethod
    def forward(ctx, value, shapes, starts, loc, attn, im2col_step):
        import MultiScaleDeformableAttention as MSDA
        ctx.im2col_step = im2col_step
        ctx.save_for_backward(value, shapes, starts, loc, attn)
        return MSDA.ms_deform_attn_forward(value, shapes, starts, loc, attn, im2col_step)

    @staticmethod
    def backward(ctx, grad_output):
        import MultiScaleDeformableAttention as MSDA
        value, shapes, starts, loc, attn = ctx.saved_tensors
        grad_value, grad_loc, grad_attn = MSDA.ms_deform_attn_backward(
            value, shapes, starts, loc, attn, grad_output, ctx.im2col_step)
        return grad_value, None, None, grad_loc, grad_attn, None


@pytest.fixture
def installed_extension(monkeypatch):
    monkeypatch.delitem(sys.modules, "MultiScaleDeformableAttention", raising=False)
    module = pymsda.compat.install()
    yield module
    monkeypatch.delitem(sys.modules, "MultiScaleDeformableAttention", raising=False)


@pytest.mark.parametrize("device", DEVICES)
def test_install_serves_import_multiscaledeformableattention(generator, device,
                                                             installed_extension):
    MSDA = importlib.import_module("MultiScaleDeformableAttention")
    assert MSDA is installed_extension
    inputs = plain_inputs(generator, device)
    args = [inputs[k] for k in ("value", "spatial_shapes", "level_start_index",
                                "sampling_locations", "attention_weights")]
    out = MSDA.ms_deform_attn_forward(*args, 64)
    assert out.shape == (2, 6, 8) and out.grad_fn is None
    assert rel_l2(out, oracle_forward(inputs)) < F64_BOUND
    grad_output = random_grad_output(generator, out)
    grads = MSDA.ms_deform_attn_backward(*args, grad_output, 64)
    assert isinstance(grads, list) and len(grads) == 3
    for g, expected, name in zip(grads, oracle_backward(inputs, grad_output), GRAD_NAMES):
        assert g.shape == inputs[name].shape and g.dtype == torch.float64
        assert rel_l2(g, expected) < 1e-11, name


@pytest.mark.parametrize("device", DEVICES)
def test_install_unmodified_extension_function_gradcheck(generator, device, installed_extension):
    inputs = plain_inputs(generator, device, batch=1, queries=2, channels=3, points=2,
                          shapes=[(3, 4), (2, 2)])
    leaves = tuple(inputs[k].clone().requires_grad_(True) for k in GRAD_NAMES)

    def function(value, loc, attn):
        return _ExtensionFunction.apply(value, inputs["spatial_shapes"],
                                        inputs["level_start_index"], loc, attn, 64)

    assert torch.autograd.gradcheck(function, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


# ---- mmcv -------------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_mmcv_function_apply_matches_oracle(generator, device):
    inputs = plain_inputs(generator, device)
    grad_output = random_grad_output(generator, pymsda.ms_deform_attn(**inputs))
    out, grads = gradients(
        lambda v, s, i, loc, attn: mmcv.MultiScaleDeformableAttnFunction.apply(
            v, s, i, loc, attn, 64),
        inputs, grad_output, inputs["spatial_shapes"], inputs["level_start_index"])
    assert_matches_oracle(out, grads, inputs, grad_output)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("value_dtype", [torch.float32, torch.float16])
def test_mmcv_locations_and_weights_follow_value_dtype(generator, device, value_dtype):
    """mmcv casts sampling_locations and attention_weights to value's dtype (AMP): the output
    and the value gradient have value's dtype, the others keep their own."""
    inputs = plain_inputs(generator, device)
    value = inputs["value"].to(value_dtype).requires_grad_(True)
    loc = inputs["sampling_locations"].float().requires_grad_(True)
    attn = inputs["attention_weights"].float().requires_grad_(True)
    out = mmcv.MultiScaleDeformableAttnFunction.apply(
        value, inputs["spatial_shapes"], inputs["level_start_index"], loc, attn, 64)
    assert out.dtype == value_dtype and out.shape == (2, 6, 8)
    expected = mmcv.MultiScaleDeformableAttnFunction.apply(
        value.detach(), inputs["spatial_shapes"], inputs["level_start_index"],
        loc.detach().to(value_dtype), attn.detach().to(value_dtype), 64)
    assert torch.equal(out, expected)
    out.float().sum().backward()
    assert value.grad.dtype == value_dtype and loc.grad.dtype == torch.float32
    assert attn.grad.dtype == torch.float32


@pytest.mark.parametrize("device", DEVICES)
def test_mmcv_pytorch_function_matches_oracle(generator, device):
    inputs = plain_inputs(generator, device)
    assert parameter_names(mmcv.multi_scale_deformable_attn_pytorch) == [
        "value", "value_spatial_shapes", "sampling_locations", "attention_weights"]
    grad_output = random_grad_output(generator, pymsda.ms_deform_attn(**inputs))
    out, grads = gradients(mmcv.multi_scale_deformable_attn_pytorch, inputs, grad_output,
                           inputs["spatial_shapes"])
    assert_matches_oracle(out, grads, inputs, grad_output)


# ---- HF transformers --------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_transformers_kernel_layer_matches_oracle(generator, device):
    layer = transformers.MultiScaleDeformableAttention()
    assert list(layer.parameters()) == [] and list(layer.buffers()) == []
    assert parameter_names(layer.forward) == [
        "value", "value_spatial_shapes", "value_spatial_shapes_list", "level_start_index",
        "sampling_locations", "attention_weights", "im2col_step"]
    inputs = plain_inputs(generator, device)
    grad_output = random_grad_output(generator, pymsda.ms_deform_attn(**inputs))
    out, grads = gradients(layer, inputs, grad_output, inputs["spatial_shapes"], SHAPES,
                           inputs["level_start_index"], im2col_step=64)
    assert_matches_oracle(out, grads, inputs, grad_output)


@pytest.mark.parametrize("device", DEVICES)
def test_transformers_function_matches_oracle(generator, device):
    inputs = plain_inputs(generator, device)
    out = transformers.MultiScaleDeformableAttentionFunction.apply(
        inputs["value"], inputs["spatial_shapes"], inputs["level_start_index"],
        inputs["sampling_locations"], inputs["attention_weights"], 64)
    assert rel_l2(out, oracle_forward(inputs)) < F64_BOUND


# ---- RT-DETR and RT-DETRv2 --------------------------------------------------------------------

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
            assert torch.count_nonzero(grads[name]) == 0
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


# ---- Paddle -----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_paddle_ms_deformable_attn_matches_oracle(generator, device):
    assert parameter_names(paddle.ms_deformable_attn) == [
        "value", "spatial_shapes", "level_start_index", "sampling_locations",
        "attention_weights"]
    inputs = plain_inputs(generator, device)
    grad_output = random_grad_output(generator, pymsda.ms_deform_attn(**inputs))
    out, grads = gradients(paddle.ms_deformable_attn, inputs, grad_output,
                           inputs["spatial_shapes"], inputs["level_start_index"])
    assert out.shape == (2, 6, 8)
    assert_matches_oracle(out, grads, inputs, grad_output)


# ---- dtypes through every compat entry point ----------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_compat_outputs_keep_value_dtype(generator, device, dtype):
    inputs = plain_inputs(generator, device, dtype=dtype)
    args = (inputs["value"], inputs["spatial_shapes"], inputs["level_start_index"],
            inputs["sampling_locations"], inputs["attention_weights"])
    expected = pymsda.ms_deform_attn(*args)
    for out in (deformable_detr.MSDeformAttnFunction.apply(*args, 64),
                mmcv.MultiScaleDeformableAttnFunction.apply(*args, 64),
                transformers.MultiScaleDeformableAttention()(args[0], args[1], SHAPES, *args[2:],
                                                             64),
                paddle.ms_deformable_attn(*args),
                rtdetr.deformable_attention_core_func(args[0], SHAPES, *args[3:])):
        assert out.dtype == dtype and torch.equal(out, expected)

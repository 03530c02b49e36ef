"""tests/test_compat.py: the drop-in modules of pymsda.compat keep the call shapes, argument
names, output shapes and dtypes, gradients and parameter names of the projects they mirror, and
compute the f64 oracle's numbers (tests/oracle.py). CPU always; CUDA where a GPU is present.
"""
import importlib
import inspect
import math
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
    assert pymsda.compat.install() == ["sys.modules['MultiScaleDeformableAttention']"]
    module = sys.modules["MultiScaleDeformableAttention"]
    yield module
    pymsda.compat.uninstall()
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["kernel", "recompute"])
def test_install_backward_matches_pymsda_autograd(generator, device, dtype, path,
                                                 installed_extension, monkeypatch):
    """MSDA.ms_deform_attn_backward == pymsda's autograd gradients, bitwise, for every dtype,
    through the backward kernel directly and through the recompute fallback (older torch, a
    list of shapes, a device the library has no kernels for); each gradient has its input's
    shape and dtype and records no graph, even for inputs that require grad. On CUDA the
    value gradient is summed with float atomics, whose order varies between runs: there it
    agrees to rounding instead."""
    if path == "recompute":
        # patched on the module behind the alias: the alias holds no attributes of its own
        monkeypatch.setattr(pymsda.compat.extension, "_kernel_backward_serves", lambda *a: False)
    inputs = plain_inputs(generator, device, dtype=dtype)
    args = [inputs[k] for k in ("value", "spatial_shapes", "level_start_index",
                                "sampling_locations", "attention_weights")]
    grad_output = random_grad_output(generator, pymsda.ms_deform_attn(*args))
    out, expected = gradients(pymsda.ms_deform_attn, inputs, grad_output,
                              inputs["spatial_shapes"], inputs["level_start_index"])
    leaves = [t.clone().requires_grad_(True) if t.is_floating_point() else t for t in args]
    forward = installed_extension.ms_deform_attn_forward(*leaves, 64)
    assert torch.equal(forward, out.detach()) and forward.grad_fn is None
    grads = installed_extension.ms_deform_attn_backward(*leaves, grad_output, 64)
    assert isinstance(grads, list) and len(grads) == 3
    for grad, name in zip(grads, GRAD_NAMES):
        assert grad.dtype == dtype and grad.shape == inputs[name].shape, name
        assert not grad.requires_grad, name
        if device == "cuda" and name == "value":
            bound = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 4e-3)
            assert rel_l2(grad, expected[name]) < bound, name
        else:
            assert torch.equal(grad, expected[name]), name


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
def test_mmcv_follows_the_dtype_rule(generator, device, value_dtype):
    """mmcv casts sampling_locations and attention_weights to value's dtype (AMP); the drop-in
    follows ms_deform_attn's rule instead (float32 points read as float32), with mmcv's output
    and gradient dtypes: value's for the output and its gradient, their own for the others."""
    inputs = plain_inputs(generator, device)
    value = inputs["value"].to(value_dtype).requires_grad_(True)
    loc = inputs["sampling_locations"].float().requires_grad_(True)
    attn = inputs["attention_weights"].float().requires_grad_(True)
    out = mmcv.MultiScaleDeformableAttnFunction.apply(
        value, inputs["spatial_shapes"], inputs["level_start_index"], loc, attn, 64)
    assert out.dtype == value_dtype and out.shape == (2, 6, 8)
    expected = pymsda.ms_deform_attn(value.detach(), inputs["spatial_shapes"],
                                     inputs["level_start_index"], loc.detach(), attn.detach())
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


def _kernel_layer_forward(self, value, value_spatial_shapes, value_spatial_shapes_list,
                          level_start_index, sampling_locations, attention_weights, im2col_step):
    return pymsda.reference.ms_deform_attn_pytorch(value, value_spatial_shapes_list,
                                                   sampling_locations, attention_weights)


def _wrapped_forward(self, *args, **kwargs):
    raise AssertionError("a layer outside transformers with a wrapped forward is kept")


def _layer_class(forward):
    """A class named like transformers' kernel layer (no weights) with the given forward."""
    return type("MultiScaleDeformableAttention", (torch.nn.Module,), {"forward": forward})


class _WeightedNamesake(torch.nn.Module):
    """Like mmcv's module of the same name: weights and another forward. Never replaced."""

    def __init__(self):
        super().__init__()
        self.value_proj = torch.nn.Linear(4, 4)

    def forward(self, query, key=None, value=None):
        return query


_WeightedNamesake.__name__ = "MultiScaleDeformableAttention"


@pytest.mark.parametrize("device", DEVICES)
def test_transformers_replace_kernel_layers(generator, device):
    HFLayer = _layer_class(_kernel_layer_forward)  # the pure-PyTorch kernel layer's stand-in
    Wrapped = _layer_class(_wrapped_forward)  # (*args, **kwargs), not from transformers

    class Attention(torch.nn.Module):  # the shape of DeformableDetrMultiscaleDeformableAttention
        def __init__(self):
            super().__init__()
            self.attn = HFLayer()
            self.output_proj = torch.nn.Linear(8, 8)

    model = torch.nn.ModuleDict({
        "encoder": torch.nn.ModuleList([Attention(), Attention()]),
        "decoder": Attention(), "other": Wrapped(), "mmcv_like": _WeightedNamesake()}).eval()
    state = {k: v.clone() for k, v in model.state_dict().items()}
    inputs = plain_inputs(generator, device)
    args = (inputs["value"], inputs["spatial_shapes"], SHAPES, inputs["level_start_index"],
            inputs["sampling_locations"], inputs["attention_weights"], 64)
    before = model["decoder"].attn(*args)

    assert transformers.replace_kernel_layers(model) == 3
    for layer in (model["encoder"][0].attn, model["encoder"][1].attn, model["decoder"].attn):
        assert type(layer) is transformers.MultiScaleDeformableAttention and not layer.training
    assert type(model["other"]) is Wrapped and type(model["mmcv_like"]) is _WeightedNamesake
    assert model.state_dict().keys() == state.keys()
    assert all(torch.equal(v, state[k]) for k, v in model.state_dict().items())
    after = model["decoder"].attn(*args)
    assert after.shape == before.shape and after.dtype == before.dtype
    assert rel_l2(after, before) < F64_BOUND
    with pytest.warns(UserWarning, match="nothing was replaced"):
        assert transformers.replace_kernel_layers(model) == 0  # already pymsda's


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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shapes_as", ["list", "tensor"])
def test_paddle_core_func_fallback_name_matches_oracle(generator, device, shapes_as):
    """PaddleDetection's fallback takes value_level_start_index as its third argument."""
    assert parameter_names(paddle.deformable_attention_core_func) == [
        "value", "value_spatial_shapes", "value_level_start_index", "sampling_locations",
        "attention_weights"]
    inputs = plain_inputs(generator, device)
    shapes = SHAPES if shapes_as == "list" else inputs["spatial_shapes"]
    grad_output = random_grad_output(generator, pymsda.ms_deform_attn(**inputs))
    out, grads = gradients(paddle.deformable_attention_core_func, inputs, grad_output,
                           shapes, inputs["level_start_index"])
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
                paddle.deformable_attention_core_func(*args),
                rtdetr.deformable_attention_core_func(args[0], SHAPES, *args[3:])):
        assert out.dtype == dtype and torch.equal(out, expected)


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


def test_compat_entry_points_are_exported():
    """Each module's __all__ names what it defines, and the originals' names are all there."""
    expected = {
        deformable_detr: {"MSDeformAttnFunction", "ms_deform_attn_core_pytorch", "MSDeformAttn"},
        mmcv: {"MultiScaleDeformableAttnFunction", "multi_scale_deformable_attn_pytorch",
               "MultiScaleDeformableAttention", "install", "uninstall"},
        transformers: {"MultiScaleDeformableAttention", "MultiScaleDeformableAttentionFunction",
                       "replace_kernel_layers", "restore_kernel_layers", "install", "uninstall"},
        rtdetr: {"deformable_attention_core_func", "deformable_attention_core_func_v2",
                 "MSDeformableAttention"},
        paddle: {"ms_deformable_attn", "deformable_attention_core_func"},
    }
    for module, names in expected.items():
        assert set(module.__all__) == names, module.__name__
        assert all(callable(getattr(module, name)) for name in names), module.__name__
    extension = importlib.import_module("pymsda.compat.extension")
    assert set(extension.__all__) == {"ms_deform_attn_forward", "ms_deform_attn_backward"}
    assert parameter_names(extension.ms_deform_attn_forward) == [
        "value", "value_spatial_shapes", "value_level_start_index", "sampling_locations",
        "attention_weights", "im2col_step"]
    assert parameter_names(extension.ms_deform_attn_backward) == [
        "value", "value_spatial_shapes", "value_level_start_index", "sampling_locations",
        "attention_weights", "grad_output", "im2col_step"]

"""tests/test_compat_deformable_detr.py: pymsda.compat.deformable_detr, Deformable DETR's
MSDeformAttnFunction, ms_deform_attn_core_pytorch and MSDeformAttn: call shapes, parameter names
and checkpoints, and the f64 oracle's numbers. CPU always; CUDA where a GPU is present.
"""
import pytest
import torch

import pymsda
from pymsda.compat import deformable_detr
from compat_cases import (SHAPES, F64_BOUND, assert_matches_oracle, gradients, parameter_names,
                          plain_inputs)
from conftest import DEVICES
from factories import level_start_index_of, oracle_forward, random_grad_output, rel_l2


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

"""tests/test_compat_mmcv.py: pymsda.compat.mmcv's functions: mmcv's call shapes, the dtype
rule, and the f64 oracle's numbers. (Its module in mmengine, against the installed mmcv-lite:
tests/test_clients_mmcv.py.) CPU always; CUDA where a GPU is present.
"""
import pytest
import torch

import pymsda
from pymsda.compat import mmcv
from compat_cases import assert_matches_oracle, gradients, parameter_names, plain_inputs
from conftest import DEVICES
from factories import random_grad_output


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

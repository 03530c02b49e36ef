"""tests/test_compat_paddle.py: pymsda.compat.paddle, the Paddle RT-DETR ext_op's
ms_deformable_attn and its fallback's name: call shapes and the f64 oracle's numbers. CPU always;
CUDA where a GPU is present.
"""
import pytest

import pymsda
from pymsda.compat import paddle
from compat_cases import SHAPES, assert_matches_oracle, gradients, parameter_names, plain_inputs
from conftest import DEVICES
from factories import random_grad_output


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

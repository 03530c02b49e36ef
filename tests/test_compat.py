"""tests/test_compat.py: the package pymsda.compat: every drop-in's entry points keep value's
dtype and are exported under the originals' names. (Each drop-in: tests/test_compat_<name>.py;
the switches: tests/test_compat_switches.py.) CPU always; CUDA where a GPU is present.
"""
import importlib

import pytest
import torch

import pymsda
from pymsda.compat import deformable_detr, mmcv, paddle, rtdetr, transformers
from compat_cases import SHAPES, parameter_names, plain_inputs
from conftest import DEVICES


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

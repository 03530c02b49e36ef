"""tests/test_compat_transformers.py: pymsda.compat.transformers' kernel layer and function, and
replace_kernel_layers on a model of stand-in layers: the kernel layer's call shape, the f64
oracle's numbers, which layers are replaced. (install() against stand-ins:
tests/test_compat_switches.py; against the installed transformers: tests/test_clients.py.) CPU
always; CUDA where a GPU is present.
"""
import pytest
import torch

import pymsda
from pymsda.compat import transformers
from compat_cases import (SHAPES, F64_BOUND, assert_matches_oracle, gradients, parameter_names,
                          plain_inputs)
from conftest import DEVICES
from factories import oracle_forward, random_grad_output, rel_l2


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

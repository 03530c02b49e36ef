"""tests/test_unusual_tensors.py: tensors the op takes though its kernels never see them as given:
meta tensors (shapes only) give meta outputs and gradients, an empty batch or query set gives
empty outputs and written (zero) gradients, and storage misaligned for its dtype is copied, not
refused.
"""
import pytest
import torch

import pymsda
from conftest import DEVICES
from factories import (GRAD_NAMES, SMALL_SHAPES as SHAPES, SMALL_SIZES, make_inputs,
                       oracle_forward, rel_l2, run_msda, small_inputs)

S = 26
B, Q, H, C, L, P = SMALL_SIZES


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape_tables", ["list", "cpu", "meta"])
def test_meta_tensors_give_meta_outputs_and_gradients(dtype, shape_tables):
    value = torch.empty(B, S, H, C, device="meta", dtype=dtype, requires_grad=True)
    locations = torch.empty(B, Q, H, L, P, 2, device="meta", dtype=dtype, requires_grad=True)
    weights = torch.empty(B, Q, H, L, P, device="meta", dtype=dtype, requires_grad=True)
    shapes = {"list": SHAPES, "cpu": torch.tensor(SHAPES),
              "meta": torch.tensor(SHAPES, device="meta")}[shape_tables]
    out = pymsda.ms_deform_attn(value, shapes, None, locations, weights)
    assert out.device.type == "meta" and out.shape == (B, Q, H * C) and out.dtype == dtype
    out.sum().backward()
    for leaf in (value, locations, weights):
        assert leaf.grad.device.type == "meta"
        assert leaf.grad.shape == leaf.shape and leaf.grad.dtype == dtype


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("batch,queries", [(0, 3), (2, 0), (0, 0)],
                         ids=["B0", "Q0", "B0_Q0"])
def test_empty_batch_or_queries_give_empty_outputs_and_gradients(generator, device, dtype,
                                                                 batch, queries):
    inputs = make_inputs(generator, batch, queries, H, C, SHAPES, P, dtype=dtype, device=device)
    leaves = {k: inputs[k].clone().requires_grad_(True) for k in GRAD_NAMES}
    out = run_msda(inputs, **leaves)
    assert out.shape == (batch, queries, H * C) and out.dtype == dtype
    out.sum().backward()
    for name in GRAD_NAMES:
        grad = leaves[name].grad
        assert grad.shape == inputs[name].shape and grad.dtype == dtype, name
    # no query samples value: its gradient is zero (written, not left uninitialised)
    assert torch.count_nonzero(leaves["value"].grad) == 0


def test_misaligned_tensors_are_copied_not_refused(generator):
    inputs = small_inputs(generator, "cpu")
    value = inputs["value"]
    raw = bytearray(value.numel() * 4 + 1)
    misaligned = torch.frombuffer(raw, dtype=torch.float32, offset=1,
                                  count=value.numel()).view(value.shape)
    misaligned.copy_(value)
    assert misaligned.data_ptr() % 4 != 0
    out = run_msda(inputs, value=misaligned)
    assert rel_l2(out, oracle_forward(inputs)) < 1e-6

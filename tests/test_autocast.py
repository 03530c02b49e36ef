"""tests/test_autocast.py: the op under torch.autocast. The documented rule (ms_deform_attn's
docstring): output and grad_value in value's dtype; float32 sampling_locations and
attention_weights with a half value are read as float32 (tests/test_mixed_dtypes.py checks the
rule and its precision); gradients come back in each input's own dtype.

Checked on CUDA with bfloat16 and float16 and on the CPU with bfloat16: the autocast call gives
exactly what the same call outside autocast gives, forward and backward; its error against the f64
oracle is within twice what the pure-PyTorch reference achieves on the same rounded inputs in
the same dtype; and the Deformable DETR module trains through autocast (forward and backward,
every parameter gradient finite and close to the f64 module's).
"""
import pytest
import torch

import pymsda
from pymsda.reference import ms_deform_attn_pytorch
from conftest import requires_cuda, skip_unless_grid_sample_supports
from factories import (GRAD_NAMES, loose_bound, make_inputs, oracle_backward, oracle_forward,
                       random_grad_output, rel_l2)

CASES = [
    pytest.param("cuda", torch.bfloat16, id="cuda-bf16", marks=requires_cuda),
    pytest.param("cuda", torch.float16, id="cuda-f16", marks=requires_cuda),
    pytest.param("cpu", torch.bfloat16, id="cpu-bf16"),
]

SHAPES = [(7, 6), (4, 3)]


def grads_of(value, loc, attn, grad_output, autocast_dtype=None, **keywords):
    leaves = [t.detach().clone().requires_grad_(True) for t in (value, loc, attn)]
    device = value.device.type
    if autocast_dtype is None:
        out = pymsda.ms_deform_attn(leaves[0], SHAPES, None, leaves[1], leaves[2], **keywords)
    else:
        with torch.autocast(device, dtype=autocast_dtype):
            out = pymsda.ms_deform_attn(leaves[0], SHAPES, None, leaves[1], leaves[2],
                                        **keywords)
    grads = torch.autograd.grad(out, leaves, grad_output)
    return out.detach(), grads


@pytest.mark.parametrize("device,dtype", CASES)
def test_autocast_changes_nothing_the_op_is_given(generator, device, dtype):
    inputs = make_inputs(generator, 2, 30, 2, 8, SHAPES, 3, dtype=torch.float32, device=device,
                         kink_free=True)
    value = inputs["value"].to(dtype)  # what an nn.Linear under autocast hands the op
    loc, attn = inputs["sampling_locations"], inputs["attention_weights"]  # float32
    grad_output = random_grad_output(generator, torch.empty(2, 30, 16, dtype=dtype,
                                                            device=device))
    out, grads = grads_of(value, loc, attn, grad_output, autocast_dtype=dtype)
    assert out.dtype == dtype
    assert [g.dtype for g in grads] == [dtype, torch.float32, torch.float32]
    cast_out, cast_grads = grads_of(value, loc, attn, grad_output)
    assert torch.equal(out, cast_out)
    for name, grad, expected in zip(GRAD_NAMES, grads, cast_grads):
        if name == "value" and device == "cuda":
            # float atomics accumulate grad_value in a varying order: a last-bit difference
            # can flip a rounding to the half type
            assert rel_l2(grad, expected) < 2.0 ** -8, name
        else:
            assert torch.equal(grad, expected.to(grad.dtype)), name


@pytest.mark.parametrize("device,dtype", CASES)
def test_autocast_error_within_twice_the_reference_in_the_same_dtype(generator, device, dtype):
    skip_unless_grid_sample_supports(dtype, device)
    inputs = make_inputs(generator, 2, 30, 2, 8, SHAPES, 3, dtype=dtype, device=device,
                         kink_free=True)
    value, loc, attn = (inputs[k] for k in GRAD_NAMES)
    grad_output = random_grad_output(generator, torch.empty(2, 30, 16, dtype=dtype,
                                                            device=device))
    # the op under autocast gets float32 locations and weights, holding the rounded numbers
    out, grads = grads_of(value, loc.float(), attn.float(), grad_output, autocast_dtype=dtype)
    leaves = [t.detach().clone().requires_grad_(True) for t in (value, loc, attn)]
    reference = ms_deform_attn_pytorch(leaves[0], SHAPES, leaves[1], leaves[2])
    reference_grads = torch.autograd.grad(reference, leaves, grad_output)
    assert rel_l2(out, oracle_forward(inputs)) <= loose_bound(
        rel_l2(reference, oracle_forward(inputs)))
    for name, grad, ref, exact in zip(GRAD_NAMES, grads, reference_grads,
                                      oracle_backward(inputs, grad_output)):
        assert rel_l2(grad, exact) <= loose_bound(rel_l2(ref, exact)), name


@pytest.mark.parametrize("device,dtype", CASES)
def test_detr_module_trains_under_autocast(generator, device, dtype):
    torch.manual_seed(99)
    module = pymsda.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=2)
    with torch.no_grad():  # off its init, so that every parameter gets a real gradient
        for parameter in module.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    exact = module.double().to(device)
    module = pymsda.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=2)
    module.load_state_dict({k: v.float() for k, v in exact.state_dict().items()})
    module = module.to(device)
    S = sum(h * w for h, w in SHAPES)
    query = torch.randn(2, 25, 32, generator=generator, dtype=torch.float64).to(device)
    reference_points = torch.rand(2, 25, 2, 2, generator=generator, dtype=torch.float64)
    reference_points = reference_points.to(device)
    flatten = torch.randn(2, S, 32, generator=generator, dtype=torch.float64).to(device)
    shapes = torch.tensor(SHAPES, device=device)
    starts = torch.tensor([0, 42], device=device)

    with torch.autocast(device, dtype=dtype):
        out = module(query.float(), reference_points.float(), flatten.float(), shapes, starts)
    assert out.dtype == dtype  # output_proj under autocast
    out.float().square().mean().backward()
    expected = exact(query, reference_points, flatten, shapes, starts)
    expected.square().mean().backward()

    tolerance = 0.05 if dtype == torch.bfloat16 else 0.01
    assert rel_l2(out, expected.detach()) < tolerance
    for (name, p), q in zip(module.named_parameters(), exact.parameters()):
        assert p.grad is not None and p.grad.dtype == torch.float32, name
        assert torch.isfinite(p.grad).all(), name
        assert rel_l2(p.grad, q.grad) < 4 * tolerance, name

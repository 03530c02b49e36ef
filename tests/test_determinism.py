"""tests/test_determinism.py: the deterministic backward (MSDA_DETERMINISTIC, c/msda.h).

Selected by ms_deform_attn(..., deterministic=True) and, with deterministic=None (the default),
by torch.use_deterministic_algorithms(True); deterministic=False wins over torch's setting. On
CUDA two runs give bitwise identical gradients in f32 and bf16 on inputs where many samples
share each pixel (so float atomics would race), and the gradients match the f64 oracle as the
default backward's do. On the CPU (whose backward is deterministic anyway) the flag is accepted
and changes nothing.
"""
import pytest
import torch

import pymsda
from pymsda import _op, _clib
from pymsda.reference import ms_deform_attn_pytorch
from conftest import DEVICES, requires_cuda, skip_unless_grid_sample_supports
from factories import (GRAD_NAMES, loose_bound, make_inputs, oracle_backward,
                       random_grad_output, rel_l2)


@pytest.fixture
def deterministic_algorithms():
    """Turns torch.use_deterministic_algorithms on for the test and restores it after."""
    previous = torch.are_deterministic_algorithms_enabled()
    warn_only = getattr(torch, "is_deterministic_algorithms_warn_only_enabled", lambda: False)()
    torch.use_deterministic_algorithms(True)
    yield
    if warn_only:
        torch.use_deterministic_algorithms(previous, warn_only=True)
    else:
        torch.use_deterministic_algorithms(previous)


@pytest.fixture
def backward_flags(monkeypatch):
    """The flags argument of every msda_backward call the op makes during the test."""
    seen = []
    real = _op.c_backward

    def recording(args):
        seen.append(_clib.unpack_args(args)["flags"])
        return real(args)

    monkeypatch.setattr(_op, "c_backward", recording)
    return seen


def crowded_case(dtype, device):
    """Small maps and many queries: every pixel gathers gradient from many samples."""
    return dict(batch=2, queries=400, heads=2, channels=32, shapes=[(5, 4), (3, 2)], points=4,
                dtype=dtype, device=device, kink_free=True)


def gradients(inputs, grad_output, **keywords):
    leaves = [inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES]
    out = pymsda.ms_deform_attn(leaves[0], inputs["spatial_shapes"],
                                inputs["level_start_index"], leaves[1], leaves[2], **keywords)
    return torch.autograd.grad(out, leaves, grad_output)


def output_like(inputs):
    B, Q, H = inputs["attention_weights"].shape[:3]
    return torch.empty(B, Q, H * inputs["value"].shape[-1], dtype=inputs["value"].dtype,
                       device=inputs["value"].device)


# ---- which backward is selected ----------------------------------------------------------------

@pytest.mark.parametrize("keyword,torch_setting,expected", [
    (True, False, True), (None, True, True), (None, False, False), (False, True, False),
], ids=["keyword", "torch_setting", "default", "keyword_false_wins"])
def test_flag_selection(generator, backward_flags, keyword, torch_setting, expected):
    inputs = make_inputs(generator, 1, 3, 1, 4, [(3, 3)], 2)
    grad_output = random_grad_output(generator, output_like(inputs))
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(torch_setting)
    try:
        gradients(inputs, grad_output, deterministic=keyword)
    finally:
        torch.use_deterministic_algorithms(previous)
    assert len(backward_flags) == 1
    assert bool(backward_flags[0] & _clib.FLAG_DETERMINISTIC) == expected


# ---- CUDA: bitwise reproducible ----------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("selected_by", ["keyword", "torch_setting"])
def test_repeated_backward_is_bitwise_identical_cuda(generator, dtype, selected_by, request):
    inputs = make_inputs(generator, **crowded_case(dtype, "cuda"))
    grad_output = random_grad_output(generator, output_like(inputs))
    if selected_by == "keyword":
        keywords = dict(deterministic=True)
    else:
        request.getfixturevalue("deterministic_algorithms")
        keywords = {}
    first = gradients(inputs, grad_output, **keywords)
    for _ in range(3):
        again = gradients(inputs, grad_output, **keywords)
        for name, a, b in zip(GRAD_NAMES, first, again):
            assert torch.equal(a, b), name


@requires_cuda
def test_keyword_and_torch_setting_give_the_same_bits_cuda(generator, request):
    inputs = make_inputs(generator, **crowded_case(torch.float32, "cuda"))
    grad_output = random_grad_output(generator, output_like(inputs))
    by_keyword = gradients(inputs, grad_output, deterministic=True)
    request.getfixturevalue("deterministic_algorithms")
    by_setting = gradients(inputs, grad_output)
    for name, a, b in zip(GRAD_NAMES, by_keyword, by_setting):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-11), (torch.float32, 1e-5)],
                         ids=["f64", "f32"])
def test_deterministic_gradients_match_f64_oracle(generator, device, dtype, bound):
    inputs = make_inputs(generator, **crowded_case(dtype, device))
    grad_output = random_grad_output(generator, output_like(inputs))
    grads = gradients(inputs, grad_output, deterministic=True)
    for name, grad, expected in zip(GRAD_NAMES, grads, oracle_backward(inputs, grad_output)):
        assert grad.dtype == dtype and grad.shape == inputs[name].shape, name
        assert rel_l2(grad, expected) < bound, name


@pytest.mark.parametrize("device", DEVICES)
def test_deterministic_gradients_bf16_within_twice_reference_error(generator, device):
    skip_unless_grid_sample_supports(torch.bfloat16, device)
    inputs = make_inputs(generator, **crowded_case(torch.bfloat16, device))
    grad_output = random_grad_output(generator, output_like(inputs))
    grads = gradients(inputs, grad_output, deterministic=True)
    leaves = [inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES]
    reference = ms_deform_attn_pytorch(leaves[0], inputs["spatial_shapes"], leaves[1],
                                       leaves[2])
    reference_grads = torch.autograd.grad(reference, leaves, grad_output)
    for name, grad, ref, exact in zip(GRAD_NAMES, grads, reference_grads,
                                      oracle_backward(inputs, grad_output)):
        assert grad.dtype == torch.bfloat16, name
        assert rel_l2(grad, exact) <= loose_bound(rel_l2(ref, exact)), name


# ---- CPU: the flag is accepted and changes nothing ----------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_cpu_deterministic_flag_gives_the_default_bits(generator, dtype, backward_flags):
    inputs = make_inputs(generator, **crowded_case(dtype, "cpu"))
    grad_output = random_grad_output(generator, output_like(inputs))
    default = gradients(inputs, grad_output, deterministic=False)
    for _ in range(2):
        deterministic = gradients(inputs, grad_output, deterministic=True)
        for name, a, b in zip(GRAD_NAMES, default, deterministic):
            assert torch.equal(a, b), name
    assert [bool(f & _clib.FLAG_DETERMINISTIC) for f in backward_flags] == [False, True, True]

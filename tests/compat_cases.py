"""tests/compat_cases.py: what the tests of pymsda.compat's drop-ins share (tests/test_compat*.py):
small float64 inputs, their gradients through an entry point, and the comparison with the f64
oracle (tests/oracle.py).
"""
import inspect

import torch

from factories import GRAD_NAMES, make_inputs, oracle_backward, oracle_forward, rel_l2

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

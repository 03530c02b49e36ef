"""tests/clients.py: what the tests of the projects pymsda.compat switches share
(tests/test_clients.py, tests/test_clients_mmcv.py): importing a project or skipping with the
reason, counting the calls into libpymsda, one training step (forward, backward, AdamW), and
comparing pymsda's step with the project's own against the float64 truth.
"""
import copy
import importlib

import pytest
import torch

from pymsda import _op

# ours may be off the float64 truth by twice the project's own error in the same dtype, plus
# this much relative to the size of the true quantity
FLOOR = {torch.float64: 1e-10, torch.float32: 1e-6}
LEARNING_RATE = 1e-3
DTYPES = pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])


# The projects that import PyPI's torchvision, which is built for PyPI's CUDA torch and does not
# import beside a CPU build: their pins are in a file of their own.
TORCHVISION_PROJECTS = ("ultralytics", "rfdetr", "groundingdino")


def client(name):
    """The project's module, or a skip that names the project, where its pinned version is
    and why it cannot be imported here (one reason for all of a project's skips)."""
    try:
        return importlib.import_module(name)
    except Exception as error:  # ImportError, or a torchvision built for another torch
        project = name.split(".")[0]
        first_line = (str(error).splitlines() or [""])[0][:160]
        pins = ("tests/requirements-clients-torchvision.txt, beside PyPI's CUDA torch"
                if project in TORCHVISION_PROJECTS else "tests/requirements-clients.txt")
        pytest.skip(f"needs {project} ({pins}): {type(error).__name__}: {first_line}")


@pytest.fixture
def library_calls(monkeypatch):
    """Counts of the calls into libpymsda's msda_forward and msda_backward."""
    counts = {"forward": 0, "backward": 0}
    for name, key in (("c_forward", "forward"), ("c_backward", "backward")):
        entry = getattr(_op, name)

        def counted(*args, _entry=entry, _key=key):
            counts[_key] += 1
            return _entry(*args)
        monkeypatch.setattr(_op, name, counted)
    return counts


def train_step(model, loss_of):
    """Forward, backward and one AdamW step (weight decay on): (output, gradients by parameter
    name, None where no gradient flowed, parameters after the step)."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.1)
    output, loss = loss_of(model)
    loss.backward()
    grads = {n: None if p.grad is None else p.grad.detach().clone()
             for n, p in model.named_parameters()}
    optimizer.step()
    return output.detach(), grads, {n: p.detach().clone() for n, p in model.named_parameters()}


def error(actual, expected):
    return (actual.double() - expected.double()).norm()


def assert_same_step(ours, own, truth, dtype):
    """ours and own: one training step in dtype on pymsda and on the project's own MSDA; truth:
    the project's own step in float64. Ours is no further from the truth than twice the
    project's own error in dtype (plus FLOOR) for the output, each gradient (4x in float32) and
    each weight after the step (float64); gradients that are None stay None (never zeros)."""
    floor = FLOOR[dtype]
    (out, grads, params), (own_out, own_grads, own_params) = ours, own
    true_out, true_grads, true_params = truth
    assert out.dtype == own_out.dtype == dtype and out.shape == own_out.shape
    assert error(out, true_out) <= 2 * error(own_out, true_out) + floor * true_out.norm()
    assert grads.keys() == own_grads.keys() == true_grads.keys()
    # A gradient that is 0 in exact arithmetic (a bias before a normalisation) is rounding
    # noise: its size is measured against all gradients together.
    total = torch.cat([g.flatten() for g in true_grads.values() if g is not None]).norm()
    noise = {n for n, g in true_grads.items() if g is not None and g.norm() < 1e-6 * total}
    # A float32 location that crosses a pixel edge (where bilinear sampling has a kink) moves
    # the location gradient by a step: both runs' offset gradients carry such steps at random
    # points, so float32 gradients get 4x the project's own error.
    factor = 2 if dtype == torch.float64 else 4
    for name, grad in grads.items():
        expected = true_grads[name]
        assert (grad is None) == (own_grads[name] is None) == (expected is None), name
        if expected is not None:
            scale = 1e-4 * total if name in noise else expected.norm()
            assert (error(grad, expected) <= factor * error(own_grads[name], expected)
                    + floor * scale), name
    if dtype != torch.float64:
        # AdamW's first step moves a weight by lr * g / (|g| + eps), which turns a float32
        # gradient's rounding error into up to lr where |g| is near eps: the weights are
        # compared in float64 only
        return
    for name, param in params.items():
        if name not in noise:  # weights whose gradient is only rounding noise: not compared
            expected = true_params[name]
            assert (error(param, expected) <= 2 * error(own_params[name], expected)
                    + floor * LEARNING_RATE * expected.numel() ** 0.5), name


def compare_switched(build, loss_of, dtype, install, uninstall, library_calls, calls_per_step):
    """The project's own step (in dtype and in float64), then pymsda's after install(), then the
    project's own again after uninstall(), on copies of one model."""
    torch.manual_seed(0)
    model = build()
    truth = train_step(copy.deepcopy(model).double(), loss_of)
    model = model.to(dtype)
    own = train_step(copy.deepcopy(model), loss_of)
    assert library_calls == {"forward": 0, "backward": 0}  # the project's own path
    switched = install()
    try:
        assert switched and install() == switched  # idempotent
        ours = train_step(copy.deepcopy(model), loss_of)
    finally:
        restored = uninstall()
    assert sorted(restored) == sorted(switched)
    assert library_calls["forward"] == calls_per_step and library_calls["backward"] >= 1
    assert_same_step(ours, own, truth, dtype)
    again = train_step(copy.deepcopy(model), loss_of)  # uninstalled: the project's own again
    assert library_calls["forward"] == calls_per_step
    assert_same_step(again, own, truth, dtype)
    return switched


def square_mean(*tensors):
    return sum(t.double().square().mean() for t in tensors)

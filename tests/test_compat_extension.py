"""tests/test_compat_extension.py: pymsda.compat.extension, Deformable DETR's compiled extension
`MultiScaleDeformableAttention` on pymsda, as pymsda.compat.install() serves it to `import
MultiScaleDeformableAttention as MSDA`: the extension's forward and backward, through the
autograd.Function Deformable DETR wraps them in. (Switching and its undo against stand-ins:
tests/test_compat_switches.py.) CPU always; CUDA where a GPU is present.
"""
import importlib
import sys

import pytest
import torch

import pymsda
import pymsda.compat
from compat_cases import F64_BOUND, gradients, plain_inputs
from conftest import DEVICES
from factories import GRAD_NAMES, oracle_backward, oracle_forward, random_grad_output, rel_l2


class _ExtensionFunction(torch.autograd.Function):
    """What Deformable DETR's functions/ms_deform_attn_func.py does with the compiled extension
    (written here from its behaviour): forward and backward straight into MSDA."""

    @staticmethod
    def forward(ctx, value, shapes, starts, loc, attn, im2col_step):
        import MultiScaleDeformableAttention as MSDA
        ctx.im2col_step = im2col_step
        ctx.save_for_backward(value, shapes, starts, loc, attn)
        return MSDA.ms_deform_attn_forward(value, shapes, starts, loc, attn, im2col_step)

    @staticmethod
    def backward(ctx, grad_output):
        import MultiScaleDeformableAttention as MSDA
        value, shapes, starts, loc, attn = ctx.saved_tensors
        grad_value, grad_loc, grad_attn = MSDA.ms_deform_attn_backward(
            value, shapes, starts, loc, attn, grad_output, ctx.im2col_step)
        return grad_value, None, None, grad_loc, grad_attn, None


@pytest.fixture
def installed_extension(monkeypatch):
    monkeypatch.delitem(sys.modules, "MultiScaleDeformableAttention", raising=False)
    assert pymsda.compat.install() == ["sys.modules['MultiScaleDeformableAttention']"]
    module = sys.modules["MultiScaleDeformableAttention"]
    yield module
    pymsda.compat.uninstall()
    monkeypatch.delitem(sys.modules, "MultiScaleDeformableAttention", raising=False)


@pytest.mark.parametrize("device", DEVICES)
def test_install_serves_import_multiscaledeformableattention(generator, device,
                                                             installed_extension):
    MSDA = importlib.import_module("MultiScaleDeformableAttention")
    assert MSDA is installed_extension
    inputs = plain_inputs(generator, device)
    args = [inputs[k] for k in ("value", "spatial_shapes", "level_start_index",
                                "sampling_locations", "attention_weights")]
    out = MSDA.ms_deform_attn_forward(*args, 64)
    assert out.shape == (2, 6, 8) and out.grad_fn is None
    assert rel_l2(out, oracle_forward(inputs)) < F64_BOUND
    grad_output = random_grad_output(generator, out)
    grads = MSDA.ms_deform_attn_backward(*args, grad_output, 64)
    assert isinstance(grads, list) and len(grads) == 3
    for g, expected, name in zip(grads, oracle_backward(inputs, grad_output), GRAD_NAMES):
        assert g.shape == inputs[name].shape and g.dtype == torch.float64
        assert rel_l2(g, expected) < 1e-11, name


@pytest.mark.parametrize("device", DEVICES)
def test_install_unmodified_extension_function_gradcheck(generator, device, installed_extension):
    inputs = plain_inputs(generator, device, batch=1, queries=2, channels=3, points=2,
                          shapes=[(3, 4), (2, 2)])
    leaves = tuple(inputs[k].clone().requires_grad_(True) for k in GRAD_NAMES)

    def function(value, loc, attn):
        return _ExtensionFunction.apply(value, inputs["spatial_shapes"],
                                        inputs["level_start_index"], loc, attn, 64)

    assert torch.autograd.gradcheck(function, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("path", ["kernel", "recompute"])
def test_install_backward_matches_pymsda_autograd(generator, device, dtype, path,
                                                 installed_extension, monkeypatch):
    """MSDA.ms_deform_attn_backward == pymsda's autograd gradients, bitwise, for every dtype,
    through the backward kernel directly and through the recompute fallback (older torch, a
    list of shapes, a device the library has no kernels for); each gradient has its input's
    shape and dtype and records no graph, even for inputs that require grad. On CUDA the
    value gradient is summed with float atomics, whose order varies between runs: there it
    agrees to rounding instead."""
    if path == "recompute":
        # patched on the module behind the alias: the alias holds no attributes of its own
        monkeypatch.setattr(pymsda.compat.extension, "_kernel_backward_serves", lambda *a: False)
    inputs = plain_inputs(generator, device, dtype=dtype)
    args = [inputs[k] for k in ("value", "spatial_shapes", "level_start_index",
                                "sampling_locations", "attention_weights")]
    grad_output = random_grad_output(generator, pymsda.ms_deform_attn(*args))
    out, expected = gradients(pymsda.ms_deform_attn, inputs, grad_output,
                              inputs["spatial_shapes"], inputs["level_start_index"])
    leaves = [t.clone().requires_grad_(True) if t.is_floating_point() else t for t in args]
    forward = installed_extension.ms_deform_attn_forward(*leaves, 64)
    assert torch.equal(forward, out.detach()) and forward.grad_fn is None
    grads = installed_extension.ms_deform_attn_backward(*leaves, grad_output, 64)
    assert isinstance(grads, list) and len(grads) == 3
    for grad, name in zip(grads, GRAD_NAMES):
        assert grad.dtype == dtype and grad.shape == inputs[name].shape, name
        assert not grad.requires_grad, name
        if device == "cuda" and name == "value":
            bound = {torch.float64: 1e-12, torch.float32: 1e-6}.get(dtype, 4e-3)
            assert rel_l2(grad, expected[name]) < bound, name
        else:
            assert torch.equal(grad, expected[name]), name


def test_backward_kernel_serves_where_the_library_serves_the_device(generator, monkeypatch):
    """The backward goes straight to the kernel op only on a device the library serves, by the
    library's one rule (pymsda._clib.serves: the CPU, or a GPU its kernels run on); elsewhere
    (a GPU without code for it) it takes the recompute path, whose fallback warns once."""
    inputs = plain_inputs(generator, "cpu")
    value, shapes = inputs["value"], inputs["spatial_shapes"]
    asked = []
    extension = pymsda.compat.extension
    monkeypatch.setattr(extension._clib, "serves", lambda device: asked.append(device) or False)
    assert extension._kernel_backward_serves(value, shapes) is False
    assert asked == ([value.device] if pymsda.ops.HAS_TORCH_LIBRARY_OPS else [])
    monkeypatch.setattr(extension._clib, "serves", lambda device: True)
    assert extension._kernel_backward_serves(value, shapes) == pymsda.ops.HAS_TORCH_LIBRARY_OPS
    assert extension._kernel_backward_serves(value, [(6, 5), (3, 4), (2, 2)]) is False

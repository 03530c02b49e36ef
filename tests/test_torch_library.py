"""tests/test_torch_library.py: the op as torch sees it where torch.library.custom_op exists
(torch >= 2.4): pymsda::ms_deform_attn_forward and pymsda::ms_deform_attn_backward pass
torch.library.opcheck (schema, fake implementation, autograd registration, AOT dispatch with
dynamic shapes) on the CPU and on CUDA; the fake implementations give shapes and argument errors
without data; torch.export captures the op and the exported program computes it; and eager
calls go straight to the library (the dispatcher costs several microseconds a call) while
traced ones go through the dispatcher, where a mode or a tracer can see them.

On a torch without these APIs the tests that need them skip, naming what is missing; the eager
op itself is covered by the rest of the suite on every torch.
"""
import pytest
import torch

import pymsda
from pymsda import ops
from conftest import DEVICES, requires_torch_feature
from factories import (GRAD_NAMES, make_inputs, oracle_backward, oracle_forward,
                       random_grad_output, random_level_shapes, rel_l2)

requires_ops = requires_torch_feature(hasattr(torch.library, "custom_op"),
                                      "torch.library.custom_op")
requires_opcheck = requires_torch_feature(hasattr(torch.library, "opcheck"),
                                          "torch.library.opcheck")

try:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # torch 1.13 has neither where later versions have them
    FakeTensorMode = TorchDispatchMode = None
requires_fake_mode = requires_torch_feature(FakeTensorMode is not None, "FakeTensorMode")

try:
    import torch.export as torch_export
    has_export = hasattr(torch_export, "export")
except ImportError:
    has_export = False
requires_export = requires_torch_feature(has_export, "torch.export.export")

FLAG_NEAREST = pymsda._clib.FLAG_NEAREST


def op_arguments(generator, device, variant, dtype=torch.float64):
    """The forward op's arguments (value, spatial_shapes, level_start_index,
    sampling_locations, attention_weights, num_points_list, flags) for one variant."""
    shapes = random_level_shapes(generator, 3, max_side=6, min_side=2)
    inputs = make_inputs(generator, batch=2, queries=5, heads=2, channels=3, shapes=shapes,
                         points=2, dtype=dtype, device=device,
                         index_dtype=torch.int32 if variant == "int32_tables" else torch.int64)
    value, loc, attn = (inputs[k] for k in GRAD_NAMES)
    starts = inputs["level_start_index"]
    table = inputs["spatial_shapes"]
    counts, flags = None, 0
    if variant == "int32_tables":
        starts = None  # derived on the device from the int32 table
    elif variant == "cpu_tables":
        table, starts = table.cpu(), starts.cpu()
    elif variant == "level_points":
        counts = [3, 0, 2]  # RT-DETRv2 layout: (B, Q, H, sum(counts), 2)
        B, Q, H = attn.shape[:3]
        loc = torch.rand(B, Q, H, sum(counts), 2, generator=generator,
                         dtype=torch.float64).to(device=device, dtype=dtype)
        attn = torch.rand(B, Q, H, sum(counts), generator=generator,
                          dtype=torch.float64).to(device=device, dtype=dtype)
    elif variant == "nearest":
        flags = FLAG_NEAREST
    return [value, table, starts, loc, attn, counts, flags]


VARIANTS = ["plain", "int32_tables", "cpu_tables", "level_points", "nearest"]


def test_ops_registered_exactly_where_torch_has_custom_op():
    has_custom_op = hasattr(torch.library, "custom_op")
    assert ops.HAS_TORCH_LIBRARY_OPS == has_custom_op
    if has_custom_op:
        assert hasattr(torch.ops.pymsda, "ms_deform_attn_forward")
        assert hasattr(torch.ops.pymsda, "ms_deform_attn_backward")


# ---- opcheck -----------------------------------------------------------------------------------

@requires_ops
@requires_opcheck
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant", VARIANTS)
def test_opcheck_forward(generator, device, variant):
    args = op_arguments(generator, device, variant)
    for i in (0, 3, 4):
        args[i] = args[i].requires_grad_(True)  # also checks the autograd registration
    torch.library.opcheck(torch.ops.pymsda.ms_deform_attn_forward.default, tuple(args))


@requires_ops
@requires_opcheck
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("variant,needs", [("plain", (True, True, True)),
                                           ("level_points", (True, False, True)),
                                           ("cpu_tables", (False, True, False))])
def test_opcheck_backward(generator, device, variant, needs):
    args = op_arguments(generator, device, variant)
    B, Q, H = args[4].shape[:3]
    grad_output = random_grad_output(
        generator, torch.empty(B, Q, H * args[0].shape[-1], dtype=args[0].dtype, device=device))
    torch.library.opcheck(torch.ops.pymsda.ms_deform_attn_backward.default,
                          (grad_output, *args, *needs))


# ---- the ops compute the operator --------------------------------------------------------------

@requires_ops
@pytest.mark.parametrize("device", DEVICES)
def test_forward_op_matches_f64_oracle(generator, device):
    value, table, starts, loc, attn, counts, flags = op_arguments(generator, device, "plain")
    out = torch.ops.pymsda.ms_deform_attn_forward(value, table, starts, loc, attn, None, 0)
    inputs = dict(value=value, spatial_shapes=table, sampling_locations=loc,
                  attention_weights=attn)
    assert out.shape == (2, 5, 2 * 3) and out.dtype == torch.float64
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12


@requires_ops
@pytest.mark.parametrize("device", DEVICES)
def test_backward_op_matches_f64_oracle_and_skips_unneeded(generator, device):
    value, table, starts, loc, attn, counts, flags = op_arguments(generator, device, "plain")
    inputs = dict(value=value, spatial_shapes=table, sampling_locations=loc,
                  attention_weights=attn)
    grad_output = random_grad_output(generator, oracle_like(inputs, device))
    expected = oracle_backward(inputs, grad_output)
    grads = torch.ops.pymsda.ms_deform_attn_backward(grad_output, value, table, starts, loc,
                                                     attn, None, 0, True, True, True)
    for name, grad, e in zip(GRAD_NAMES, grads, expected):
        assert grad.shape == inputs[name].shape and grad.dtype == torch.float64, name
        assert rel_l2(grad, e) < 1e-11, name
    grads = torch.ops.pymsda.ms_deform_attn_backward(grad_output, value, table, starts, loc,
                                                     attn, None, 0, False, True, False)
    assert grads[0].shape == (0,) and grads[2].shape == (0,)
    assert rel_l2(grads[1], expected[1]) < 1e-11


def oracle_like(inputs, device):
    B, Q, H = inputs["attention_weights"].shape[:3]
    C = inputs["value"].shape[-1]
    return torch.empty(B, Q, H * C, dtype=torch.float64, device=device)


@requires_ops
def test_backward_op_refuses_a_grad_output_of_the_wrong_shape(generator):
    value, table, starts, loc, attn, counts, flags = op_arguments(generator, "cpu", "plain")
    wrong = torch.zeros(2, 5, 5, dtype=torch.float64)  # H*C is 6
    with pytest.raises(ValueError, match="grad_output"):
        torch.ops.pymsda.ms_deform_attn_backward(wrong, value, table, starts, loc, attn, None,
                                                 0, True, True, True)


# ---- fake tensors: shapes without data ---------------------------------------------------------

@requires_ops
@requires_fake_mode
@pytest.mark.parametrize("shape_tables", ["list", "tensor"])
def test_fake_tensors_give_output_and_gradient_shapes(shape_tables):
    B, Q, H, C, P = 2, 7, 3, 5, 4
    shapes = [(6, 5), (3, 3)]
    S, L = 39, 2
    with FakeTensorMode():
        value = torch.empty(B, S, H, C, dtype=torch.bfloat16, requires_grad=True)
        loc = torch.empty(B, Q, H, L, P, 2, requires_grad=True)  # f32: cast to value's dtype
        attn = torch.empty(B, Q, H, L, P, dtype=torch.bfloat16, requires_grad=True)
        table = shapes if shape_tables == "list" else torch.tensor(shapes)
        out = pymsda.ms_deform_attn(value, table, None, loc, attn)
        out.sum().backward()
    assert out.shape == (B, Q, H * C) and out.dtype == torch.bfloat16
    assert value.grad.shape == value.shape and value.grad.dtype == torch.bfloat16
    assert loc.grad.shape == loc.shape and loc.grad.dtype == torch.float32
    assert attn.grad.shape == attn.shape


@requires_ops
@requires_fake_mode
@pytest.mark.parametrize("bad,pattern", [
    (dict(attention_weights=(2, 7, 3, 2, 3)), "attention_weights"),
    (dict(sampling_locations=(2, 7, 4, 2, 4, 2)), "sampling_locations has heads"),
    (dict(spatial_shapes=(3, 2)), "spatial_shapes has 3 levels"),
])
def test_fake_tensors_report_wrong_shapes_by_name(bad, pattern):
    sizes = dict(value=(2, 39, 3, 5), sampling_locations=(2, 7, 3, 2, 4, 2),
                 attention_weights=(2, 7, 3, 2, 4), spatial_shapes=(2, 2))
    sizes.update(bad)
    with FakeTensorMode():
        tensors = {name: torch.empty(size) for name, size in sizes.items()}
        tensors["spatial_shapes"] = torch.empty(sizes["spatial_shapes"], dtype=torch.int64)
        with pytest.raises(ValueError, match=pattern):
            pymsda.ms_deform_attn(tensors["value"], tensors["spatial_shapes"], None,
                                  tensors["sampling_locations"], tensors["attention_weights"])


# ---- which way a call goes ---------------------------------------------------------------------

@requires_ops
@requires_fake_mode  # TorchDispatchMode comes with it
def test_dispatch_mode_sees_the_op_and_results_match_eager(generator):
    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.calls.append(str(func))
            return func(*args, **(kwargs or {}))

    inputs = make_inputs(generator, 2, 6, 2, 4, [(5, 4), (2, 3)], 3)
    leaves = [inputs[k].clone().requires_grad_(True) for k in GRAD_NAMES]
    eager = pymsda.ms_deform_attn(leaves[0], [(5, 4), (2, 3)], None, leaves[1], leaves[2])
    eager_grads = torch.autograd.grad(eager, leaves, torch.ones_like(eager))
    with Recorder() as recorder:
        out = pymsda.ms_deform_attn(leaves[0], [(5, 4), (2, 3)], None, leaves[1], leaves[2])
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert "pymsda.ms_deform_attn_forward.default" in recorder.calls
    assert "pymsda.ms_deform_attn_backward.default" in recorder.calls
    assert torch.equal(out, eager)
    for grad, expected in zip(grads, eager_grads):
        assert torch.equal(grad, expected)


@requires_ops
def test_eager_calls_do_not_go_through_the_dispatcher(generator):
    # The dispatcher path costs several microseconds a call, more than pymsda's host overhead:
    # eager calls, with or without autograd, call the library directly, so the profiler
    # records no pymsda op. A call through torch.ops is recorded (the control).
    inputs = make_inputs(generator, 1, 3, 1, 4, [(4, 4)], 2)
    leaves = [inputs[k].clone().requires_grad_(True) for k in GRAD_NAMES]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        pymsda.ms_deform_attn(inputs["value"], [(4, 4)], None, inputs["sampling_locations"],
                              inputs["attention_weights"])
        out = pymsda.ms_deform_attn(leaves[0], [(4, 4)], None, leaves[1], leaves[2])
        out.sum().backward()
    names = {event.name for event in prof.events()}
    assert not any(name.startswith("pymsda::") for name in names), names
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        torch.ops.pymsda.ms_deform_attn_forward(inputs["value"], inputs["spatial_shapes"], None,
                                                inputs["sampling_locations"],
                                                inputs["attention_weights"], None, 0)
    assert "pymsda::ms_deform_attn_forward" in {event.name for event in prof.events()}


# ---- torch.export ------------------------------------------------------------------------------

class AttendWithListShapes(torch.nn.Module):
    """The op with host-side shapes held by the module (they become graph constants)."""

    def __init__(self, shapes):
        super().__init__()
        self.shapes = shapes

    def forward(self, value, sampling_locations, attention_weights):
        return pymsda.ms_deform_attn(value, self.shapes, None, sampling_locations,
                                     attention_weights)


class AttendWithTensorShapes(torch.nn.Module):
    def forward(self, value, spatial_shapes, level_start_index, sampling_locations,
                attention_weights):
        return pymsda.ms_deform_attn(value, spatial_shapes, level_start_index,
                                     sampling_locations, attention_weights)


def exported_op_count(program):
    return sum(1 for node in program.graph.nodes
               if node.op == "call_function"
               and node.target is torch.ops.pymsda.ms_deform_attn_forward.default)


@requires_ops
@requires_export
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape_tables", ["list", "tensor"])
def test_export_captures_the_op_and_the_program_runs(generator, device, shape_tables):
    shapes = random_level_shapes(generator, 2, max_side=7, min_side=2)
    inputs = make_inputs(generator, 2, 6, 2, 5, shapes, 3, device=device)
    if shape_tables == "list":
        module = AttendWithListShapes(shapes)
        args = (inputs["value"], inputs["sampling_locations"], inputs["attention_weights"])
    else:
        module = AttendWithTensorShapes()
        args = tuple(inputs[k] for k in ("value", "spatial_shapes", "level_start_index",
                                         "sampling_locations", "attention_weights"))
    program = torch.export.export(module, args)
    assert exported_op_count(program) == 1
    # fresh numbers through the exported program
    fresh = make_inputs(generator, 2, 6, 2, 5, shapes, 3, device=device)
    if shape_tables == "list":
        args = (fresh["value"], fresh["sampling_locations"], fresh["attention_weights"])
    else:
        args = tuple(fresh[k] for k in ("value", "spatial_shapes", "level_start_index",
                                        "sampling_locations", "attention_weights"))
    out = program.module()(*args)
    assert out.device.type == device
    assert rel_l2(out, oracle_forward(fresh)) < 1e-12


@requires_ops
@requires_export
def test_export_of_the_deformable_detr_module(generator):
    torch.manual_seed(0)
    module = pymsda.MSDeformAttn(d_model=16, n_levels=2, n_heads=2, n_points=2).double()
    shapes = [(6, 5), (3, 2)]
    S = 36
    query = torch.randn(2, 7, 16, generator=generator, dtype=torch.float64)
    reference_points = torch.rand(2, 7, 2, 2, generator=generator, dtype=torch.float64)
    flatten = torch.randn(2, S, 16, generator=generator, dtype=torch.float64)
    args = (query, reference_points, flatten, torch.tensor(shapes), torch.tensor([0, 30]))
    program = torch.export.export(module, args)
    assert exported_op_count(program) == 1
    expected = module(*args)
    assert rel_l2(program.module()(*args), expected.detach()) < 1e-13

"""tests/test_compile.py: torch.compile(fullgraph=True) of models that call the op, forward and
backward, on the CPU and on CUDA: no graph break (fullgraph raises on one; torch._dynamo.explain
counts them), the pymsda op in the graph, and the compiled model agreeing with eager (and the op
with the f64 oracle).

Compiling is slow on a small machine, so there are few cases: the default backend (inductor) on
the Deformable DETR module, and the lighter "aot_eager" backend (AOT autograd through the op's
fake implementation and registered backward, no code generation) for the op's options.
"""
import copy

import pytest
import torch

import pymsda
from conftest import DEVICES, expects_torchscript_deprecation, requires_torch_feature
from factories import (GRAD_NAMES, make_inputs, oracle_backward, oracle_forward,
                       random_grad_output, rel_l2)

pytestmark = [
    requires_torch_feature(hasattr(torch, "compile"), "torch.compile"),
    requires_torch_feature(hasattr(torch.library, "custom_op"),
                           "torch.library.custom_op (the op cannot be traced without it)"),
    expects_torchscript_deprecation,  # torch.compile imports torch.utils.mkldnn, which scripts
]

SHAPES = [(6, 5), (3, 4)]
S = 6 * 5 + 3 * 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def detr_module_and_inputs(generator, device, dtype):
    torch.manual_seed(1234)
    module = pymsda.MSDeformAttn(d_model=16, n_levels=2, n_heads=2, n_points=3)
    with torch.no_grad():  # move every parameter off its init so every gradient is non-trivial
        for parameter in module.parameters():
            parameter.add_(0.1 * torch.randn(parameter.shape, generator=generator))
    module = module.to(device=device, dtype=dtype)
    draw = dict(generator=generator, dtype=torch.float64)
    query = torch.randn(2, 9, 16, **draw).to(device, dtype).requires_grad_(True)
    reference_points = torch.rand(2, 9, 2, 2, **draw).to(device, dtype)
    flatten = torch.randn(2, S, 16, **draw).to(device, dtype).requires_grad_(True)
    shapes = torch.tensor(SHAPES, device=device)
    starts = torch.tensor([0, 30], device=device)
    return module, (query, reference_points, flatten, shapes, starts)


def forward_backward(module, args, grad_output):
    out = module(*args)
    out.backward(grad_output)
    grads = [p.grad.clone() for p in module.parameters()] + [args[0].grad.clone(),
                                                             args[2].grad.clone()]
    module.zero_grad()
    args[0].grad = args[2].grad = None
    return out.detach(), grads


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_detr_module_matches_eager_inductor_fullgraph(generator, device):
    module, args = detr_module_and_inputs(generator, device, torch.float64)
    grad_output = torch.randn(2, 9, 16, generator=generator, dtype=torch.float64).to(device)
    eager_out, eager_grads = forward_backward(module, args, grad_output)
    compiled = torch.compile(copy.deepcopy(module), fullgraph=True)
    out, grads = forward_backward(compiled, args, grad_output)
    assert rel_l2(out, eager_out) < 1e-12
    for grad, expected in zip(grads, eager_grads):
        assert rel_l2(grad, expected) < 1e-10


def test_explain_counts_one_graph_and_no_break_with_the_op_inside(generator):
    module, args = detr_module_and_inputs(generator, "cpu", torch.float32)
    for shape_tables in ("tensor", "list"):
        call_args = args if shape_tables == "tensor" else args[:3] + (SHAPES, None)
        explanation = torch._dynamo.explain(module)(*call_args)
        assert explanation.graph_break_count == 0, explanation.break_reasons
        assert explanation.graph_count == 1
        targets = [node.target for node in explanation.graphs[0].graph.nodes]
        assert torch.ops.pymsda.ms_deform_attn_forward.default in targets or \
            torch.ops.pymsda.ms_deform_attn_forward in targets, targets


OPTIONS = {
    "list_shapes": dict(),
    "points_softmax_nearest": dict(num_points_list=[2, 0, 1], softmax=True, sampling="nearest"),
    "deterministic": dict(deterministic=True),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("option", list(OPTIONS))
def test_compiled_op_options_match_eager_aot_eager_fullgraph(generator, device, option):
    keywords = OPTIONS[option]
    shapes = [(5, 4), (3, 3), (2, 5)]
    inputs = make_inputs(generator, 2, 7, 2, 4, shapes, 3, device=device)
    value, loc, attn = (inputs[k] for k in GRAD_NAMES)
    if "num_points_list" in keywords:  # (B, Q, H, sum(counts), 2) layout
        loc, attn = loc.flatten(3, 4)[:, :, :, :3], attn.flatten(3, 4)[:, :, :, :3]
    grad_output = random_grad_output(generator, torch.empty(2, 7, 8, dtype=torch.float64,
                                                            device=device))

    def model(value, loc, attn):
        # a little graph around the op: its inputs and output pass through other ops
        out = pymsda.ms_deform_attn(value * 2.0, shapes, None, loc.clamp(-1.0, 2.0),
                                    attn, **keywords)
        return torch.tanh(out)

    def run(function):
        leaves = [t.detach().clone().requires_grad_(True) for t in (value, loc, attn)]
        out = function(*leaves)
        grads = torch.autograd.grad(out, leaves, grad_output, allow_unused=True)
        return out.detach(), grads

    eager_out, eager_grads = run(model)
    out, grads = run(torch.compile(model, fullgraph=True, backend="aot_eager"))
    assert rel_l2(out, eager_out) < 1e-13
    for name, grad, expected in zip(GRAD_NAMES, grads, eager_grads):
        if expected is None:  # nearest sampling: no location gradient, eager or compiled
            assert grad is None, name
        else:
            assert rel_l2(grad, expected) < 1e-12, name


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_op_matches_f64_oracle(generator, device):
    shapes = [(4, 6), (2, 3)]
    inputs = make_inputs(generator, 3, 5, 2, 3, shapes, 2, device=device, kink_free=True)
    grad_output = random_grad_output(generator, torch.empty(3, 5, 6, dtype=torch.float64,
                                                            device=device))

    def attend(value, spatial_shapes, level_start_index, loc, attn):
        return pymsda.ms_deform_attn(value, spatial_shapes, level_start_index, loc, attn)

    leaves = [inputs[k].clone().requires_grad_(True) for k in GRAD_NAMES]
    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    out = compiled(leaves[0], inputs["spatial_shapes"], inputs["level_start_index"], leaves[1],
                   leaves[2])
    grads = torch.autograd.grad(out, leaves, grad_output)
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12
    for name, grad, expected in zip(GRAD_NAMES, grads, oracle_backward(inputs, grad_output)):
        assert rel_l2(grad, expected) < 1e-11, name

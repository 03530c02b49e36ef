"""tests/test_cuda_graphs.py: forward and backward captured in CUDA graphs replay to what eager
computes, with fresh numbers copied into the captured inputs: torch.cuda.graph around the op and
torch.autograd.grad (shape tables as a list, as device tensors and as CPU tensors) or around the
forward alone, the deterministic backward bitwise, and torch.cuda.make_graphed_callables on the
Deformable DETR module. Also: a list of shapes first seen inside a capture is refused with a
message that says what to do (its device copy cannot be made there). Everything here skips
without a GPU.
"""
import copy

import pytest
import torch

import pymsda
from conftest import requires_cuda
from factories import (GRAD_NAMES, make_inputs, oracle_backward, oracle_forward,
                       random_grad_output, random_level_shapes, rel_l2, run_msda)

# caching_allocator: graph capture needs torch's caching allocator (the sanitizer runs of
# tests/gpu_reliability.sh turn it off)
pytestmark = [requires_cuda, pytest.mark.caching_allocator]


def run_op(leaves, shape_tables, keywords):
    value, loc, attn = leaves
    return pymsda.ms_deform_attn(value, shape_tables[0], shape_tables[1], loc, attn, **keywords)


class CapturedStep:
    """One forward and one backward of the op captured in a CUDA graph on static inputs, after
    a warm-up on a side stream (as torch.cuda.graph's documentation asks)."""

    def __init__(self, static_inputs, shape_tables, keywords):
        self.leaves = [static_inputs[k].clone().requires_grad_(True) for k in GRAD_NAMES]
        value, attn = static_inputs["value"], static_inputs["attention_weights"]
        B, Q, H = attn.shape[:3]
        self.grad_output = torch.zeros(B, Q, H * value.shape[-1], dtype=value.dtype,
                                       device=value.device)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(3):
                out = run_op(self.leaves, shape_tables, keywords)
                torch.autograd.grad(out, self.leaves, self.grad_output)
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = run_op(self.leaves, shape_tables, keywords)
            self.grads = torch.autograd.grad(self.out, self.leaves, self.grad_output)

    def replay(self, inputs, grad_output):
        """Copies fresh numbers into the captured buffers and replays: (out, grads)."""
        with torch.no_grad():
            for leaf, name in zip(self.leaves, GRAD_NAMES):
                leaf.copy_(inputs[name])
            self.grad_output.copy_(grad_output)
        self.graph.replay()
        torch.cuda.synchronize()
        return self.out, self.grads


def eager_forward_backward(inputs, shape_tables, grad_output, keywords):
    leaves = [inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES]
    out = run_op(leaves, shape_tables, keywords)
    grads = torch.autograd.grad(out, leaves, grad_output)
    return out.detach(), grads


def shape_tables_of(kind, shapes, inputs):
    if kind == "list":
        return shapes, None
    if kind == "device_tensors":
        return inputs["spatial_shapes"], inputs["level_start_index"]
    return inputs["spatial_shapes"].cpu(), inputs["level_start_index"].cpu()


@pytest.mark.parametrize("shape_tables", ["list", "device_tensors", "cpu_tensors"])
def test_graph_replay_of_forward_and_backward_matches_eager(generator, shape_tables):
    shapes = random_level_shapes(generator, 3, max_side=9, min_side=2)
    case = dict(batch=2, queries=40, heads=2, channels=8, shapes=shapes, points=3,
                dtype=torch.float32, device="cuda", kink_free=True)
    static = make_inputs(generator, **case)
    tables = shape_tables_of(shape_tables, shapes, static)
    step = CapturedStep(static, tables, {})
    for _ in range(2):
        fresh = make_inputs(generator, **case)
        grad_output = random_grad_output(generator, step.out)
        out, grads = step.replay(fresh, grad_output)
        eager_out, eager_grads = eager_forward_backward(fresh, tables, grad_output, {})
        assert torch.equal(out, eager_out)  # the forward has no atomics
        assert rel_l2(out, oracle_forward(fresh)) < 1e-6
        expected = oracle_backward(fresh, grad_output)
        for name, grad, eager, e in zip(GRAD_NAMES, grads, eager_grads, expected):
            assert rel_l2(grad, eager) < 1e-6, name  # grad_value's atomics vary the last bits
            assert rel_l2(grad, e) < 1e-5, name


def test_graph_replay_of_forward_alone_matches_oracle(generator):
    # No input requires a gradient: autograd records nothing around the captured forward.
    case = dict(batch=2, queries=11, heads=3, channels=9, points=3,
                shapes=random_level_shapes(generator, 3, max_side=10, min_side=2))
    static = make_inputs(generator, **case, dtype=torch.float32, device="cuda")
    warmup = torch.cuda.Stream()
    warmup.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(warmup):
        for _ in range(2):
            run_msda(static)
    torch.cuda.current_stream().wait_stream(warmup)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_msda(static)
    for _ in range(2):  # replay on fresh inputs copied into the captured buffers
        fresh = make_inputs(generator, **case, dtype=torch.float32, device="cuda")
        for name in ("value", "sampling_locations", "attention_weights"):
            static[name].copy_(fresh[name])
        graph.replay()
        torch.cuda.synchronize()
        assert rel_l2(out, oracle_forward(fresh)) < 1e-6


# (shapes, queries, points per level): an encoder (Q = S, Q * NP >= 2 * S) takes the aggregated
# backward; a small decoder the direct backward in f32 and, in bf16, the per-point backward with
# each item's 8 points sliced over two blocks (grid.y = 2).
ZEROED_PROBLEMS = {"aggregated": ([(6, 8), (3, 4)], 60, 2),
                   "decoder": ([(12, 16), (6, 8)], 20, 4)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("problem", list(ZEROED_PROBLEMS))
def test_graph_replay_of_the_dependent_backward_matches_eager(generator, problem, dtype):
    # Both backwards are launched on sm_90 as the programmatic dependent of the kernel that
    # zeroes grad_value: the captured graph must keep that pair, zeroing grad_value again on
    # every replay.
    shapes, queries, points = ZEROED_PROBLEMS[problem]
    case = dict(batch=2, queries=queries, heads=2, channels=32, shapes=shapes, points=points,
                dtype=dtype, device="cuda", kink_free=True)
    tables = (shapes, None)
    step = CapturedStep(make_inputs(generator, **case), tables, {})
    for _ in range(3):
        fresh = make_inputs(generator, **case)
        grad_output = random_grad_output(generator, step.out)
        out, grads = step.replay(fresh, grad_output)
        eager_out, eager_grads = eager_forward_backward(fresh, tables, grad_output, {})
        assert torch.equal(out, eager_out)
        expected = oracle_backward(fresh, grad_output)
        for name, grad, eager, e in zip(GRAD_NAMES, grads, eager_grads, expected):
            if dtype == torch.float32:  # grad_value's atomics vary the last bits
                assert rel_l2(grad, eager) < 1e-6, name
                assert rel_l2(grad, e) < 1e-5, name
            else:  # one bf16 rounding per atomic sum: both about 2^-8 from the oracle
                assert rel_l2(grad, e) < 2.0 ** -6, name
                assert rel_l2(grad, e) < 2 * rel_l2(eager, e) + 2.0 ** -9, name


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_graph_replay_of_deterministic_backward_is_bitwise_eager(generator, dtype):
    shapes = [(4, 4), (2, 3)]  # small maps, many queries: many samples share each pixel
    case = dict(batch=2, queries=300, heads=2, channels=8, shapes=shapes, points=4,
                dtype=dtype, device="cuda")
    keywords = dict(deterministic=True)
    tables = (shapes, None)
    step = CapturedStep(make_inputs(generator, **case), tables, keywords)
    fresh = make_inputs(generator, **case)
    grad_output = random_grad_output(generator, step.out)
    out, grads = step.replay(fresh, grad_output)
    eager_out, eager_grads = eager_forward_backward(fresh, tables, grad_output, keywords)
    assert torch.equal(out, eager_out)
    for name, grad, eager in zip(GRAD_NAMES, grads, eager_grads):
        assert torch.equal(grad, eager), name


def test_make_graphed_callables_detr_module_matches_eager(generator):
    torch.manual_seed(4321)
    shapes = [(8, 6), (4, 3)]
    S = 8 * 6 + 4 * 3
    module = pymsda.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=2)
    with torch.no_grad():  # off its init, so that every parameter gets a real gradient
        for parameter in module.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    module = module.cuda()
    eager_module = copy.deepcopy(module)
    spatial_shapes = torch.tensor(shapes, device="cuda")
    level_start_index = torch.tensor([0, 48], device="cuda")

    def draw():
        query = torch.randn(2, 20, 32, generator=generator).cuda().requires_grad_(True)
        reference_points = torch.rand(2, 20, 2, 2, generator=generator).cuda()
        flatten = torch.randn(2, S, 32, generator=generator).cuda().requires_grad_(True)
        return query, reference_points, flatten, spatial_shapes, level_start_index

    graphed = torch.cuda.make_graphed_callables(module, draw())
    for _ in range(2):
        args = draw()
        grad_output = torch.randn(2, 20, 32, generator=generator).cuda()
        out = graphed(*args)
        out.backward(grad_output)
        eager_args = [a.detach().clone().requires_grad_(a.requires_grad) for a in args]
        eager_out = eager_module(*eager_args)
        eager_out.backward(grad_output)
        torch.cuda.synchronize()
        assert rel_l2(out, eager_out) < 1e-6
        for i in (0, 2):  # query and input_flatten
            assert rel_l2(args[i].grad, eager_args[i].grad) < 1e-5, i
        for (name, p), q in zip(module.named_parameters(), eager_module.parameters()):
            assert rel_l2(p.grad, q.grad) < 1e-5, name
            p.grad = q.grad = None


def test_list_shapes_first_seen_in_a_capture_are_refused_with_advice(generator):
    shapes = [(7, 11), (5, 13)]  # used by no other test: not in the cache
    inputs = make_inputs(generator, 1, 4, 1, 4, shapes, 2, dtype=torch.float32, device="cuda")
    value, loc, attn = (inputs[k] for k in GRAD_NAMES)
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="before capturing"):
        with torch.cuda.graph(graph):
            pymsda.ms_deform_attn(value, shapes, None, loc, attn)
    # after a warm-up outside capture, the same call captures and replays
    pymsda.ms_deform_attn(value, shapes, None, loc, attn)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = pymsda.ms_deform_attn(value, shapes, None, loc, attn)
    graph.replay()
    torch.cuda.synchronize()
    assert rel_l2(out, oracle_forward(inputs)) < 1e-6

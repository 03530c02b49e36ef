"""tests/test_cuda.py: what only the CUDA path can get wrong: agreement with the CPU path, the
current (non-default) stream, no host-device synchronisation, and a Deformable-DETR-sized case
(a second GPU: tests/test_multigpu.py; CUDA graphs: tests/test_cuda_graphs.py). Everything here
skips without a GPU (conftest.requires_cuda); accuracy per dtype on CUDA is covered by the "cuda"
cases of test_forward/test_backward.
"""
import pytest
import torch

import pymsda
from pymsda.reference import ms_deform_attn_pytorch
from conftest import requires_cuda
from factories import (GRAD_NAMES, TABLE_CHANGES, change_tables, forward_and_grads,
                       make_inputs, oracle_backward, oracle_forward, random_grad_output,
                       random_level_shapes, rel_l2, run_msda)

pytestmark = requires_cuda


def moved(inputs, device):
    return {k: v.to(device) for k, v in inputs.items()}


def small_case(generator):
    return dict(batch=2, queries=11, heads=3, channels=9, points=3,
                shapes=random_level_shapes(generator, 3, max_side=10, min_side=2))


def test_cuda_matches_cpu_forward_and_backward_f64(generator):
    inputs = make_inputs(generator, **small_case(generator), kink_free=True)
    grad_output = random_grad_output(generator, run_msda(inputs))
    cpu_out, cpu_grads = forward_and_grads(inputs, grad_output)
    cuda_out, cuda_grads = forward_and_grads(moved(inputs, "cuda"), grad_output.cuda())
    assert cuda_out.is_cuda and all(g.is_cuda for g in cuda_grads)
    assert rel_l2(cuda_out, cpu_out) < 1e-12
    for name, c, g in zip(GRAD_NAMES, cpu_grads, cuda_grads):
        assert rel_l2(g, c) < 1e-11, name


def _sleep_on_current_stream():
    # Keep the current stream busy so that work wrongly put on another stream runs first.
    if hasattr(torch.cuda, "_sleep"):
        torch.cuda._sleep(100_000_000)


def test_forward_and_backward_run_on_the_current_stream(generator):
    inputs = make_inputs(generator, **small_case(generator), dtype=torch.float32, device="cuda",
                         kink_free=True)
    new_value = torch.randn(inputs["value"].shape, generator=generator).cuda()
    grad_output = random_grad_output(generator, run_msda(inputs))
    stream = torch.cuda.Stream()
    assert stream != torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        _sleep_on_current_stream()
        value = inputs["value"].clone()
        value.copy_(new_value)  # ordered after the sleep, on `stream` only
        value.requires_grad_(True)
        out = run_msda(inputs, value=value)
        out.backward(grad_output)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    expected_inputs = dict(inputs, value=new_value)
    assert rel_l2(out, oracle_forward(expected_inputs)) < 1e-6
    grad_value = oracle_backward(expected_inputs, grad_output)[0]
    assert rel_l2(value.grad, grad_value) < 1e-5


@pytest.mark.caching_allocator  # (without it, freeing a tensor is a synchronising cudaFree)
def test_forward_and_backward_do_not_synchronise(generator):
    # Device-side shape tensors are the normal path: no .item()/.cpu()/.tolist() may happen.
    inputs = make_inputs(generator, **small_case(generator), dtype=torch.float32, device="cuda",
                         kink_free=True)
    leaves = {k: inputs[k].clone().requires_grad_(True) for k in GRAD_NAMES}
    grad_output = random_grad_output(generator, run_msda(inputs))
    run_msda(inputs, **leaves).backward(grad_output)  # warm-up (library load, lazy init)
    previous = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = run_msda(inputs, **leaves)
        out.backward(grad_output)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    assert rel_l2(out, oracle_forward(inputs)) < 1e-6


def test_cuda_value_with_cpu_spatial_shapes_and_derived_start_index(generator):
    inputs = make_inputs(generator, **small_case(generator), device="cuda")
    out = run_msda(inputs, spatial_shapes=inputs["spatial_shapes"].cpu(), level_start_index=None)
    assert out.is_cuda and rel_l2(out, oracle_forward(inputs)) < 1e-12


def test_cuda_value_with_device_spatial_shapes_int32_and_no_start_index(generator):
    inputs = make_inputs(generator, **small_case(generator), device="cuda",
                         index_dtype=torch.int32)
    out = run_msda(inputs, level_start_index=None)
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12


def test_device_spatial_shapes_changed_in_place_are_seen(generator):
    # Level starts derived from a device spatial_shapes tensor must follow an in-place change
    # (same S), also one made through .data (which leaves the version counter alone), and a
    # new tensor with other shapes.
    inputs = make_inputs(generator, batch=2, queries=5, heads=2, channels=8, points=2,
                         shapes=[(4, 6), (2, 3)], device="cuda")
    shapes = inputs["spatial_shapes"].clone()
    assert rel_l2(run_msda(inputs, spatial_shapes=shapes, level_start_index=None),
                  oracle_forward(inputs)) < 1e-12
    for new, through_data in (([(6, 4), (3, 2)], False), ([(3, 8), (1, 6)], True)):
        (shapes.data if through_data else shapes).copy_(torch.tensor(new))
        expected = oracle_forward(dict(inputs, spatial_shapes=torch.tensor(new)))
        out = run_msda(inputs, spatial_shapes=shapes, level_start_index=None)
        assert rel_l2(out, expected) < 1e-12, new
    other = torch.tensor([(2, 12), (3, 2)], device="cuda")
    expected = oracle_forward(dict(inputs, spatial_shapes=other.cpu()))
    assert rel_l2(run_msda(inputs, spatial_shapes=other, level_start_index=None), expected) < 1e-12


@pytest.mark.parametrize("dtype,channels", [(torch.float32, 32), (torch.bfloat16, 32),
                                            (torch.float32, 5), (torch.float64, 8)],
                         ids=["f32-fast", "bf16-fast", "f32-generic", "f64-generic"])
@pytest.mark.parametrize("encoder", [False, True], ids=["decoder", "encoder"])
def test_device_shapes_without_start_index_equal_given_starts_bitwise(generator, dtype,
                                                                      channels, encoder):
    # Without level_start_index the starts are derived on the device (msda_level_starts);
    # every kernel must then compute exactly what it computes with the starts given
    # (deterministic backward, so that grad_value's sums are order-free too).
    shapes = [(9, 11), (5, 6), (3, 3)]
    queries = sum(h * w for h, w in shapes) if encoder else 37
    inputs = make_inputs(generator, 2, queries, 2, channels, shapes, 3, dtype=dtype,
                         device="cuda")
    grad_output = torch.randn(2, queries, 2 * channels, generator=generator).to("cuda", dtype)
    results = []
    for starts in (inputs["level_start_index"], None):
        leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES}
        out = pymsda.ms_deform_attn(leaves["value"], inputs["spatial_shapes"], starts,
                                    leaves["sampling_locations"], leaves["attention_weights"],
                                    deterministic=True)
        out.backward(grad_output)
        results.append([out] + [leaves[k].grad for k in GRAD_NAMES])
    for name, given, derived in zip(("out", *GRAD_NAMES), *results):
        assert torch.equal(given, derived), name
    assert rel_l2(results[1][0], oracle_forward(inputs)) < (1e-2 if dtype == torch.bfloat16
                                                           else 1e-6)


def test_device_tables_passed_again_follow_every_change(generator):
    # The op remembers device tables it reads as they are (both given, one dtype); passing the
    # same tensors again must still follow a change of their numbers, in place, through .data
    # or by .data = (a new pointer), and not leak a stale pointer.
    inputs = make_inputs(generator, batch=2, queries=5, heads=2, channels=8, points=2,
                         shapes=[(4, 6), (2, 3)], device="cuda")
    shapes = inputs["spatial_shapes"].clone()
    starts = inputs["level_start_index"].clone()
    for _ in range(2):
        out = run_msda(inputs, spatial_shapes=shapes, level_start_index=starts)
        assert rel_l2(out, oracle_forward(inputs)) < 1e-12
    for new, how in zip(([(6, 4), (3, 2)], [(3, 8), (1, 6)], [(2, 12), (3, 2)]),
                        TABLE_CHANGES):
        change_tables(shapes, starts, new, how)
        torch.cuda.empty_cache()  # old tables' memory (after .data =) goes back to the driver
        expected = oracle_forward(dict(inputs, spatial_shapes=torch.tensor(new)))
        for _ in range(2):
            out = run_msda(inputs, spatial_shapes=shapes, level_start_index=starts)
            assert rel_l2(out, expected) < 1e-12, how


def test_deformable_detr_sized_encoder_case_f32(generator):
    # Many blocks and queries; the f64 reference on the GPU is the yardstick (numpy would be
    # slow at this size). Kink-free locations keep f32-vs-f64 gradient comparisons meaningful.
    shapes = [(100, 150), (50, 75), (25, 38), (13, 19)]
    total = sum(h * w for h, w in shapes)
    inputs64 = make_inputs(generator, 2, total, 8, 32, shapes, 4, device="cuda", kink_free=True)
    inputs32 = {k: (v.float() if v.is_floating_point() else v) for k, v in inputs64.items()}
    grad_output = torch.randn(2, total, 256, generator=generator, dtype=torch.float64).cuda()

    def reference(inputs):
        leaves = {k: inputs[k].clone().requires_grad_(True) for k in GRAD_NAMES}
        out = ms_deform_attn_pytorch(leaves["value"], inputs["spatial_shapes"],
                                     leaves["sampling_locations"], leaves["attention_weights"])
        out.backward(grad_output.to(out.dtype))
        return out.detach(), [leaves[k].grad for k in GRAD_NAMES]

    exact_out, exact_grads = reference({k: (v.double() if v.is_floating_point() else v)
                                        for k, v in inputs32.items()})
    reference_out, reference_grads = reference(inputs32)
    out, grads = forward_and_grads(inputs32, grad_output.float())
    assert rel_l2(out, exact_out) <= 2 * rel_l2(reference_out, exact_out) + 1e-7
    for name, g, r, e in zip(GRAD_NAMES, grads, reference_grads, exact_grads):
        assert rel_l2(g, e) <= 2 * rel_l2(r, e) + 1e-6, name

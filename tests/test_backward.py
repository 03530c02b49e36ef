"""tests/test_backward.py: gradients of pymsda.ms_deform_attn to value, sampling_locations and
attention_weights: torch.autograd.gradcheck in f64, and every dtype against the hand-derived numpy
f64 oracle gradients (tests/oracle.py).

Locations come from factories.kink_free_locations: bilinear sampling has kinks where a pixel
coordinate crosses an integer, where neither finite differences nor a rounded location can be
trusted; away from them the gradient is smooth and unique.
Bounds: f64 1e-11; f32 < 1e-5; f16/bf16 no worse than twice the error of the reference's own
gradients (autograd through grid_sample) computed in the same dtype.
"""
import itertools

import pytest
import torch

import pymsda
from pymsda.reference import ms_deform_attn_pytorch
from conftest import DEVICES, skip_unless_grid_sample_supports
from factories import (GRAD_NAMES, HALF_DTYPES, loose_bound, make_inputs, oracle_backward,
                       random_grad_output, random_level_shapes, rel_l2)

def random_case(generator, max_side=10):
    return dict(batch=2, queries=9, heads=2, channels=5, points=3,
                shapes=random_level_shapes(generator, 3, max_side=max_side, min_side=2))


def grads_of(function, inputs, grad_output, names=GRAD_NAMES):
    """Gradients of function's output to inputs[name] for name in names (a dict)."""
    leaves = {k: inputs[k].detach().clone().requires_grad_(k in names) for k in GRAD_NAMES}
    out = function(leaves["value"], inputs["spatial_shapes"], inputs["level_start_index"],
                   leaves["sampling_locations"], leaves["attention_weights"])
    out.backward(grad_output)
    return {k: leaves[k].grad for k in GRAD_NAMES}


def reference_with_start_index(value, spatial_shapes, level_start_index, locations, weights):
    return ms_deform_attn_pytorch(value, spatial_shapes, locations, weights)


def output_like(inputs):
    B, Q, H = inputs["attention_weights"].shape[:3]
    C = inputs["value"].shape[-1]
    return torch.empty(B, Q, H * C, dtype=inputs["value"].dtype, device=inputs["value"].device)


# ---- gradcheck ---------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", [
    dict(batch=2, queries=3, heads=2, channels=3, shapes=[(3, 4), (2, 3)], points=2),
    dict(batch=1, queries=2, heads=1, channels=1, shapes=[(1, 1), (4, 2), (2, 5)], points=1),
], ids=["two_levels", "odd_sizes"])
def test_gradcheck_f64(generator, device, case):
    inputs = make_inputs(generator, **case, device=device, kink_free=True)
    leaves = tuple(inputs[k].clone().requires_grad_(True) for k in GRAD_NAMES)

    def function(value, locations, weights):
        return pymsda.ms_deform_attn(value, inputs["spatial_shapes"],
                                     inputs["level_start_index"], locations, weights)

    assert torch.autograd.gradcheck(function, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


# ---- gradients vs the oracle, per dtype ---------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,bound", [(torch.float64, 1e-11), (torch.float32, 1e-5)],
                         ids=["f64", "f32"])
def test_gradients_match_f64_oracle(generator, device, dtype, bound):
    inputs = make_inputs(generator, **random_case(generator), dtype=dtype, device=device,
                         kink_free=True)
    grad_output = random_grad_output(generator, output_like(inputs))
    actual = grads_of(pymsda.ms_deform_attn, inputs, grad_output)
    expected = oracle_backward(inputs, grad_output)
    for name, e in zip(GRAD_NAMES, expected):
        assert actual[name].dtype == dtype and actual[name].shape == inputs[name].shape, name
        assert rel_l2(actual[name], e) < bound, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["f16", "bf16"])
def test_gradients_half_within_twice_reference_error(generator, device, dtype):
    skip_unless_grid_sample_supports(dtype, device)
    inputs = make_inputs(generator, **random_case(generator), dtype=dtype, device=device,
                         kink_free=True)
    grad_output = random_grad_output(generator, output_like(inputs))
    actual = grads_of(pymsda.ms_deform_attn, inputs, grad_output)
    reference = grads_of(reference_with_start_index, inputs, grad_output)
    expected = oracle_backward(inputs, grad_output)
    for name, e in zip(GRAD_NAMES, expected):
        assert actual[name].dtype == dtype, name
        reference_error = rel_l2(reference[name], e)
        error = rel_l2(actual[name], e)
        assert error <= loose_bound(reference_error), (name, error, reference_error)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["f16", "bf16"])
def test_gradients_half_error_is_one_rounding(generator, device, dtype):
    # DESIGN: f16/bf16 accumulate in f32: each point gradient is rounded once, grad_value once
    # (the CPU's f32 buffer) or once per atomic add of an f32 sum into it (CUDA on sm_90: a few
    # per element here), so each gradient's rel-L2 error stays below the dtype's unit roundoff
    # (see test_forward).
    unit_roundoff = {torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[dtype]
    case = random_case(generator)
    case["queries"] = 20  # many samples land on each value pixel: grad_value accumulates
    inputs = make_inputs(generator, **case, dtype=dtype, device=device, kink_free=True)
    grad_output = random_grad_output(generator, output_like(inputs))
    actual = grads_of(pymsda.ms_deform_attn, inputs, grad_output)
    for name, e in zip(GRAD_NAMES, oracle_backward(inputs, grad_output)):
        assert rel_l2(actual[name], e) < unit_roundoff, name


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_shape_variety_f64(generator, device):
    for batch, queries, heads, channels, levels, points in [
        (1, 1, 1, 1, 1, 1), (5, 3, 2, 3, 5, 1), (2, 4, 3, 32, 2, 8), (3, 2, 1, 20, 1, 2),
    ]:
        shapes = random_level_shapes(generator, levels, max_side=7)
        inputs = make_inputs(generator, batch, queries, heads, channels, shapes, points,
                             device=device, kink_free=True)
        grad_output = random_grad_output(generator, output_like(inputs))
        actual = grads_of(pymsda.ms_deform_attn, inputs, grad_output)
        for name, e in zip(GRAD_NAMES, oracle_backward(inputs, grad_output)):
            assert rel_l2(actual[name], e) < 1e-11, (name, batch, channels, levels, points)


# ---- only the gradients asked for --------------------------------------------------------------

SUBSETS = [subset for r in (1, 2) for subset in itertools.combinations(GRAD_NAMES, r)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("names", SUBSETS, ids=["+".join(s) for s in SUBSETS])
def test_only_requested_gradients(generator, device, names):
    inputs = make_inputs(generator, **random_case(generator), device=device, kink_free=True)
    grad_output = random_grad_output(generator, output_like(inputs))
    actual = grads_of(pymsda.ms_deform_attn, inputs, grad_output, names=names)
    for name, e in zip(GRAD_NAMES, oracle_backward(inputs, grad_output)):
        if name in names:
            assert actual[name] is not None, name
            assert rel_l2(actual[name], e) < 1e-11, name
        else:
            assert actual[name] is None, name


# ---- how the gradient is delivered -------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
def test_gradients_with_non_contiguous_grad_output_and_value(generator, device):
    inputs = make_inputs(generator, **random_case(generator), device=device, kink_free=True)
    B, S, H, C = inputs["value"].shape
    base = inputs["value"].permute(0, 2, 1, 3).contiguous().requires_grad_(True)  # (B, H, S, C)
    value = base.transpose(1, 2)
    locations = inputs["sampling_locations"].clone().requires_grad_(True)
    weights = inputs["attention_weights"].clone().requires_grad_(True)
    grad_output = random_grad_output(generator, output_like(inputs))
    wide = torch.zeros(*grad_output.shape[:2], 2 * grad_output.shape[2],
                       dtype=grad_output.dtype, device=device)
    wide[..., 1::2] = grad_output
    strided_grad = wide[..., 1::2]
    assert not strided_grad.is_contiguous()
    out = pymsda.ms_deform_attn(value, inputs["spatial_shapes"], inputs["level_start_index"],
                                locations, weights)
    out.backward(strided_grad)
    grad_value, grad_locations, grad_weights = oracle_backward(inputs, grad_output)
    assert rel_l2(base.grad.transpose(1, 2), grad_value) < 1e-11
    assert rel_l2(locations.grad, grad_locations) < 1e-11
    assert rel_l2(weights.grad, grad_weights) < 1e-11


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_flow_through_mixed_float_dtypes(generator, device):
    # f32 value with f64 locations/weights: the op runs in f32, each gradient comes back in its
    # input's own dtype.
    inputs = make_inputs(generator, **random_case(generator), dtype=torch.float32, device=device,
                         kink_free=True)
    locations = inputs["sampling_locations"].double().requires_grad_(True)
    weights = inputs["attention_weights"].double().requires_grad_(True)
    value = inputs["value"].clone().requires_grad_(True)
    out = pymsda.ms_deform_attn(value, inputs["spatial_shapes"], None, locations, weights)
    assert out.dtype == torch.float32
    grad_output = random_grad_output(generator, out)
    out.backward(grad_output)
    assert locations.grad.dtype == torch.float64 and weights.grad.dtype == torch.float64
    expected = oracle_backward(inputs, grad_output)
    for actual, e in zip((value.grad, locations.grad, weights.grad), expected):
        assert rel_l2(actual, e) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_backward_through_function_apply_and_sum(generator, device):
    inputs = make_inputs(generator, **random_case(generator), device=device, kink_free=True)
    leaves = [inputs[k].clone().requires_grad_(True) for k in GRAD_NAMES]
    out = pymsda.MSDeformAttnFunction.apply(leaves[0], inputs["spatial_shapes"],
                                            inputs["level_start_index"], leaves[1], leaves[2], 64)
    out.sum().backward()
    expected = oracle_backward(inputs, torch.ones_like(out))
    for leaf, e in zip(leaves, expected):
        assert rel_l2(leaf.grad, e) < 1e-11


@pytest.mark.parametrize("device", DEVICES)
def test_gradients_far_outside_the_map_are_zero(generator, device):
    inputs = make_inputs(generator, **random_case(generator), device=device)
    inputs["sampling_locations"] = inputs["sampling_locations"] + 5.0
    grad_output = random_grad_output(generator, output_like(inputs))
    actual = grads_of(pymsda.ms_deform_attn, inputs, grad_output)
    for name in GRAD_NAMES:
        assert torch.count_nonzero(actual[name]) == 0, name


@pytest.mark.parametrize("device", DEVICES)
def test_direct_autograd_apply_matches_the_public_one(generator, device, monkeypatch):
    """Eager calls build their autograd node through the C++ apply of torch._C._FunctionBase
    (pymsda/_op.py, _apply_direct, skipping Function.apply's Python wrapper); the public
    torch.autograd.Function.apply must give the same node type and the same gradients (bit for
    bit but for CUDA's atomically summed grad_value), and the in-place check of saved inputs
    must still fire."""
    from pymsda import _op
    if _op._apply_direct is None:
        pytest.skip("this torch lays out autograd.Function differently: the public apply is used")
    inputs = make_inputs(generator, dtype=torch.float64, device=device, kink_free=True,
                         **random_case(generator))
    grad_output = random_grad_output(generator, output_like(inputs))
    direct = grads_of(pymsda.ms_deform_attn, inputs, grad_output)
    monkeypatch.setattr(_op, "_apply_direct", None)
    public = grads_of(pymsda.ms_deform_attn, inputs, grad_output)
    for name in GRAD_NAMES:
        if device == "cuda" and name == "value":  # float atomics: the order of the sums varies
            assert rel_l2(direct[name], public[name]) < 1e-13, name
        else:
            assert torch.equal(direct[name], public[name]), name
    expected = oracle_backward(inputs, grad_output)
    for name, want in zip(GRAD_NAMES, expected):
        assert rel_l2(direct[name], want) < 1e-11, name
    monkeypatch.undo()
    value = inputs["value"].detach().clone().requires_grad_(True)
    out = pymsda.ms_deform_attn(value * 1.0, inputs["spatial_shapes"], None,
                                inputs["sampling_locations"], inputs["attention_weights"])
    assert type(out.grad_fn).__name__ == "_MSDABackward"
    leaf = inputs["sampling_locations"].detach().clone().requires_grad_(True)
    out = pymsda.ms_deform_attn(inputs["value"], inputs["spatial_shapes"], None, leaf * 1.0,
                                inputs["attention_weights"])
    saved = out.grad_fn.saved_tensors[1]
    with torch.no_grad():
        saved.add_(0.0)  # bumps the version counter of a saved input
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()

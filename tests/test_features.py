"""tests/test_features.py: the options of pymsda.ms_deform_attn beyond the plain op:
num_points_list (per-level point counts, RT-DETRv2), sampling="nearest" (RT-DETRv2's
"discrete") and softmax=True (logits in: composed with torch's softmax), alone and combined.

Checked against the numpy f64 oracle (tests/oracle.py forward_general / backward_general, written
from the math, no torch), with torch.autograd.gradcheck in f64, and for f16/bf16 against twice
the error the pure-PyTorch reference makes in the same dtype. Locations are kink-free (away from
bilinear's kinks and nearest's jumps), so a rounded location samples the same cells.
Bounds: f64 1e-12 (forward) / 1e-11 (gradients); f32 1e-6 / 1e-5.
"""
import ctypes

import numpy as np
import pytest
import torch

import pymsda
from pymsda import _clib
from pymsda.reference import ms_deform_attn_pytorch
import oracle
from conftest import DEVICES, FLOAT_DTYPES
from factories import (GRAD_NAMES, HALF_DTYPES, loose_bound, make_inputs, make_point_inputs,
                       oracle_backward_general, oracle_forward_general, random_grad_output,
                       rel_l2, to_numpy)
from test_lying_tables import LYING  # the lying shape tables the plain path is tested with

SHAPES = [(5, 7), (3, 4), (1, 3), (2, 2)]


# (num_points_list or None for the plain (L, P) layout with 2 points, sampling, softmax)
FEATURES = {
    "counts_unequal": ([3, 1, 2, 4], "bilinear", False),
    "counts_zero_level": ([2, 0, 3, 0], "bilinear", False),
    "counts_equal": ([2, 2, 2, 2], "bilinear", False),
    "nearest": (None, "nearest", False),
    "softmax": (None, "bilinear", True),
    "nearest_softmax": (None, "nearest", True),
    "counts_nearest": ([1, 3, 0, 2], "nearest", False),
    "counts_softmax": ([4, 0, 1, 1], "bilinear", True),
    "counts_nearest_softmax": ([2, 1, 3, 1], "nearest", True),
    "counts_equal_softmax": ([3, 3, 3, 3], "bilinear", True),
}

BOUNDS = {torch.float64: (1e-12, 1e-11), torch.float32: (1e-6, 1e-5)}


def feature_inputs(generator, feature, dtype=torch.float64, device="cpu", batch=2, queries=7,
                   heads=3, channels=5, shapes=SHAPES):
    num_points_list, sampling, softmax = FEATURES[feature]
    counts = num_points_list if num_points_list is not None else [2] * len(shapes)
    inputs = make_point_inputs(generator, batch, queries, heads, channels, shapes, counts,
                               dtype=dtype, device=device, logits=softmax)
    if num_points_list is None:  # the plain (B, Q, H, L, P, ...) layout
        B, Q, H, N = inputs["attention_weights"].shape
        inputs["sampling_locations"] = inputs["sampling_locations"].reshape(
            B, Q, H, len(shapes), N // len(shapes), 2)
        inputs["attention_weights"] = inputs["attention_weights"].reshape(
            B, Q, H, len(shapes), N // len(shapes))
    options = dict(num_points_list=num_points_list, sampling=sampling, softmax=softmax)
    return inputs, options


def oracle_options(options):
    return dict(num_points_list=options["num_points_list"],
                nearest=options["sampling"] == "nearest", softmax=options["softmax"])


def run(inputs, options, leaves=None):
    t = leaves or inputs
    return pymsda.ms_deform_attn(t["value"], inputs["spatial_shapes"],
                                 inputs["level_start_index"], t["sampling_locations"],
                                 t["attention_weights"], **options)


def run_reference(inputs, options, leaves=None):
    t = leaves or inputs
    return ms_deform_attn_pytorch(t["value"], inputs["spatial_shapes"], t["sampling_locations"],
                                  t["attention_weights"], **options)


def run_reference_in_dtype(inputs, options, leaves=None):
    """The reference in the inputs' dtype; where the running torch lacks a half kernel on this
    device (torch 1.13's CPU grid_sample), what such a run would do at best: computed in f32
    from the rounded inputs, output rounded to the dtype (as factories.reference_in_dtype)."""
    try:
        return run_reference(inputs, options, leaves)
    except (RuntimeError, NotImplementedError):
        t = leaves or inputs
        promoted = {k: t[k].float() for k in GRAD_NAMES}
        return run_reference(inputs, options, promoted).to(t["value"].dtype)


def grads_of(function, inputs, options, grad_output):
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES}
    function(inputs, options, leaves).backward(grad_output)
    return {k: leaves[k].grad for k in GRAD_NAMES}  # None where no gradient flows


# ---- forward and gradients against the f64 oracle ------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_forward_matches_f64_oracle(generator, device, dtype, feature):
    inputs, options = feature_inputs(generator, feature, dtype, device)
    out = run(inputs, options)
    assert out.shape == (2, 7, 3 * 5) and out.dtype == dtype and out.device.type == device
    expected = oracle_forward_general(inputs, **oracle_options(options))
    assert rel_l2(out, expected) < BOUNDS[dtype][0]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_gradients_match_f64_oracle(generator, device, dtype, feature):
    inputs, options = feature_inputs(generator, feature, dtype, device)
    grad_output = random_grad_output(generator, run(inputs, options))
    actual = grads_of(run, inputs, options, grad_output)
    expected = oracle_backward_general(inputs, grad_output, **oracle_options(options))
    for name, e in zip(GRAD_NAMES, expected):
        if name == "sampling_locations" and options["sampling"] == "nearest":
            # piecewise constant in the location: None, as RT-DETRv2's integer cast gives
            assert actual[name] is None
            continue
        assert actual[name].dtype == dtype and actual[name].shape == inputs[name].shape, name
        assert rel_l2(actual[name], e) < BOUNDS[dtype][1], name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", HALF_DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("feature", ["counts_unequal", "nearest", "softmax",
                                     "counts_nearest_softmax"])
def test_half_within_twice_reference_error(generator, device, dtype, feature):
    """Forward and gradients in f16/bf16 no worse than twice the error of the pure-PyTorch
    reference run in the same dtype, both measured against the f64 oracle."""
    inputs, options = feature_inputs(generator, feature, dtype, device, channels=16)
    out = run(inputs, options)
    assert out.dtype == dtype
    expected = oracle_forward_general(inputs, **oracle_options(options))
    reference_error = rel_l2(run_reference_in_dtype(inputs, options), expected)
    assert rel_l2(out, expected) < loose_bound(reference_error)

    grad_output = random_grad_output(generator, out)
    actual = grads_of(run, inputs, options, grad_output)
    reference = grads_of(run_reference_in_dtype, inputs, options, grad_output)
    expected = oracle_backward_general(inputs, grad_output, **oracle_options(options))
    for name, e in zip(GRAD_NAMES, expected):
        if name == "sampling_locations" and options["sampling"] == "nearest":
            assert actual[name] is None and reference[name] is None
            continue
        assert actual[name].dtype == dtype, name
        bound = loose_bound(rel_l2(reference[name], e), floor=1e-3)
        assert rel_l2(actual[name], e) < bound, name


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("feature", list(FEATURES))
def test_gradcheck_f64(generator, device, feature):
    inputs, options = feature_inputs(generator, feature, device=device, batch=2, queries=2,
                                     heads=2, channels=3, shapes=[(3, 4), (2, 3), (1, 1), (2, 2)])
    names = [k for k in GRAD_NAMES
             if not (k == "sampling_locations" and options["sampling"] == "nearest")]
    leaves = tuple(inputs[k].clone().requires_grad_(True) for k in names)

    def function(*tensors):
        given = dict(inputs, **dict(zip(names, tensors)))
        return run(inputs, options, given)

    assert torch.autograd.gradcheck(function, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


@pytest.mark.parametrize("feature", ["counts_zero_level", "nearest_softmax", "counts_softmax"])
def test_oracle_gradients_match_its_finite_differences(generator, feature):
    """The oracle's hand-derived gradients (which the CUDA kernels are checked against too)
    against central differences of the oracle's own forward, in numpy f64."""
    inputs, options = feature_inputs(generator, feature, batch=1, queries=2, heads=2,
                                     channels=3)
    arrays = {k: to_numpy(inputs[k]) for k in GRAD_NAMES}
    shapes = to_numpy(inputs["spatial_shapes"])
    flags = oracle_options(options)
    grad_output = np.random.default_rng(0).standard_normal(
        oracle.forward_general(arrays["value"], shapes, arrays["sampling_locations"],
                               arrays["attention_weights"], **flags).shape)
    analytic = oracle.backward_general(arrays["value"], shapes, arrays["sampling_locations"],
                                       arrays["attention_weights"], grad_output, **flags)
    eps = 1e-6
    for name, grad in zip(GRAD_NAMES, analytic):
        numeric = np.zeros_like(grad)
        for index in np.ndindex(grad.shape):
            loss = []
            for sign in (1, -1):
                moved = dict(arrays)
                moved[name] = arrays[name].copy()
                moved[name][index] += sign * eps
                out = oracle.forward_general(moved["value"], shapes, moved["sampling_locations"],
                                             moved["attention_weights"], **flags)
                loss.append((out * grad_output).sum())
            numeric[index] = (loss[0] - loss[1]) / (2 * eps)
        np.testing.assert_allclose(grad, numeric, rtol=1e-6, atol=1e-8, err_msg=name)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("feature", ["counts_unequal", "nearest_softmax", "counts_softmax"])
def test_matches_pure_pytorch_reference_f64(generator, device, feature):
    """The reference's new options agree with the oracle too (it is what compat modules fall
    back on), forward and gradients."""
    inputs, options = feature_inputs(generator, feature, device=device)
    expected = oracle_forward_general(inputs, **oracle_options(options))
    assert rel_l2(run_reference(inputs, options), expected) < 1e-12
    grad_output = random_grad_output(generator, run(inputs, options))
    reference = grads_of(run_reference, inputs, options, grad_output)
    ours = grads_of(run, inputs, options, grad_output)
    for name in GRAD_NAMES:
        if reference[name] is None:  # nearest sampling's location: no gradient in either
            assert ours[name] is None, name
            continue
        torch.testing.assert_close(ours[name], reference[name], rtol=1e-10, atol=1e-12)


# ---- properties ----------------------------------------------------------------------------------

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_equal_counts_equal_the_plain_layout(generator, device, dtype):
    """num_points_list = [P] * L on (B, Q, H, L*P, ...) inputs is the plain op, bit for bit."""
    inputs = make_inputs(generator, 2, 5, 2, 4, SHAPES, 3, dtype=dtype, device=device)
    plain = pymsda.ms_deform_attn(**inputs)
    flat = dict(inputs, sampling_locations=inputs["sampling_locations"].flatten(3, 4),
                attention_weights=inputs["attention_weights"].flatten(3, 4))
    assert torch.equal(pymsda.ms_deform_attn(**flat, num_points_list=[3] * 4), plain)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
def test_softmax_equals_softmaxed_weights(generator, device, dtype):
    """softmax=True on logits == softmax=False on softmax(logits over all L*P points)."""
    inputs = make_inputs(generator, 2, 6, 3, 5, SHAPES, 2, dtype=dtype, device=device)
    logits = 3.0 * torch.randn(inputs["attention_weights"].shape, generator=generator,
                               dtype=torch.float64).to(device=device, dtype=dtype)
    composed = pymsda.ms_deform_attn(**dict(inputs, attention_weights=logits), softmax=True)
    weights = torch.softmax(logits.flatten(3), -1).view_as(logits)
    separate = pymsda.ms_deform_attn(**dict(inputs, attention_weights=weights))
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(composed, separate, rtol=tol, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_softmax_is_shift_invariant_and_grad_sums_to_zero(generator, device):
    """Adding a constant to every logit of a (b, q, h) changes nothing, and so the logit
    gradients of each (b, q, h) sum to zero."""
    inputs, options = feature_inputs(generator, "counts_softmax", device=device)
    logits = inputs["attention_weights"]
    shift = torch.randn(logits.shape[:3] + (1,), generator=generator,
                        dtype=torch.float64).to(device) * 10
    torch.testing.assert_close(run(dict(inputs, attention_weights=logits + shift), options),
                               run(inputs, options), rtol=1e-12, atol=1e-12)
    leaf = logits.clone().requires_grad_(True)
    out = run(inputs, options, dict(inputs, attention_weights=leaf))
    out.backward(random_grad_output(generator, out))
    torch.testing.assert_close(leaf.grad.sum(-1), torch.zeros_like(leaf.grad.sum(-1)),
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_nearest_reads_the_pixel_and_clamps_each_axis(generator, device, dtype):
    """A location reads the pixel (clamp(floor(x*W + 0.5)), clamp(floor(y*H + 0.5))) of its
    level, exactly; far outside the map it reads the border pixel of each axis (W != H)."""
    shapes = [(3, 5), (4, 2)]
    value = torch.randn(1, 23, 1, 4, generator=generator, dtype=torch.float64).to(device, dtype)
    # (x, y) -> expected pixel (column, row), per level
    cases = [((0.28, 0.4), [(1, 1), (1, 2)]),    # x*W + 0.5: 1.9 / 1.06 -> 1; y*H + 0.5: 1.7 / 2.1
             ((-3.0, 9.0), [(0, 2), (0, 3)]),    # far outside: clamped per axis
             ((9.0, -3.0), [(4, 0), (1, 0)])]
    for (x, y), pixels in cases:
        loc = torch.tensor([x, y], dtype=torch.float64).to(device, dtype).expand(1, 1, 1, 2, 1, 2)
        for level, (column, row) in enumerate(pixels):
            weights = torch.zeros(1, 1, 1, 2, 1, dtype=dtype, device=device)
            weights[..., level, 0] = 1
            out = pymsda.ms_deform_attn(value, shapes, None, loc, weights, sampling="nearest")
            start = 0 if level == 0 else 15
            expected = value[0, start + row * shapes[level][1] + column, 0]
            assert torch.equal(out[0, 0], expected), (x, y, level)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", ["eager", "library_op", "reference"])
def test_nearest_sampling_gives_sampling_locations_no_gradient_not_zeros(generator, device, path):
    """RT-DETRv2's "discrete" sampling casts locations to integers, so the layer that makes the
    offsets gets no gradient (None). A zero gradient would differ: AdamW still decays such a
    parameter. Here the offsets come from a Linear layer and one AdamW step with weight decay
    must leave it unchanged, on the eager path, through the registered library op (what
    torch.compile and torch.export record) and on the pure-PyTorch reference (other devices)."""
    if path == "library_op" and not pymsda.ops.HAS_TORCH_LIBRARY_OPS:
        pytest.skip("torch.library.custom_op needs torch >= 2.4")
    inputs, options = feature_inputs(generator, "counts_nearest", device=device)
    loc = inputs["sampling_locations"]
    offsets = torch.nn.Linear(3, 2, dtype=torch.float64, device=device)
    weights = inputs["attention_weights"].detach().clone().requires_grad_(True)
    value = inputs["value"].detach().clone().requires_grad_(True)
    moved = loc + offsets(torch.ones(*loc.shape[:-1], 3, dtype=torch.float64, device=device))
    counts = options["num_points_list"]
    if path == "eager":
        out = pymsda.ms_deform_attn(value, inputs["spatial_shapes"], None, moved, weights,
                                    num_points_list=counts, sampling="nearest")
    elif path == "library_op":
        out = torch.ops.pymsda.ms_deform_attn_forward(
            value, inputs["spatial_shapes"], inputs["level_start_index"], moved, weights,
            counts, _clib.FLAG_NEAREST)
    else:
        out = ms_deform_attn_pytorch(value, inputs["spatial_shapes"], moved, weights,
                                     num_points_list=counts, sampling="nearest")
    before = [p.detach().clone() for p in offsets.parameters()]
    optimizer = torch.optim.AdamW(list(offsets.parameters()) + [value, weights], lr=0.1,
                                  weight_decay=0.5)
    out.square().sum().backward()
    assert all(p.grad is None for p in offsets.parameters())
    assert value.grad is not None and weights.grad is not None
    assert torch.count_nonzero(weights.grad) > 0
    optimizer.step()
    assert all(torch.equal(p, b) for p, b in zip(offsets.parameters(), before))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("feature", ["counts_unequal", "nearest", "counts_nearest_softmax"])
def test_non_finite_locations_contribute_nothing(generator, device, feature):
    """A NaN/inf location adds nothing to the output, scatters nothing into grad_value and gets
    a zero location gradient (and a zero weight gradient without softmax)."""
    inputs, options = feature_inputs(generator, feature, device=device)
    loc = inputs["sampling_locations"].clone()
    bad = loc.flatten(0, -2)
    bad[::3, 0] = float("nan")
    bad[1::3, 1] = float("inf")
    bad[2::6, 0] = float("-inf")
    broken = bad.view(-1, 2).isnan().any(-1) | bad.view(-1, 2).isinf().any(-1)
    inputs_bad = dict(inputs, sampling_locations=bad.view_as(loc))
    # the same problem with those points' weights zeroed (softmax: logits at -inf)
    mask = broken.view(inputs["attention_weights"].shape)
    silent = inputs["attention_weights"].masked_fill(
        mask, float("-inf") if options["softmax"] else 0.0)
    inputs_silent = dict(inputs, attention_weights=silent)
    out = run(inputs_bad, options)
    assert torch.isfinite(out).all()
    if options["softmax"]:
        # the broken points still share the normalisation: compare with the oracle instead
        # (its nearest sampling reads nothing at a non-finite location; its bilinear one needs
        # the location moved far outside the map for the same effect)
        far = loc.masked_fill(mask[..., None].expand_as(loc), 100.0)
        oracle_inputs = inputs_bad if options["sampling"] == "nearest" else dict(
            inputs_bad, sampling_locations=far)
        assert rel_l2(out, oracle_forward_general(oracle_inputs, **oracle_options(options))) < 1e-12
    else:
        torch.testing.assert_close(out, run(inputs_silent, options), rtol=1e-12, atol=1e-12)
    grad_output = random_grad_output(generator, out)
    grads = grads_of(run, inputs_bad, options, grad_output)
    assert all(torch.isfinite(g).all() for g in grads.values() if g is not None)
    if options["sampling"] == "nearest":
        assert grads["sampling_locations"] is None
    else:
        assert torch.count_nonzero(grads["sampling_locations"].view(-1, 2)[broken.view(-1)]) == 0
    if not options["softmax"]:
        assert torch.count_nonzero(grads["attention_weights"][mask]) == 0
        clean = grads_of(run, inputs_silent, options, grad_output)
        torch.testing.assert_close(grads["value"], clean["value"], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("feature", ["counts_unequal", "nearest_softmax", "counts_softmax"])
def test_cpu_results_do_not_depend_on_thread_count(generator, feature):
    """Large enough for the threaded path; forward and every gradient bit-identical with 1 and
    2 threads (the backward partitions grad_value by (b, h): no races, no reordering)."""
    inputs, options = feature_inputs(generator, feature, torch.float32, batch=3, queries=120,
                                     heads=4, channels=9)
    grad_output = random_grad_output(generator, run(inputs, options))
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            results.append((run(inputs, options), grads_of(run, inputs, options, grad_output)))
    finally:
        torch.set_num_threads(threads)
    (out1, grads1), (out2, grads2) = results
    assert torch.equal(out1, out2)
    for name in GRAD_NAMES:
        assert (grads1[name] is None and grads2[name] is None
                or torch.equal(grads1[name], grads2[name])), name
    expected = oracle_backward_general(inputs, grad_output, **oracle_options(options))
    assert rel_l2(grads2["value"], expected[0]) < 1e-5


@pytest.mark.parametrize("device", DEVICES)
def test_only_some_gradients_requested(generator, device):
    """Each gradient alone equals the same gradient computed with all three."""
    inputs, options = feature_inputs(generator, "counts_softmax", device=device)
    grad_output = random_grad_output(generator, run(inputs, options))
    full = grads_of(run, inputs, options, grad_output)
    for name in GRAD_NAMES:
        leaves = {k: inputs[k].detach().clone().requires_grad_(k == name) for k in GRAD_NAMES}
        run(inputs, options, leaves).backward(grad_output)
        torch.testing.assert_close(leaves[name].grad, full[name], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("device", DEVICES)
def test_empty_queries_give_empty_output_and_zero_value_grad(generator, device):
    inputs, options = feature_inputs(generator, "counts_nearest_softmax", device=device,
                                     queries=0)
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES}
    out = run(inputs, options, leaves)
    assert out.shape == (2, 0, 15)
    out.sum().backward()
    assert torch.count_nonzero(leaves["value"].grad) == 0


@pytest.mark.parametrize("device", DEVICES)
def test_index_dtype_int32_and_list_shapes(generator, device):
    inputs, options = feature_inputs(generator, "counts_nearest", device=device)
    expected = run(inputs, options)
    as_int32 = dict(inputs, spatial_shapes=inputs["spatial_shapes"].int(),
                    level_start_index=inputs["level_start_index"].int())
    assert torch.equal(run(as_int32, options), expected)
    as_list = dict(inputs, spatial_shapes=SHAPES, level_start_index=None)
    assert torch.equal(run(as_list, options), expected)


# ---- lying shape tables at the C level -----------------------------------------------------------

C_LEVEL_FLAGS = {
    "counts": ([1, 4], 0),
    "counts_nearest": ([0, 5], _clib.FLAG_NEAREST),
    "nearest": (None, _clib.FLAG_NEAREST),
}


@pytest.mark.parametrize("feature", list(C_LEVEL_FLAGS))
@pytest.mark.parametrize("index,table", LYING, ids=[f"{i}-{n}" for n, (i, _) in enumerate(LYING)])
def test_lying_shapes_stay_in_bounds_general_cpu_c_level(generator, index, table, feature):
    """Tables that disagree with value (sizes past 2^40, negative, starts outside [0, S), ...)
    through the general CPU kernels, bypassing the Python checks: outputs stay a convex-bounded
    mix of value entries and every gradient is written and finite (strict under ASan)."""
    counts, flags = C_LEVEL_FLAGS[feature]
    S, H, C, L, Q = 26, 2, 5, 2, 40
    points = sum(counts) if counts else 3
    point_shape = (points,) if counts else (L, points)
    index_dtype = torch.int64 if index == "i64" else torch.int32
    shapes = torch.tensor(table[0], dtype=index_dtype)
    starts = torch.tensor(table[1], dtype=index_dtype)
    value = torch.randn(1, S, H, C, generator=generator)
    locations = torch.rand((1, Q, H) + point_shape + (2,), generator=generator) * 1.4 - 0.2
    locations.view(-1, 2)[::7, 0] = float("nan")
    weights = torch.rand((1, Q, H) + point_shape, generator=generator)
    out = torch.full((1, Q, H, C), float("nan"))
    grads = [torch.full(t.shape, float("nan")) for t in (value, locations, weights)]
    code = _clib.INDEX_I64 if index == "i64" else _clib.INDEX_I32
    level_points = (ctypes.c_int64 * L)(*counts) if counts else None
    args = dict(B=1, S=S, H=H, C=C, L=L, Q=Q, P=points, dtype=_clib.DTYPE_F32, index_dtype=code,
                device=-1, num_threads=2, level_points=level_points, flags=flags,
                value=value.data_ptr(), spatial_shapes=shapes.data_ptr(),
                level_start_index=starts.data_ptr(), sampling_locations=locations.data_ptr(),
                attention_weights=weights.data_ptr())
    assert _clib.lib.msda_forward(_clib.pack_args(**args, output=out.data_ptr())) == _clib.OK
    assert _clib.lib.msda_backward(_clib.pack_args(
        **args, grad_output=torch.ones_like(out).data_ptr(), grad_value=grads[0].data_ptr(),
        grad_sampling_locations=grads[1].data_ptr(),
        grad_attention_weights=grads[2].data_ptr())) == _clib.OK
    bound = weights.flatten(3).sum(-1) * value.abs().max()
    assert (out.abs().amax(-1) <= bound * 1.0001 + 1e-6).all()
    for grad in grads:
        assert torch.isfinite(grad).all()


# ---- bad arguments -------------------------------------------------------------------------------

@pytest.fixture
def counts_inputs(generator):
    inputs, _ = feature_inputs(generator, "counts_unequal")  # num_points_list [3, 1, 2, 4]
    return inputs


@pytest.mark.parametrize("num_points_list,error,match", [
    ([3, 1, 6], ValueError, "num_points_list has 3 entries"),
    ([3, 1, 2, 4, 0], ValueError, "num_points_list has 5 entries"),
    ([3, -1, 4, 4], ValueError, ">= 0"),
    ([3, 1, 2, 3], ValueError, "sums to 9"),
    ([0, 0, 0, 0], ValueError, "positive sum"),
    ([3, 1.5, 2, 3.5], TypeError, "integers"),
    ("abcd", TypeError, "num_points_list"),
    (5, TypeError, "num_points_list"),
], ids=["short", "long", "negative", "sum_mismatch", "all_zero", "fractional", "string",
        "scalar"])
def test_bad_num_points_list_is_refused(counts_inputs, num_points_list, error, match):
    with pytest.raises(error, match=match):
        run(counts_inputs, dict(num_points_list=num_points_list))


def test_num_points_list_needs_the_flat_layout(generator):
    inputs = make_inputs(generator, 1, 2, 1, 3, SHAPES, 2)
    with pytest.raises(ValueError, match="sampling_locations must have 5 dimensions"):
        pymsda.ms_deform_attn(**inputs, num_points_list=[2, 2, 2, 2])


@pytest.mark.parametrize("sampling", ["foo", "Bilinear", "discrete", None, 1])
def test_bad_sampling_is_refused(counts_inputs, sampling):
    with pytest.raises(ValueError, match="sampling must be 'bilinear' or 'nearest'"):
        run(counts_inputs, dict(num_points_list=[3, 1, 2, 4], sampling=sampling))


def test_reference_refuses_bad_sampling(counts_inputs):
    with pytest.raises(ValueError, match="sampling"):
        run_reference(counts_inputs, dict(num_points_list=[3, 1, 2, 4], sampling="foo"))

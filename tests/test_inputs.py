"""tests/test_inputs.py: bad arguments are refused before any C call, with the right exception
type and a message that names the argument: TypeError for a wrong dtype, ValueError for a wrong
ndim, mismatched sizes, inconsistent shapes or a device mismatch.

Where a mismatch involves two arguments, naming either is accepted (the pattern lists both).
The bad-input matrix runs each malformed call on the CPU and on CUDA, and a valid call right
after it, which must still succeed (no sticky CUDA error).
"""
import pytest
import torch

import pymsda
from conftest import DEVICES, requires_cuda
from factories import (SMALL_SHAPES as SHAPES, SMALL_SIZES, TABLE_CHANGES, change_tables,
                       make_inputs, oracle_forward, rel_l2, run_msda, small_inputs)

B, Q, H, C, L, P = SMALL_SIZES


@pytest.fixture
def inputs(generator):
    return small_inputs(generator)


def test_valid_inputs_work(inputs):
    # The baseline every case below perturbs: it must itself be accepted.
    assert rel_l2(run_msda(inputs), oracle_forward(inputs)) < 1e-6


# ---- the bad-input matrix: every call on the CPU and on CUDA, a valid call after it ----------

def _resized(t, dim, size):
    """t with dimension `dim` changed to `size`, same dtype and device."""
    shape = list(t.shape)
    shape[dim] = size
    return torch.zeros(shape, dtype=t.dtype, device=t.device)


def _host_tensor(rows):
    return torch.tensor(rows, dtype=torch.int64)


def _expanded(device, dtype, *shape):
    """A view of `shape` over one element: any size, no memory."""
    return torch.zeros((), dtype=dtype, device=device).expand(*shape)


def _value_past_int64_bytes(i):
    # value (2^21, 2^20, 2^10, 2^10): 2^61 elements, 2^64 bytes at 8 bytes an element.
    dev = i["value"].device
    return dict(value=_expanded(dev, torch.float64, 2 ** 21, 2 ** 20, 2 ** 10, 2 ** 10),
                spatial_shapes=[(1024, 1024)], level_start_index=None,
                sampling_locations=_expanded(dev, torch.float64, 2 ** 21, 1, 2 ** 10, 1, 1, 2),
                attention_weights=_expanded(dev, torch.float64, 2 ** 21, 1, 2 ** 10, 1, 1))


def _output_past_int64_bytes(i):
    # every input fits, but the output (1, 2^30, 2^40) would have 2^70 elements
    dev = i["value"].device
    return dict(value=_expanded(dev, torch.float32, 1, 1, 1, 2 ** 40),
                spatial_shapes=[(1, 1)], level_start_index=None,
                sampling_locations=_expanded(dev, torch.float32, 1, 2 ** 30, 1, 1, 1, 2),
                attention_weights=_expanded(dev, torch.float32, 1, 2 ** 30, 1, 1, 1))


def _cast(name, dtype):
    return lambda i: {name: i[name].to(dtype)}


def _cast_to_named(name, dtype_name):
    """_cast to torch.<dtype_name>; the case skips where this torch lacks it (float8 < 2.1)."""
    def overrides(i):
        dtype = getattr(torch, dtype_name, None)
        if dtype is None:
            pytest.skip(f"torch {torch.__version__} has no torch.{dtype_name}")
        return {name: i[name].to(dtype)}
    return overrides


# (id, overrides of the valid inputs, exception type, pattern the message must contain)
BAD_CALLS = [
    # wrong ndim of each tensor
    ("value_3d", lambda i: dict(value=i["value"].flatten(2)), ValueError, "value"),
    ("value_5d", lambda i: dict(value=i["value"][None]), ValueError, "value"),
    ("locations_5d", lambda i: dict(sampling_locations=i["sampling_locations"][..., 0]),
     ValueError, "sampling_locations"),
    ("weights_6d", lambda i: dict(attention_weights=i["attention_weights"][..., None]),
     ValueError, "attention_weights"),
    ("shapes_1d", lambda i: dict(spatial_shapes=i["spatial_shapes"].flatten()), ValueError,
     "spatial_shapes"),
    ("start_index_2d", lambda i: dict(level_start_index=i["level_start_index"][None]),
     ValueError, "level_start_index"),
    # each size mismatched between tensors
    ("B_locations", lambda i: dict(sampling_locations=_resized(i["sampling_locations"], 0, B + 1)),
     ValueError, "sampling_locations"),
    ("B_weights", lambda i: dict(attention_weights=_resized(i["attention_weights"], 0, B + 1)),
     ValueError, "attention_weights"),
    ("H_value", lambda i: dict(value=_resized(i["value"], 2, H + 1)), ValueError, "value"),
    ("H_weights", lambda i: dict(attention_weights=_resized(i["attention_weights"], 2, H + 1)),
     ValueError, "attention_weights"),
    ("C_zero", lambda i: dict(value=_resized(i["value"], 3, 0)), ValueError, r"C=0 \(value\)"),
    ("L_locations_and_weights", lambda i: dict(
        sampling_locations=_resized(i["sampling_locations"], 3, L + 1),
        attention_weights=_resized(i["attention_weights"], 3, L + 1)),
     ValueError, "spatial_shapes has 2 levels but sampling_locations has L = 3"),
    ("L_weights", lambda i: dict(attention_weights=_resized(i["attention_weights"], 3, L + 1)),
     ValueError, "attention_weights"),
    ("P_weights", lambda i: dict(attention_weights=_resized(i["attention_weights"], 4, P + 1)),
     ValueError, "attention_weights"),
    ("P_zero", lambda i: dict(sampling_locations=_resized(i["sampling_locations"], 4, 0),
                              attention_weights=_resized(i["attention_weights"], 4, 0)),
     ValueError, r"P=0 \(sampling_locations\)"),
    ("Q_weights", lambda i: dict(attention_weights=_resized(i["attention_weights"], 1, Q + 1)),
     ValueError, "attention_weights"),
    ("xy_is_3", lambda i: dict(sampling_locations=_resized(i["sampling_locations"], 5, 3)),
     ValueError, "sampling_locations"),
    # shape tables
    ("shapes_L_by_3", lambda i: dict(spatial_shapes=_resized(i["spatial_shapes"], 1, 3)),
     ValueError, "spatial_shapes"),
    ("shapes_no_levels", lambda i: dict(spatial_shapes=_resized(i["spatial_shapes"], 0, 0)),
     ValueError, "spatial_shapes"),
    ("start_index_too_long",
     lambda i: dict(level_start_index=_resized(i["level_start_index"], 0, L + 1)),
     ValueError, "level_start_index"),
    # (host-side tables: device-side ones are read only with validate=True, tested below)
    ("start_index_values", lambda i: dict(spatial_shapes=_host_tensor(SHAPES),
                                          level_start_index=_host_tensor([0, 19])),
     ValueError, "level_start_index"),
    ("sum_of_sizes_not_S", lambda i: dict(spatial_shapes=_host_tensor([(4, 5), (3, 3)]),
                                          level_start_index=None),
     ValueError, "spatial_shapes"),
    ("level_size_zero", lambda i: dict(spatial_shapes=_host_tensor([(0, 5), (3, 2)])),
     ValueError, "spatial_shapes: level 0"),
    ("level_size_negative", lambda i: dict(spatial_shapes=_host_tensor([(-4, -5), (3, 2)])),
     ValueError, "spatial_shapes: level 0"),
    ("level_size_negative_list", lambda i: dict(spatial_shapes=[(4, 5), (-3, -2)],
                                                level_start_index=None),
     ValueError, "spatial_shapes: level 1"),
    ("shapes_float", _cast("spatial_shapes", torch.float32), TypeError, "spatial_shapes"),
    ("shapes_bool", _cast("spatial_shapes", torch.bool), TypeError, "spatial_shapes"),
    ("start_index_float", _cast("level_start_index", torch.float64), TypeError,
     "level_start_index"),
    ("shapes_list_of_fractions", lambda i: dict(spatial_shapes=[(4.5, 5), (3, 2)],
                                                level_start_index=None),
     TypeError, "spatial_shapes"),
    ("shapes_none", lambda i: dict(spatial_shapes=None, level_start_index=None), TypeError,
     "spatial_shapes"),
    # integer, bool, complex and 8-bit float value / locations / weights
    ("value_int32", _cast("value", torch.int32), TypeError, "value"),
    ("value_bool", _cast("value", torch.bool), TypeError, "value"),
    ("value_complex", _cast("value", torch.complex64), TypeError, "value"),
    ("locations_int64", _cast("sampling_locations", torch.int64), TypeError,
     "sampling_locations"),
    ("locations_bool", _cast("sampling_locations", torch.bool), TypeError, "sampling_locations"),
    ("locations_complex", _cast("sampling_locations", torch.complex128), TypeError,
     "sampling_locations"),
    ("weights_int16", _cast("attention_weights", torch.int16), TypeError, "attention_weights"),
    ("weights_float8", _cast_to_named("attention_weights", "float8_e4m3fn"), TypeError,
     "attention_weights"),
    ("value_numpy", lambda i: dict(value=i["value"].cpu().numpy()), TypeError, "value"),
    # tensors that hold no numbers where numbers are needed
    ("locations_on_meta", lambda i: dict(sampling_locations=i["sampling_locations"].to("meta")),
     ValueError, "sampling_locations"),
    ("shapes_on_meta", lambda i: dict(spatial_shapes=i["spatial_shapes"].to("meta")),
     ValueError, "spatial_shapes"),
    ("start_index_on_meta", lambda i: dict(level_start_index=i["level_start_index"].to("meta")),
     ValueError, "level_start_index"),
    # sizes past what the kernels can index (expanded views: no memory behind them)
    ("value_past_int64_bytes", _value_past_int64_bytes, ValueError, "value"),
    ("output_past_int64_bytes", _output_past_int64_bytes, ValueError, "output"),
]


def test_bad_input_matrix_has_at_least_25_distinct_calls():
    assert len({case[0] for case in BAD_CALLS}) == len(BAD_CALLS) >= 25


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name,overrides,exception,pattern", BAD_CALLS,
                         ids=[case[0] for case in BAD_CALLS])
def test_bad_input_is_refused_naming_the_argument(generator, device, name, overrides,
                                                  exception, pattern):
    inputs = small_inputs(generator, device)
    with pytest.raises(exception, match=pattern):
        run_msda(inputs, **overrides(inputs))
    # The process and the device stay usable: a valid call right after succeeds.
    out = run_msda(inputs)
    if device == "cuda":
        torch.cuda.synchronize()
    assert rel_l2(out, oracle_forward(inputs)) < 1e-6


# ---- dtypes: TypeError (beyond the matrix's cases) ---------------------------------------------

@pytest.mark.parametrize("name,bad", [
    ("value", lambda t: t.to(torch.int64)),
    ("spatial_shapes", lambda t: t.to(torch.float64)),
    ("spatial_shapes", lambda t: t.to(torch.int16)),
    ("level_start_index", lambda t: t.to(torch.float32)),
    ("attention_weights", lambda t: t.to(torch.int32)),
], ids=["value_int64", "shapes_f64", "shapes_int16", "start_index_f32", "weights_int32"])
def test_wrong_dtype_raises_type_error_naming_argument(inputs, name, bad):
    with pytest.raises(TypeError, match=name):
        run_msda(inputs, **{name: bad(inputs[name])})


# ---- ndim: ValueError (beyond the matrix's cases) ----------------------------------------------

@pytest.mark.parametrize("name,bad", [
    ("value", lambda t: t.reshape(B, -1, C)),
    ("spatial_shapes", lambda t: t.unsqueeze(0)),
    ("sampling_locations", lambda t: t.reshape(B, Q, H, L, -1)),
    ("sampling_locations", lambda t: t.unsqueeze(0)),
    ("attention_weights", lambda t: t.reshape(B, Q, H, -1)),
], ids=["value_3d", "shapes_3d", "locations_5d", "locations_7d", "weights_4d"])
def test_wrong_ndim_raises_value_error_naming_argument(inputs, name, bad):
    with pytest.raises(ValueError, match=name):
        run_msda(inputs, **{name: bad(inputs[name])})


@pytest.mark.parametrize("name,layout", [("value", "(B, S, H, C)"),
                                         ("sampling_locations", "(B, Q, H, L, P, 2)"),
                                         ("attention_weights", "(B, Q, H, L, P)")])
def test_wrong_ndim_message_gives_the_expected_layout(inputs, name, layout):
    flat = inputs[name].flatten(-2)  # one dimension short
    with pytest.raises(ValueError) as raised:
        run_msda(inputs, **{name: flat})
    assert str(raised.value).startswith(f"{name} must have {inputs[name].dim()} dimensions "
                                        f"{layout}, got shape {tuple(flat.shape)}")


# ---- mismatched sizes: ValueError (beyond the matrix's cases) ----------------------------------

def _resize(tensor, dim, size):
    """tensor with dimension `dim` changed to `size`. Only shapes matter here; index tensors get
    plausible positive entries (2) so that nothing but the size is wrong about them."""
    shape = list(tensor.shape)
    shape[dim] = size
    if tensor.is_floating_point():
        return torch.rand(shape, dtype=tensor.dtype)
    return torch.full(shape, 2, dtype=tensor.dtype)


@pytest.mark.parametrize("name,dim,size,pattern", [
    ("sampling_locations", 2, H + 1, "sampling_locations|value"),          # H
    ("sampling_locations", 3, L + 1, "sampling_locations|spatial_shapes"),  # L
    ("sampling_locations", 5, 1, "sampling_locations"),                    # (x, y)
    ("value", 0, B + 1, "value|sampling_locations|attention_weights"),
    ("spatial_shapes", 1, 3, "spatial_shapes"),                             # rows not pairs
    ("spatial_shapes", 0, L + 1, "spatial_shapes|sampling_locations|level_start_index"),
    ("level_start_index", 0, L + 1, "level_start_index"),
    ("level_start_index", 0, L - 1, "level_start_index"),
], ids=["locations_H", "locations_L", "locations_x", "value_B", "shapes_3_columns", "shapes_L",
        "start_index_long", "start_index_short"])
def test_mismatched_sizes_raise_value_error_naming_argument(inputs, name, dim, size, pattern):
    bad = _resize(inputs[name], dim, size)
    with pytest.raises(ValueError, match=pattern):
        run_msda(inputs, **{name: bad})


# ---- inconsistent level sizes: ValueError ------------------------------------------------------

def test_sum_of_level_sizes_not_S_raises(inputs):
    with pytest.raises(ValueError, match="spatial_shapes|value"):
        run_msda(inputs, spatial_shapes=torch.tensor([(4, 5), (3, 3)]),
             level_start_index=torch.tensor([0, 20]))
    with pytest.raises(ValueError, match="spatial_shapes|value"):
        run_msda(inputs, value=inputs["value"][:, :-1])


def test_sum_of_level_sizes_not_S_raises_for_list_shapes(inputs):
    with pytest.raises(ValueError, match="spatial_shapes|value"):
        run_msda(inputs, spatial_shapes=[(4, 5), (2, 2)], level_start_index=None)


@pytest.mark.parametrize("starts", [[0, 21], [1, 21], [20, 0]])  # [0, 19]: in the matrix
def test_inconsistent_level_start_index_raises(inputs, starts):
    with pytest.raises(ValueError, match="level_start_index"):
        run_msda(inputs, level_start_index=torch.tensor(starts))


@pytest.mark.parametrize("shapes", [[(0, 5), (3, 2)], [(4, 5), (3, 0)], [(-1, 5), (3, 2)],
                                    [(4, -5), (3, 2)]], ids=["zero_h", "zero_w", "neg_h",
                                                             "neg_w"])
def test_non_positive_level_size_raises(generator, shapes):
    # The value is sized to sum(H*W) of the given rows where that is positive, so only the
    # non-positive size itself is wrong.
    total = max(sum(h * w for h, w in shapes), 1)
    inputs = make_inputs(generator, B, Q, H, C, [(1, total)], P, dtype=torch.float32)
    locations = torch.rand(B, Q, H, 2, P, 2)
    weights = torch.rand(B, Q, H, 2, P)
    with pytest.raises(ValueError, match="spatial_shapes"):
        pymsda.ms_deform_attn(inputs["value"], torch.tensor(shapes), None, locations, weights)
    with pytest.raises(ValueError, match="spatial_shapes"):
        pymsda.ms_deform_attn(inputs["value"], shapes, None, locations, weights)


# ---- tables passed again: remembered, never stale -----------------------------------------------
# The op remembers the level tables of a spatial_shapes / level_start_index pair of tensors it
# has seen; calls that pass the same tensors again must still follow any change of their
# numbers (in place, through .data, which leaves the version counter alone, or by .data =) and
# still refuse tables that stop matching value.

def test_host_tables_changed_between_calls_are_seen(generator):
    inputs = small_inputs(generator)
    shapes, starts = inputs["spatial_shapes"].clone(), inputs["level_start_index"].clone()
    for _ in range(2):
        assert rel_l2(run_msda(inputs, spatial_shapes=shapes, level_start_index=starts),
                      oracle_forward(inputs)) < 1e-6
    for new, how in zip(([(5, 4), (2, 3)], [(2, 10), (6, 1)], [(1, 20), (1, 6)]),
                        TABLE_CHANGES):
        change_tables(shapes, starts, new, how)
        expected = oracle_forward(dict(inputs, spatial_shapes=torch.tensor(new)))
        for level_start_index in (starts, None):
            out = run_msda(inputs, spatial_shapes=shapes, level_start_index=level_start_index)
            assert rel_l2(out, expected) < 1e-6, (how, level_start_index)
    starts.data.copy_(torch.tensor([0, 19]))
    with pytest.raises(ValueError, match="level_start_index"):
        run_msda(inputs, spatial_shapes=shapes, level_start_index=starts)


def test_host_tables_seen_before_still_refuse_another_value(generator):
    inputs = small_inputs(generator)
    run_msda(inputs)
    with pytest.raises(ValueError, match="spatial_shapes|value"):
        run_msda(inputs, value=inputs["value"][:, :-1])
    three_levels = torch.rand(B, Q, H, L + 1, P, 2)
    with pytest.raises(ValueError, match="spatial_shapes|sampling_locations"):
        run_msda(inputs, sampling_locations=three_levels,
                 attention_weights=torch.rand(B, Q, H, L + 1, P))


def test_tables_made_in_inference_mode_work(generator):
    inputs = small_inputs(generator)
    with torch.inference_mode():
        tables = dict(spatial_shapes=torch.tensor(SHAPES),
                      level_start_index=torch.tensor([0, 20]))
        for _ in range(2):
            assert rel_l2(run_msda(inputs, **tables), oracle_forward(inputs)) < 1e-6
    for _ in range(2):
        assert rel_l2(run_msda(inputs, **tables), oracle_forward(inputs)) < 1e-6


@pytest.mark.parametrize("shapes", [[(4, 5, 1), (3, 2, 1)], [4, 5], [(4,), (3,)]],
                         ids=["triples", "flat", "singles"])
def test_list_shapes_not_pairs_raise(inputs, shapes):
    with pytest.raises((ValueError, TypeError), match="spatial_shapes"):
        run_msda(inputs, spatial_shapes=shapes, level_start_index=None)


def test_errors_leave_the_op_usable(inputs):
    # A refused call must not poison later calls (per-thread error state, no global damage).
    with pytest.raises(ValueError):
        run_msda(inputs, sampling_locations=inputs["sampling_locations"][..., :1])
    assert rel_l2(run_msda(inputs), oracle_forward(inputs)) < 1e-6


def test_function_apply_validates_too(inputs):
    with pytest.raises(ValueError, match="sampling_locations"):
        pymsda.MSDeformAttnFunction.apply(
            inputs["value"], inputs["spatial_shapes"], inputs["level_start_index"],
            inputs["sampling_locations"].unsqueeze(0), inputs["attention_weights"], 64)


# ---- devices: ValueError -----------------------------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("name", ["value", "sampling_locations", "attention_weights"])
def test_device_mismatch_raises_value_error_naming_argument(inputs, name):
    on_cuda = {k: (v.cuda() if k in ("value", "sampling_locations", "attention_weights") else v)
               for k, v in inputs.items()}
    on_cuda[name] = inputs[name]  # this one stays on the CPU
    with pytest.raises(ValueError, match=name if name != "value" else
                       "value|sampling_locations|attention_weights"):
        run_msda(on_cuda)


@requires_cuda
@pytest.mark.parametrize("value_on,moved", [
    ("cuda", "sampling_locations"), ("cuda", "attention_weights"),
    ("cpu", "sampling_locations"), ("cpu", "attention_weights"),
], ids=["cuda_value_cpu_locations", "cuda_value_cpu_weights", "cpu_value_cuda_locations",
        "cpu_value_cuda_weights"])
def test_tensors_on_different_devices_are_refused_cuda(generator, value_on, moved):
    inputs = small_inputs(generator, value_on)
    other = "cpu" if value_on == "cuda" else "cuda"
    with pytest.raises(ValueError, match=moved):
        run_msda(inputs, **{moved: inputs[moved].to(other)})
    out = run_msda(inputs)
    torch.cuda.synchronize()
    assert rel_l2(out, oracle_forward(inputs)) < 1e-6

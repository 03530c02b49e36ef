"""tests/test_reliability.py: pymsda takes any input and answers with a correct result or a clear
exception, leaving the process and the GPU usable (issue 6).

- Lying device-side shape tables: never a read or write outside the tensors (run this file under
  compute-sanitizer memcheck on a GPU: tests/gpu_reliability.sh), and the opt-in validation
  (validate=True or PYMSDA_VALIDATE=1) that checks them with a synchronisation.
- More than 2^31 elements in value and in the output (CUDA, half precision; skipped without the
  memory): sampled outputs and gradients against a direct computation.
"""
import numpy as np
import pytest
import torch

import pymsda
from pymsda import _lib
from conftest import requires_cuda
from factories import SMALL_SIZES, oracle_forward, rel_l2, run_msda, small_inputs as base_inputs

S = 26
B, Q, H, C, L, P = SMALL_SIZES


# ---- shape tables and the opt-in validation ---------------------------------------------------

def test_validate_flag_and_environment_variable_accepted_on_cpu(generator, monkeypatch):
    # On the CPU every table is read anyway; validation must change nothing there.
    inputs = base_inputs(generator, "cpu")
    expected = run_msda(inputs)
    assert torch.equal(pymsda.ms_deform_attn(*(inputs[k] for k in (
        "value", "spatial_shapes", "level_start_index", "sampling_locations",
        "attention_weights")), validate=True), expected)
    monkeypatch.setenv("PYMSDA_VALIDATE", "1")
    assert torch.equal(run_msda(inputs), expected)
    with pytest.raises(ValueError, match="level_start_index"):
        run_msda(inputs, level_start_index=torch.tensor([0, 19]))


def test_environment_variable_is_read_on_every_call(monkeypatch):
    # The op reads PYMSDA_VALIDATE through its own lookup of os.environ (pymsda/_checks.py, _env_reader):
    # setting, changing and removing it after import must all count.
    from pymsda._checks import _validating
    monkeypatch.delenv("PYMSDA_VALIDATE", raising=False)
    assert not _validating(False)
    monkeypatch.setenv("PYMSDA_VALIDATE", "1")
    assert _validating(False)
    monkeypatch.setenv("PYMSDA_VALIDATE", "0")
    assert not _validating(False)
    monkeypatch.setenv("PYMSDA_VALIDATE", "1")
    monkeypatch.delenv("PYMSDA_VALIDATE")
    assert not _validating(False)
    assert _validating(True)


def test_validate_is_keyword_only():
    with pytest.raises(TypeError):
        pymsda.ms_deform_attn(None, None, None, None, None, None, True)


# (spatial_shapes, level_start_index) tables that disagree with value (S = 26) in every way a
# table can: sides past 2^40, 2^24 (the fast path's limit) or 2^31, zero and negative sides,
# starts negative or past S, sums past S.
LYING_TABLES_I64 = [
    ([(2 ** 40 + 1, 2 ** 40 + 1), (3, 2)], [0, 20]),
    ([(2 ** 40, 2 ** 40), (3, 2)], [0, 20]),
    ([(2 ** 24 + 1, 5), (3, 2 ** 31)], [0, 20]),
    ([(-4, 5), (3, -2)], [0, 20]),
    ([(0, 5), (3, 0)], [0, 20]),
    ([(4, 5), (3, 2)], [-7, 20]),
    ([(4, 5), (3, 2)], [0, 1000]),
    ([(4, 5), (3, 2)], [2 ** 63 - 1, -2 ** 63]),
    ([(50, 50), (40, 41)], [0, 2500]),
    ([(4, 5), (3, 2)], [25, 25]),
]
LYING_TABLES_I32 = [
    ([(2 ** 31 - 1, 2 ** 31 - 1), (3, 2)], [0, 20]),
    ([(-2 ** 31, 5), (3, 2)], [0, 20]),
    ([(4, 5), (3, 2)], [2 ** 31 - 1, -2 ** 31]),
    ([(50, 50), (40, 41)], [0, 2500]),
]
LYING = ([("i64", t) for t in LYING_TABLES_I64] + [("i32", t) for t in LYING_TABLES_I32])
# dtype and C: f32 C=8 and bf16 C=4 take the CUDA fast path, f32 C=5 and f64 the generic one
LYING_KINDS = [(torch.float32, 8), (torch.float32, 5), (torch.bfloat16, 4), (torch.float64, 3)]


def _lying_call(generator, device, dtype, channels, index, table, validate=False,
                derived=False):
    index_dtype = torch.int64 if index == "i64" else torch.int32
    shapes, starts = table
    value = torch.randn(1, S, H, channels, generator=generator, dtype=torch.float64)
    locations = torch.rand(1, 40, H, L, P, 2, generator=generator, dtype=torch.float64) * 1.4 - 0.2
    locations[0, 0, 0, 0, :, :] = torch.tensor([0.0, 1.0, float("nan")])[:P, None]
    weights = torch.rand(1, 40, H, L, P, generator=generator, dtype=torch.float64)
    leaves = [t.to(device=device, dtype=dtype).requires_grad_(True)
              for t in (value, locations, weights)]
    out = pymsda.ms_deform_attn(leaves[0], torch.tensor(shapes, dtype=index_dtype, device=device),
                                None if derived else torch.tensor(starts, dtype=index_dtype,
                                                                  device=device),
                                leaves[1], leaves[2], validate=validate)
    out.backward(torch.ones_like(out))
    return out, leaves


@requires_cuda
@pytest.mark.parametrize("dtype,channels", LYING_KINDS,
                         ids=[f"{str(d)[6:]}-C{c}" for d, c in LYING_KINDS])
@pytest.mark.parametrize("index,table", LYING, ids=[f"{i}-{n}" for n, (i, _) in enumerate(LYING)])
@pytest.mark.parametrize("derived", [False, True], ids=["starts", "derived_starts"])
def test_lying_device_shapes_stay_in_bounds_cuda(generator, dtype, channels, index, table,
                                                 derived):
    # Run under compute-sanitizer memcheck (tests/gpu_reliability.sh, with the caching allocator
    # off) this proves no read or write leaves the tensors; alone it checks that every output
    # is a convex mix of value entries and every gradient is written and finite. derived: no
    # level_start_index, so the kernels derive the starts from the lying sizes.
    out, (value, locations, weights) = _lying_call(generator, "cuda", dtype, channels, index, table,
                                                   derived=derived)
    torch.cuda.synchronize()
    bound = weights.detach().double().abs().sum((-1, -2)) * value.detach().double().abs().max()
    per_row = out.detach().double().view(1, 40, H, channels).abs().amax(-1)
    assert torch.isfinite(out).all() and (per_row <= bound * 1.01 + 1e-6).all()
    for leaf in (value, locations, weights):
        assert torch.isfinite(leaf.grad).all()
    # and the device is still fine
    inputs = base_inputs(generator, "cuda")
    assert rel_l2(run_msda(inputs), oracle_forward(inputs)) < 1e-6


@pytest.mark.parametrize("index,table", LYING, ids=[f"{i}-{n}" for n, (i, _) in enumerate(LYING)])
@pytest.mark.parametrize("derived", [False, True], ids=["starts", "derived_starts"])
def test_lying_shapes_stay_in_bounds_cpu_c_level(generator, index, table, derived):
    # The same tables through the C library's CPU path, bypassing the Python checks (ctypes):
    # under `make sanitize` AddressSanitizer makes this strict. derived: the starts that
    # msda_level_starts derives from the lying sizes.
    index_dtype = torch.int64 if index == "i64" else torch.int32
    shapes = torch.tensor(table[0], dtype=index_dtype)
    starts = torch.tensor(table[1], dtype=index_dtype)
    code = _lib.INDEX_I64 if index == "i64" else _lib.INDEX_I32
    if derived:
        assert _lib.lib.msda_level_starts(L, S, code, -1, shapes.data_ptr(), starts.data_ptr(),
                                          None) == _lib.OK
    starts_ptr = starts.data_ptr()
    value = torch.randn(1, S, H, C, generator=generator)
    locations = torch.rand(1, 40, H, L, P, 2, generator=generator) * 1.4 - 0.2
    weights = torch.rand(1, 40, H, L, P, generator=generator)
    out = torch.full((1, 40, H, C), float("nan"))
    grads = [torch.full(t.shape, float("nan")) for t in (value, locations, weights)]
    args = dict(B=1, S=S, H=H, C=C, L=L, Q=40, P=P, dtype=_lib.DTYPE_F32, index_dtype=code,
                device=-1, num_threads=2, value=value.data_ptr(),
                spatial_shapes=shapes.data_ptr(), level_start_index=starts_ptr,
                sampling_locations=locations.data_ptr(), attention_weights=weights.data_ptr())
    assert _lib.lib.msda_forward(_lib.pack_args(**args, output=out.data_ptr())) == _lib.OK
    assert _lib.lib.msda_backward(_lib.pack_args(
        **args, grad_output=torch.ones_like(out).data_ptr(), grad_value=grads[0].data_ptr(),
        grad_sampling_locations=grads[1].data_ptr(),
        grad_attention_weights=grads[2].data_ptr())) == _lib.OK
    bound = weights.abs().sum((-1, -2)) * value.abs().max()
    assert (out.abs().amax(-1) <= bound * 1.0001 + 1e-6).all()
    for grad in grads:
        assert torch.isfinite(grad).all()


LYING_FOR_VALIDATION = [
    ([(4, 5), (3, 3)], [0, 20], "spatial_shapes"),   # sum of sizes 29 != S
    ([(-4, -5), (3, 2)], [0, 20], "spatial_shapes"),  # sum is S, sizes negative
    ([(4, 5), (3, 2)], [0, 19], "level_start_index"),
]


@requires_cuda
@pytest.mark.parametrize("how", ["flag", "environment"])
@pytest.mark.parametrize("shapes,starts,name", LYING_FOR_VALIDATION,
                         ids=["sum_not_S", "negative_sizes", "starts"])
def test_validation_refuses_lying_device_tables_cuda(generator, monkeypatch, how, shapes, starts,
                                                     name):
    inputs = base_inputs(generator, "cuda")
    bad = dict(spatial_shapes=torch.tensor(shapes, device="cuda"),
               level_start_index=torch.tensor(starts, device="cuda"))
    run_msda(inputs, **bad)  # unchecked by default: no synchronisation, no error
    torch.cuda.synchronize()
    if how == "flag":
        with pytest.raises(ValueError, match=name):
            run_msda(inputs, **bad, validate=True)
    else:
        monkeypatch.setenv("PYMSDA_VALIDATE", "1")
        with pytest.raises(ValueError, match=name):
            run_msda(inputs, **bad)
    # honest device tables pass validation
    out = run_msda(inputs, validate=(how == "flag"))
    assert rel_l2(out, oracle_forward(inputs)) < 1e-6


# ---- more than 2^31 elements (CUDA, half precision) --------------------------------------------

# value (1, 4100*4100, 2, 64) and output (1, 2^24 + 2^16, 128): each just over 2^31 elements,
# 4.3 GB in float16. One level, one point: each output row is one bilinear sample.
BIG_SIDE, BIG_H, BIG_C, BIG_Q = 4100, 2, 64, 2 ** 24 + 2 ** 16
BIG_S = BIG_SIDE * BIG_SIDE
assert BIG_S * BIG_H * BIG_C > 2 ** 31 and BIG_Q * BIG_H * BIG_C > 2 ** 31


def _free_gpu_bytes():
    torch.cuda.empty_cache()  # what earlier tests left cached counts as free
    free, _ = torch.cuda.mem_get_info()
    return free


def _big_inputs():
    gen = torch.Generator(device="cuda").manual_seed(31)
    value = torch.randn(1, BIG_S, BIG_H, BIG_C, device="cuda", dtype=torch.float16, generator=gen)
    locations = torch.rand(1, BIG_Q, BIG_H, 1, 1, 2, device="cuda", generator=gen).half()
    weights = torch.rand(1, BIG_Q, BIG_H, 1, 1, device="cuda", generator=gen).half()
    # rows to check: the first and last queries, and points at the far corner of the level,
    # whose corners sit past element 2^31 of value
    checks = [(0, 0), (1, 1), (BIG_Q // 2, 0), (BIG_Q - 2, 1), (BIG_Q - 1, 0), (BIG_Q - 1, 1)]
    far = torch.tensor([1.0 - 0.3 / BIG_SIDE, 1.0 - 0.8 / BIG_SIDE], device="cuda")
    for q, h in checks[-3:]:
        locations[0, q, h, 0, 0] = far.half()
    return value, locations, weights, checks


def _direct_sample(value, locations, weights, q, h):
    """A * bilinear(value) at (q, h) in float64 from the four corners, plus the corners'
    flat indices and weights."""
    lx, ly = locations[0, q, h, 0, 0].double().tolist()
    a = float(weights[0, q, h, 0, 0])
    x, y = lx * BIG_SIDE - 0.5, ly * BIG_SIDE - 0.5
    x0, y0 = int(np.floor(x)), int(np.floor(y))
    fx, fy = x - x0, y - y0
    total = torch.zeros(BIG_C, dtype=torch.float64)
    corners = []
    for dy in (0, 1):
        for dx in (0, 1):
            xx, yy = x0 + dx, y0 + dy
            if 0 <= xx < BIG_SIDE and 0 <= yy < BIG_SIDE:
                w = (fx if dx else 1 - fx) * (fy if dy else 1 - fy)
                idx = yy * BIG_SIDE + xx
                total += a * w * value[0, idx, h].double().cpu()
                corners.append((idx, w))
    return total, corners, a, (x0, y0, fx, fy)


@requires_cuda
@pytest.mark.huge
def test_int32_overflow_forward_half_over_2_31_elements_cuda():
    if _free_gpu_bytes() < 14 * 2 ** 30:
        pytest.skip("needs about 14 GB of free GPU memory")
    value, locations, weights, checks = _big_inputs()
    out = pymsda.ms_deform_attn(value, [(BIG_SIDE, BIG_SIDE)], None, locations, weights)
    torch.cuda.synchronize()
    assert out.shape == (1, BIG_Q, BIG_H * BIG_C)
    view = out.view(1, BIG_Q, BIG_H, BIG_C)
    for q, h in checks:
        expected, corners, _, _ = _direct_sample(value, locations, weights, q, h)
        assert corners, (q, h)
        actual = view[0, q, h].double().cpu()
        torch.testing.assert_close(actual, expected, rtol=4e-3, atol=4e-3, msg=f"row {(q, h)}")
    far_offset = (checks[-1][0] * BIG_H + checks[-1][1]) * BIG_C
    assert far_offset > 2 ** 31  # the last rows checked lie past element 2^31 of the output


@requires_cuda
@pytest.mark.huge
def test_int32_overflow_backward_half_over_2_31_elements_cuda():
    if _free_gpu_bytes() < 34 * 2 ** 30:
        pytest.skip("needs about 34 GB of free GPU memory")
    value, locations, weights, checks = _big_inputs()
    leaves = [t.requires_grad_(True) for t in (value, locations, weights)]
    # grad_output is zero except on the checked rows, so every gradient is known exactly; it is
    # small (1/16) so that the location gradients, ~ A * 4100 * <g, dv>, stay inside float16
    gen = torch.Generator().manual_seed(7)
    grad_output = torch.zeros(1, BIG_Q, BIG_H * BIG_C, dtype=torch.float16, device="cuda")
    grad_rows = {}
    for q, h in checks:
        g = (torch.randn(BIG_C, generator=gen, dtype=torch.float64) / 16).half()
        grad_output.view(1, BIG_Q, BIG_H, BIG_C)[0, q, h] = g.cuda()
        grad_rows[(q, h)] = g.double()
    torch.autograd.backward(
        pymsda.ms_deform_attn(leaves[0], [(BIG_SIDE, BIG_SIDE)], None, leaves[1], leaves[2]),
        grad_output)
    torch.cuda.synchronize()
    grad_value, grad_loc, grad_attn = (t.grad for t in leaves)
    expected_value = {}
    for (q, h), g in grad_rows.items():
        sample, corners, a, (x0, y0, fx, fy) = _direct_sample(value.detach(), locations.detach(),
                                                              weights.detach(), q, h)
        # d/dA = <sample / A, g>; d/dloc from the corners' differences
        v = {}
        for dy in (0, 1):
            for dx in (0, 1):
                xx, yy = x0 + dx, y0 + dy
                inside = 0 <= xx < BIG_SIDE and 0 <= yy < BIG_SIDE
                v[dy, dx] = (value.detach()[0, yy * BIG_SIDE + xx, h].double().cpu() if inside
                             else torch.zeros(BIG_C, dtype=torch.float64))
        bilinear = sum((fx if dx else 1 - fx) * (fy if dy else 1 - fy) * v[dy, dx]
                       for dy in (0, 1) for dx in (0, 1))
        d_attn = float((bilinear * g).sum())
        slope_x = (1 - fy) * (v[0, 1] - v[0, 0]) + fy * (v[1, 1] - v[1, 0])
        slope_y = (1 - fx) * (v[1, 0] - v[0, 0]) + fx * (v[1, 1] - v[0, 1])
        d_x = a * BIG_SIDE * float((slope_x * g).sum())
        d_y = a * BIG_SIDE * float((slope_y * g).sum())
        scale = float(g.abs().sum() * bilinear.abs().max() + 1)
        assert abs(float(grad_attn[0, q, h, 0, 0]) - d_attn) < 4e-3 * scale, (q, h)
        got = grad_loc[0, q, h, 0, 0].double().cpu()
        loc_scale = a * BIG_SIDE * scale
        assert abs(float(got[0]) - d_x) < 4e-3 * loc_scale, (q, h)
        assert abs(float(got[1]) - d_y) < 4e-3 * loc_scale, (q, h)
        for idx, w in corners:
            key = (idx, h)
            expected_value[key] = expected_value.get(key, 0) + a * w * g
    for (idx, h), expected in expected_value.items():
        torch.testing.assert_close(grad_value[0, idx, h].double().cpu(), expected, rtol=4e-3,
                                   atol=1e-5, msg=f"grad_value at {(idx, h)}")
    # nothing else was written into grad_value: its L1 norm is that of the checked corners
    total = float(torch.linalg.vector_norm(grad_value, ord=1, dtype=torch.float32))
    expected_total = sum(float(e.abs().sum()) for e in expected_value.values())
    assert abs(total - expected_total) < 1e-2 * expected_total
    # unchecked points get zero weight and location gradients
    for q in (2, BIG_Q // 3, BIG_Q - 3):
        assert float(grad_attn[0, q].abs().sum()) == 0 and float(grad_loc[0, q].abs().sum()) == 0

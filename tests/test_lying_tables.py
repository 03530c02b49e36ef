"""tests/test_lying_tables.py: shape tables that disagree with value, and the opt-in validation.

Device-side spatial_shapes / level_start_index are read unchecked (checking them on the host
would synchronise): tables that lie (sides past 2^40, 2^24 or 2^31, zero or negative sides,
starts outside [0, S), sums past S) must never make the kernels read or write outside the
tensors. Every output stays a convex mix of value entries and every gradient is written and
finite. On CUDA, tests/gpu_reliability.sh runs the tests named "lying" and "cuda" under
compute-sanitizer memcheck, and a value inside a NaN-filled buffer shows a stray read without
it. The C library's CPU path gets the same tables through ctypes, past the Python checks
(strict under `make sanitize`).

The opt-in validation (validate=True or PYMSDA_VALIDATE=1) checks device tables with a
synchronisation and refuses the lying ones; on the CPU, where every table is read anyway, it
changes nothing.
"""
import pytest
import torch

import pymsda
from pymsda import _clib
from conftest import requires_cuda
from factories import SMALL_SIZES, oracle_forward, rel_l2, run_msda, small_inputs

S = 26
B, Q, H, C, L, P = SMALL_SIZES


# ---- tables that lie: every read and write stays inside the tensors -----------------------------

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
    inputs = small_inputs(generator, "cuda")
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
    code = _clib.INDEX_I64 if index == "i64" else _clib.INDEX_I32
    if derived:
        assert _clib.lib.msda_level_starts(L, S, code, -1, shapes.data_ptr(), starts.data_ptr(),
                                          None) == _clib.OK
    starts_ptr = starts.data_ptr()
    value = torch.randn(1, S, H, C, generator=generator)
    locations = torch.rand(1, 40, H, L, P, 2, generator=generator) * 1.4 - 0.2
    weights = torch.rand(1, 40, H, L, P, generator=generator)
    out = torch.full((1, 40, H, C), float("nan"))
    grads = [torch.full(t.shape, float("nan")) for t in (value, locations, weights)]
    args = dict(B=1, S=S, H=H, C=C, L=L, Q=40, P=P, dtype=_clib.DTYPE_F32, index_dtype=code,
                device=-1, num_threads=2, value=value.data_ptr(),
                spatial_shapes=shapes.data_ptr(), level_start_index=starts_ptr,
                sampling_locations=locations.data_ptr(), attention_weights=weights.data_ptr())
    assert _clib.lib.msda_forward(_clib.pack_args(**args, output=out.data_ptr())) == _clib.OK
    assert _clib.lib.msda_backward(_clib.pack_args(
        **args, grad_output=torch.ones_like(out).data_ptr(), grad_value=grads[0].data_ptr(),
        grad_sampling_locations=grads[1].data_ptr(),
        grad_attention_weights=grads[2].data_ptr())) == _clib.OK
    bound = weights.abs().sum((-1, -2)) * value.abs().max()
    assert (out.abs().amax(-1) <= bound * 1.0001 + 1e-6).all()
    for grad in grads:
        assert torch.isfinite(grad).all()


@requires_cuda
def test_lying_device_shapes_never_read_outside_value_cuda(generator):
    # Shapes on the GPU are not checked on the host (that would synchronise); the kernels
    # bounds-check every gather instead (DESIGN.md section 2). value sits inside a NaN-filled
    # buffer, so a read before or after it would turn the output NaN; a wild read would raise
    # at the synchronisation.
    H, C, S, pad = 2, 8, 26, 64
    buffer = torch.full((1, pad + S + pad, H, C), float("nan"), device="cuda")
    buffer[:, pad:pad + S] = torch.randn(1, S, H, C, generator=generator).cuda()
    value = buffer[:, pad:pad + S]
    assert value.is_contiguous()  # so the op reads this very memory, not a copy
    lying_shapes = torch.tensor([[50, 50], [40, 41]], device="cuda")
    lying_starts = torch.tensor([0, 2500], device="cuda")
    locations = (torch.rand(1, 30, H, 2, 4, 2, generator=generator) * 1.4 - 0.2).cuda()
    weights = torch.rand(1, 30, H, 2, 4, generator=generator).cuda()
    locations.requires_grad_(True)
    weights.requires_grad_(True)
    leaf_value = value.clone().requires_grad_(True)
    for v in (value, leaf_value):
        out = pymsda.ms_deform_attn(v, lying_shapes, lying_starts, locations, weights)
        out.backward(torch.ones_like(out))
        torch.cuda.synchronize()
        assert torch.isfinite(out).all()
    assert torch.isfinite(leaf_value.grad).all()
    assert torch.isfinite(locations.grad).all() and torch.isfinite(weights.grad).all()
    assert torch.isnan(buffer[:, :pad]).all() and torch.isnan(buffer[:, pad + S:]).all()


# ---- the opt-in validation ----------------------------------------------------------------------

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
    inputs = small_inputs(generator, "cuda")
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


def test_validate_flag_and_environment_variable_accepted_on_cpu(generator, monkeypatch):
    # On the CPU every table is read anyway; validation must change nothing there.
    inputs = small_inputs(generator, "cpu")
    expected = run_msda(inputs)
    assert torch.equal(pymsda.ms_deform_attn(*(inputs[k] for k in (
        "value", "spatial_shapes", "level_start_index", "sampling_locations",
        "attention_weights")), validate=True), expected)
    monkeypatch.setenv("PYMSDA_VALIDATE", "1")
    assert torch.equal(run_msda(inputs), expected)
    with pytest.raises(ValueError, match="level_start_index"):
        run_msda(inputs, level_start_index=torch.tensor([0, 19]))


def test_environment_variable_is_read_on_every_call(monkeypatch):
    # The op reads PYMSDA_VALIDATE through libc's getenv, which os.environ writes through
    # (pymsda/_args.py, _validating):
    # setting, changing and removing it after import must all count.
    from pymsda._args import _validating
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

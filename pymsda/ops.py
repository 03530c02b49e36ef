"""The MSDA operator: argument checks, the calls into the C library, autograd, and the
torch.library registration that torch.compile and torch.export see.

Two ways in, one implementation. Eager calls take the short way: checks, then ctypes, with one
torch.autograd.Function (_MSDA) when a gradient is wanted. Where the running torch has
torch.library.custom_op, the same _forward and _backward are also registered as the ops
pymsda::ms_deform_attn_forward and pymsda::ms_deform_attn_backward, with fake (shape-only)
implementations and autograd wired from one to the other; ms_deform_attn calls them when it is
being traced (torch.compile, torch.export, fake tensors, dispatch modes), where a ctypes call
cannot be recorded. The dispatcher costs several microseconds a call, so eager calls do not go
through it.
"""
import ctypes
import os
import struct
from typing import List, Optional, Tuple

import torch

from . import _lib
from ._lib import lib

__all__ = ["ms_deform_attn", "MSDeformAttnFunction"]

_DTYPE_CODE = {
    torch.float32: _lib.DTYPE_F32,
    torch.float64: _lib.DTYPE_F64,
    torch.float16: _lib.DTYPE_F16,
    torch.bfloat16: _lib.DTYPE_BF16,
}
_INDEX_CODE = {torch.int64: _lib.INDEX_I64, torch.int32: _lib.INDEX_I32}

# The raw cudaStream_t of a device's current stream. torch._C._cuda_getCurrentRawStream returns
# it as an int without building a Stream object; older or unusual torch builds fall back to the
# public API.
def _public_current_stream(device_index):
    return torch.cuda.current_stream(device_index).cuda_stream


_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _public_current_stream


# ---------------------------------------------------------------------------------------------
# argument checks (shape-only ones are shared with the fake implementations)


def _describe(t):
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


def _check_float_tensor(name, t, ndim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in _DTYPE_CODE:
        raise TypeError(
            f"{name} must be float32, float64, float16 or bfloat16, got {_describe(t)}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got {_describe(t)}")


def _check_index_device(name, t, device):
    """An index tensor must be readable where the op runs: on the CPU or on value's device
    (another GPU is copied from). A meta one holds no numbers to read."""
    if t.device.type == "meta" and device.type != "meta":
        raise ValueError(f"{name} is on meta but value is on {device}: index tensors must be "
                         f"on the CPU or on value's device, got {_describe(t)}")


# The C library counts elements and bytes in int64 (msda_forward's size check): a tensor whose
# byte count at 8 bytes an element passes 2^63 cannot be indexed.
_MAX_ELEMENTS = (2 ** 63 - 1) // 8


def _check_sizes(B, S, H, C, L, Q, P):
    """Refuses sizes the kernels cannot index before anything tries to copy or allocate them
    (an expanded view of such a size costs no memory, its contiguous copy would)."""
    if B * H * (S * C + Q * C + Q * L * P * 2) <= _MAX_ELEMENTS:  # the common case, at once
        return
    for what, count in (("value (B, S, H, C)", B * S * H * C),
                        ("sampling_locations (B, Q, H, L, P, 2)", B * Q * H * L * P * 2),
                        ("the output (B, Q, H*C) of value and sampling_locations",
                         B * Q * H * C)):
        if count > _MAX_ELEMENTS:
            raise ValueError(f"{what} has {count} elements, more than the {_MAX_ELEMENTS} "
                             f"pymsda can index (64-bit byte offsets): "
                             f"B={B} S={S} H={H} C={C} L={L} Q={Q} P={P}")


def _aligned_contiguous(t):
    """t contiguous and aligned to its element size (the C library refuses a misaligned
    pointer; torch.frombuffer can make one)."""
    t = t.contiguous()
    if t.data_ptr() % t.element_size():
        t = t.clone()
    return t


def _env_reader(name):
    """A function that returns os.environ.get(name). It looks the name up in os.environ's own
    mapping with the key encoded once: os.environ.get encodes it on every call (about 0.8 us, a
    cost every call with tables on the GPU would pay). Falls back to os.environ.get where
    os.environ is laid out otherwise."""
    env = os.environ
    try:
        data, key, decode = env._data, env.encodekey(name), env.decodevalue
        data.get(key)
    except Exception:  # another Python's os.environ
        return lambda: env.get(name)

    def read():
        raw = data.get(key)
        return None if raw is None else decode(raw)
    return read


_validate_env = _env_reader("PYMSDA_VALIDATE")


def _validating(validate):
    """validate, or PYMSDA_VALIDATE=1 (read on every call, so setting it later counts). Only
    asked where it changes something (tables on the GPU)."""
    return validate or _validate_env() == "1"


def _check_tensors(value, sampling_locations, attention_weights, per_level):
    """Types, ranks, devices and the sizes value, sampling_locations and attention_weights share.
    Returns (B, S, H, C, Q, P, L); L is sampling_locations' level count, None without per_level
    (num_points_list), where P is then the number of points of all levels."""
    # One pass for the common call (a few hundred nanoseconds); anything unexpected goes to the
    # checks below, which name whatever is wrong.
    try:
        if (isinstance(value, torch.Tensor) and value.dtype in _DTYPE_CODE
                and sampling_locations.dtype in _DTYPE_CODE
                and attention_weights.dtype in _DTYPE_CODE):
            B, S, H, C = value.shape
            if per_level:
                Bl, Q, Hl, L, P, two = sampling_locations.shape
                attn_ok = attention_weights.shape == (B, Q, H, L, P)
            else:
                Bl, Q, Hl, P, two = sampling_locations.shape
                L = None
                attn_ok = attention_weights.shape == (B, Q, H, P)
            if two == 2 and Bl == B and Hl == H and attn_ok:
                device = value.device
                if sampling_locations.device == device and attention_weights.device == device:
                    return B, S, H, C, Q, P, L
    except (AttributeError, TypeError, ValueError):
        pass
    return _check_tensors_named(value, sampling_locations, attention_weights, per_level)


def _check_tensors_named(value, sampling_locations, attention_weights, per_level):
    """_check_tensors' checks one by one: raises, naming the argument, for the first one that
    fails; returns as _check_tensors when none does."""
    loc_ndim = 6 if per_level else 5
    _check_float_tensor("value", value, 4)
    _check_float_tensor("sampling_locations", sampling_locations, loc_ndim)
    _check_float_tensor("attention_weights", attention_weights, loc_ndim - 1)
    B, S, H, C = value.shape
    loc_shape = sampling_locations.shape
    if per_level:
        Bl, Q, Hl, L, P, two = loc_shape
    else:
        Bl, Q, Hl, P, two = loc_shape
        L = None
    if two != 2:
        raise ValueError(f"sampling_locations must have shape {_loc_layout(per_level)}, got "
                         f"{_describe(sampling_locations)}")
    if Bl != B or Hl != H:
        dim, name, expected, got = ("B", "batch", B, Bl) if Bl != B else ("H", "heads", H, Hl)
        raise ValueError(
            f"sampling_locations has {name} {dim} = {got} but value has {dim} = {expected}: "
            f"value {_describe(value)}, sampling_locations {_describe(sampling_locations)}")
    if attention_weights.shape != loc_shape[:-1]:
        raise ValueError(
            f"attention_weights must have shape {_loc_layout(per_level)[:-4]}) = "
            f"{tuple(loc_shape[:-1])} to match value and sampling_locations, got "
            f"{_describe(attention_weights)}")
    device = value.device
    if sampling_locations.device != device or attention_weights.device != device:
        name, t = (("sampling_locations", sampling_locations)
                   if sampling_locations.device != device
                   else ("attention_weights", attention_weights))
        raise ValueError(f"{name} is on {t.device} but value is on {device}: all tensors "
                         "must be on one device")
    return B, S, H, C, Q, P, L


def _loc_layout(per_level):
    return "(B, Q, H, L, P, 2)" if per_level else "(B, Q, H, sum(num_points_list), 2)"


def _point_counts(num_points_list, L):
    """num_points_list checked against L levels, as a tuple of ints."""
    try:
        counts = tuple(int(n) for n in num_points_list)
        ok = all(float(n).is_integer() for n in num_points_list)
    except (TypeError, ValueError):
        raise TypeError(f"num_points_list must be a list of L integers, got {num_points_list!r}") \
            from None
    if not ok:
        raise TypeError(f"num_points_list must hold integers, got {num_points_list!r}")
    if len(counts) != L:
        raise ValueError(f"num_points_list has {len(counts)} entries but spatial_shapes names "
                         f"L = {L} levels: {num_points_list!r}")
    if any(n < 0 for n in counts) or sum(counts) < 1:
        raise ValueError(f"num_points_list entries must be >= 0 with a positive sum, got "
                         f"{num_points_list!r}")
    return counts


_level_points_cache = {}  # (num_points_list as a tuple, L) -> (total, ctypes int64 array)


def _level_points(num_points_list, L):
    """num_points_list checked against L, as (total points, ctypes int64 array, kept alive)."""
    try:
        key = (tuple(num_points_list), L)
        hit = _level_points_cache.get(key)
    except TypeError:
        key = hit = None
    if hit is None:
        counts = _point_counts(num_points_list, L)
        hit = (sum(counts), (ctypes.c_int64 * L)(*counts))
        if key is not None:
            if len(_level_points_cache) > 256:
                _level_points_cache.clear()
            _level_points_cache[key] = hit
    return hit


def _check_levels(L_tables, L, P, num_points_list, sampling_locations, counts_total=None):
    """The level count of the shape tables against sampling_locations (or num_points_list,
    whose total, computed by the caller, is counts_total); returns L."""
    if num_points_list is None:
        if L_tables != L:
            raise ValueError(f"spatial_shapes has {L_tables} levels but "
                             f"sampling_locations has L = {L}: {_describe(sampling_locations)}")
    else:
        L = L_tables
        if counts_total is None:
            counts_total = sum(_point_counts(num_points_list, L))
        if counts_total != P:
            raise ValueError(f"sampling_locations has {P} points per query and head but "
                             f"num_points_list {list(num_points_list)} sums to {counts_total}: "
                             f"{_describe(sampling_locations)}")
    return L


def _check_min_sizes(H, C, L, P):
    if C < 1 or H < 1 or L < 1 or P < 1:
        raise ValueError(f"H, C, L and P must be >= 1, got H={H} C={C} (value) and L={L} P={P} "
                         "(sampling_locations)")


def _check_shapes_tensor(spatial_shapes, device):
    if spatial_shapes.dtype not in _INDEX_CODE:
        raise TypeError(
            f"spatial_shapes must be an int64 or int32 tensor, got {_describe(spatial_shapes)}")
    if spatial_shapes.dim() != 2 or spatial_shapes.shape[1] != 2 or spatial_shapes.shape[0] < 1:
        raise ValueError(
            f"spatial_shapes must have shape (L, 2) with L >= 1, got {_describe(spatial_shapes)}")
    _check_index_device("spatial_shapes", spatial_shapes, device)


def _check_start_index_tensor(level_start_index, L, device):
    if level_start_index.dtype not in _INDEX_CODE:
        raise TypeError("level_start_index must be an int64 or int32 tensor, got "
                        f"{_describe(level_start_index)}")
    if level_start_index.dim() != 1 or level_start_index.shape[0] != L:
        raise ValueError(f"level_start_index must have shape ({L},) to match spatial_shapes, "
                         f"got {_describe(level_start_index)}")
    _check_index_device("level_start_index", level_start_index, device)


def _check_shapes_only(value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights, num_points_list):
    """Every check that needs no numbers (the fake implementations: shapes may be symbolic and
    the shape tables hold no data). Returns (B, S, H, C, L, Q, P)."""
    per_level = num_points_list is None
    B, S, H, C, Q, P, L = _check_tensors(value, sampling_locations, attention_weights, per_level)
    _check_shapes_tensor(spatial_shapes, value.device)
    L_tables = spatial_shapes.shape[0]
    if level_start_index is not None:
        _check_start_index_tensor(level_start_index, L_tables, value.device)
    L = _check_levels(L_tables, L, P, num_points_list, sampling_locations)
    _check_min_sizes(H, C, L, P)
    _check_sizes(B, S, H, C, L if per_level else 1, Q, P)
    return B, S, H, C, L, Q, P


class _MetaMSDA(torch.autograd.Function):
    """The op on meta tensors outside tracing: outputs and gradients of the right shapes and
    dtypes, no numbers (there are none to read)."""

    @staticmethod
    def forward(ctx, value, sampling_locations, attention_weights, sizes):
        B, S, H, C, L, Q, P = sizes
        ctx.like = [(t.shape, t.dtype) for t in (value, sampling_locations, attention_weights)]
        return value.new_empty((B, Q, H * C))

    @staticmethod
    def backward(ctx, grad_out):
        grads = tuple(grad_out.new_empty(shape, dtype=dtype) if need else None
                      for (shape, dtype), need in zip(ctx.like, ctx.needs_input_grad))
        return grads + (None,)


# ---------------------------------------------------------------------------------------------
# shape tables


class _Levels:
    """spatial_shapes and level_start_index, as the C library wants them on one device.

    host: the (H, W) pairs when they are known on the host (a list, or a CPU tensor), else None;
    host_starts: then the level start offsets, and total the sum of H*W.
    """

    __slots__ = ("shapes", "starts", "index_code", "host", "host_starts", "total", "pointers",
                 "L")

    def __init__(self, shapes, starts, host, host_starts=None, total=None):
        self.shapes, self.starts, self.host = shapes, starts, host
        self.host_starts, self.total = host_starts, total
        self.index_code = _INDEX_CODE[shapes.dtype]
        self.L = shapes.shape[0]
        self.pointers = None  # (shapes, starts) data pointers, read at the first library call

    def read_pointers(self):
        """The tables' data pointers, read once: the two tensors are this object's own (cached
        copies made here, or per-call views), which nothing resizes. Not read before a library
        call, since fake and meta tensors have none."""
        self.pointers = (self.shapes.data_ptr(), self.starts.data_ptr())
        return self.pointers


def _starts_of(pairs):
    starts, total = [], 0
    for h, w in pairs:
        starts.append(total)
        total += h * w
    return starts, total


# Level tables built from host-side shapes, per (pairs, device, dtype): a list of shapes is then
# copied to the GPU once, not on every call.
_level_cache = {}


def _levels_from_host(pairs, device, dtype=torch.int64):
    key = (pairs, device, dtype)
    levels = _level_cache.get(key)
    if levels is None:
        starts, total = _starts_of(pairs)
        shapes = torch.tensor(pairs, dtype=dtype).reshape(len(pairs), 2)
        starts_tensor = torch.tensor(starts, dtype=dtype)
        if device.type != "cpu":
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # The copy would be recorded into the graph, not run: the cached tables would
                # hold garbage until a replay.
                raise RuntimeError(
                    f"pymsda: spatial_shapes {list(pairs)} first seen on {device} inside CUDA "
                    "graph capture, where its device copy cannot be made; call the op once "
                    "with these shapes before capturing (the usual warm-up), or pass "
                    "spatial_shapes and level_start_index as tensors on the device")
            shapes, starts_tensor = shapes.to(device), starts_tensor.to(device)
        levels = _Levels(shapes, starts_tensor, pairs, starts, total)
        if not _tracing():  # under a fake mode these tensors are fake: never keep them
            if len(_level_cache) > 256:
                _level_cache.clear()
            _level_cache[key] = levels
    return levels


def _check_pairs(spatial_shapes):
    """A list of (H, W) pairs as a tuple of int pairs, each side >= 1, or an exception naming
    it."""
    try:
        pairs = tuple((int(h), int(w)) for h, w in spatial_shapes)
        ok = all(isinstance(v, int) or float(v).is_integer()
                 for pair in spatial_shapes for v in pair)
    except (TypeError, ValueError):
        raise TypeError(
            "spatial_shapes must be an (L, 2) integer tensor or a list of (H, W) integer "
            f"pairs, got {spatial_shapes!r}") from None
    if not ok:
        raise TypeError(f"spatial_shapes must hold integers, got {spatial_shapes!r}")
    if len(pairs) < 1:
        raise ValueError("spatial_shapes must name at least one level, got an empty list")
    _check_positive(pairs)
    return pairs


def _check_positive(pairs):
    for level, (h, w) in enumerate(pairs):
        if h < 1 or w < 1:
            raise ValueError(
                f"spatial_shapes: level {level} has size ({h}, {w}); sizes must be >= 1")


_list_levels_cache = {}  # (spatial_shapes given as a list, as a hashable tuple, device) -> _Levels


def _levels_from_list(spatial_shapes, device):
    """The checked level tables of a list of (H, W) pairs on device, cached: the common call
    costs one tuple and one dictionary lookup."""
    try:
        key = (tuple(map(tuple, spatial_shapes)), device)
        levels = _list_levels_cache.get(key)
    except TypeError:  # not a sequence of sequences, or unhashable: let the check say why
        key = levels = None
    if levels is None:
        levels = _levels_from_host(_check_pairs(spatial_shapes), device)
        if key is not None and not _tracing():
            if len(_list_levels_cache) > 256:
                _list_levels_cache.clear()
            _list_levels_cache[key] = levels
    return levels


def _host_pairs(spatial_shapes, device, validate=False):
    """A spatial_shapes tensor as a tuple of (H, W) int pairs, checked; None when it lives on
    the device that runs the op and reading it there would synchronise (unless validate asks
    for exactly that), or on meta."""
    _check_shapes_tensor(spatial_shapes, device)
    if spatial_shapes.device.type == "meta":
        return None
    if (spatial_shapes.device.type != "cpu" and device.type != "cpu"
            and not _validating(validate)):
        return None
    pairs = tuple(tuple(p) for p in spatial_shapes.tolist())
    _check_positive(pairs)
    return pairs


# Level tables of spatial_shapes (and level_start_index) given as tensors, per (id of each,
# value's device): (spatial_shapes, level_start_index, whether each was read on the host, a
# state of each, _Levels, whether either lives on a device). The entry holds the tensors, so
# their ids stay theirs while it lives. A table read on the host has its numbers as its state
# (tolist() costs about 0.4 us, and a change through .data leaves the version counter alone);
# a device table is remembered only where the library reads the caller's tensor itself (no
# copy, no derived starts), so a change of its numbers is seen anyway, and its state is (data
# pointer, version). Where a table is is settled when it is remembered (t.device.type costs
# about 0.3 us a call); should .data later move a table, a host table's numbers are still
# compared, and a device table's pointer no longer matches. Models pass the same two tensors to
# every layer of a forward; a few entries are enough.
_tensor_levels_cache = {}


def _table_state(t, host):
    if t is None:
        return None
    return t.tolist() if host else (t.data_ptr(), t._version)


def _on_host(t):
    return t is None or t.device.type == "cpu"


def _remember_tensor_levels(spatial_shapes, level_start_index, device, levels):
    if levels.host is None and not (levels.shapes is spatial_shapes
                                    and levels.starts is level_start_index):
        return  # copies or derived starts: a change of the caller's table would go unseen
    host = (_on_host(spatial_shapes), _on_host(level_start_index))
    try:
        entry = (spatial_shapes, level_start_index, host[0], host[1],
                 _table_state(spatial_shapes, host[0]), _table_state(level_start_index, host[1]),
                 levels, not all(host))
    except RuntimeError:  # an inference tensor has no version counter
        return
    if len(_tensor_levels_cache) >= 16:
        _tensor_levels_cache.clear()
    _tensor_levels_cache[(id(spatial_shapes), id(level_start_index), device)] = entry


def _remembered_tensor_levels(spatial_shapes, level_start_index, device):
    """The _Levels of an earlier call with these very tables, unchanged since; or None."""
    entry = _tensor_levels_cache.get((id(spatial_shapes), id(level_start_index), device))
    if (entry is None or entry[0] is not spatial_shapes or entry[1] is not level_start_index
            or _table_state(spatial_shapes, entry[2]) != entry[4]
            or _table_state(level_start_index, entry[3]) != entry[5]):
        return None
    if entry[7] and _validating(False):
        return None  # PYMSDA_VALIDATE=1: tables on the device are read on every call
    return entry[6]


def _prepare_levels(spatial_shapes, level_start_index, S, device, validate=False):
    levels = _prepare_levels_uncached(spatial_shapes, level_start_index, S, device, validate)
    # Not while validation asks to read device tables on every call, nor while tracing.
    if (type(spatial_shapes) is _Tensor
            and (level_start_index is None or type(level_start_index) is _Tensor)
            and not _tracing() and (levels.host is not None or not _validating(validate))):
        _remember_tensor_levels(spatial_shapes, level_start_index, device, levels)
    return levels


def _prepare_levels_uncached(spatial_shapes, level_start_index, S, device, validate=False):
    if isinstance(spatial_shapes, torch.Tensor):
        pairs = _host_pairs(spatial_shapes, device, validate)
        levels = None if pairs is None else _levels_from_host(pairs, device, spatial_shapes.dtype)
    else:
        levels = _levels_from_list(spatial_shapes, device)
        pairs = levels.host
    if levels is not None and levels.total != S:
        raise ValueError(
            f"spatial_shapes {list(pairs)} cover sum(H*W) = {levels.total} positions but value "
            f"has S = {S} (value.shape[1])")
    L = len(pairs) if pairs is not None else spatial_shapes.shape[0]

    if level_start_index is not None:
        if not isinstance(level_start_index, torch.Tensor):
            level_start_index = torch.as_tensor(level_start_index)
        _check_start_index_tensor(level_start_index, L, device)
        # Read it where that costs no device synchronisation (or validate asks for one).
        if levels is not None and (
                level_start_index.device.type == "cpu" or device.type == "cpu" or (
                level_start_index.device.type != "meta" and _validating(validate))):
            given = level_start_index.tolist()
            if given != levels.host_starts:
                raise ValueError(f"level_start_index {given} does not match spatial_shapes "
                                 f"{list(pairs)}: expected {levels.host_starts}")

    if levels is not None:
        return levels

    # The shapes live on the value's device: reading them here would synchronise, so nothing
    # does; the kernels bounds-check every read instead.
    shapes = _aligned_contiguous(spatial_shapes.to(device))
    if level_start_index is not None:
        starts = _aligned_contiguous(level_start_index.to(device=device, dtype=shapes.dtype))
    elif device.type == "cuda" and _has_cuda_kernels and not _tracing():
        # derived on the device by one small kernel (c/msda.h), afresh on every call, so that
        # a change of the shapes' numbers is followed
        starts = torch.empty(shapes.shape[0], dtype=shapes.dtype, device=device)
        _check(lib.msda_level_starts(shapes.shape[0], S, _INDEX_CODE[shapes.dtype],
                                     device.index, shapes.data_ptr(), starts.data_ptr(),
                                     _current_stream(device.index)))
    else:  # meta tensors, or a device the library does not serve
        sizes = shapes[:, 0] * shapes[:, 1]
        starts = torch.cumsum(sizes, 0) - sizes
    return _Levels(shapes, starts, None)


def _prepare(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
             validate=False, num_points_list=None):
    """Checks every argument; returns the tensors in the form the C library takes. validate:
    also read shape tables that live on the GPU and check them (a device synchronisation).
    With num_points_list, sampling_locations is (B, Q, H, sum(num_points_list), 2) and
    attention_weights (B, Q, H, sum(num_points_list)); the returned P is that sum and lp the
    ctypes table of counts (None without num_points_list)."""
    per_level = num_points_list is None
    B, S, H, C, Q, P, L = _check_tensors(value, sampling_locations, attention_weights, per_level)
    if type(spatial_shapes) is list and level_start_index is None:  # the common list call
        levels = _levels_from_list(spatial_shapes, value.device)
        if levels.total != S:
            _prepare_levels(spatial_shapes, None, S, value.device)  # raises, naming S
    else:
        levels = _prepare_levels(spatial_shapes, level_start_index, S, value.device, validate)
    L_tables = levels.L
    lp = None
    if not per_level:
        total, lp = _level_points(num_points_list, L_tables)
        L = _check_levels(L_tables, L, P, num_points_list, sampling_locations, total)
    elif L_tables != L:
        _check_levels(L_tables, L, P, None, sampling_locations)  # raises
    if C < 1 or H < 1 or L < 1 or P < 1:
        _check_min_sizes(H, C, L, P)  # raises
    if B * H * (S * C + Q * C + Q * L * P * 2) > _MAX_ELEMENTS:  # (nothing near it, at once)
        _check_sizes(B, S, H, C, L if per_level else 1, Q, P)

    # Mixed float dtypes (autocast) follow value's dtype.
    dtype = value.dtype
    if sampling_locations.dtype != dtype:
        sampling_locations = sampling_locations.to(dtype)
    if attention_weights.dtype != dtype:
        attention_weights = attention_weights.to(dtype)
    value = value.contiguous()
    sampling_locations = sampling_locations.contiguous()
    attention_weights = attention_weights.contiguous()
    # One alignment test for the three (one element size): a misaligned one is rare (only
    # torch.frombuffer makes one), so the common call reads each pointer once.
    if (value.data_ptr() | sampling_locations.data_ptr()
            | attention_weights.data_ptr()) % value.element_size():
        value, sampling_locations, attention_weights = (
            _aligned_contiguous(value), _aligned_contiguous(sampling_locations),
            _aligned_contiguous(attention_weights))
    return (value, levels, sampling_locations, attention_weights, (B, S, H, C, L, Q, P), lp)


# ---------------------------------------------------------------------------------------------
# calls into the C library

# The packed entry points (c/msda.h): struct packs the arguments into a fresh bytes object (its
# own per call, so threads never share one) in about a fifth of the time ctypes takes to convert
# twenty separate arguments.
_forward_packed, _backward_packed = lib.msda_forward_packed, lib.msda_backward_packed
_pack_forward, _pack_backward = struct.Struct("20q").pack, struct.Struct("25q").pack


def _msda_backward(*args):
    """msda_backward's arguments in its order (level_points a ctypes array, None for NULL)."""
    args = list(args)
    if args[11] is not None:
        args[11] = ctypes.addressof(args[11])
    return _backward_packed(_pack_backward(*[0 if a is None else a for a in args]))


def _device_args(t):
    """(device, stream, num_threads) for the C call: the CUDA ordinal of t and the current
    stream of that device (not of the current device), or -1, 0 and torch's CPU thread count."""
    if t.is_cuda:
        index = t.get_device()
        return index, _current_stream(index), 0
    return -1, 0, torch.get_num_threads()


def _check(status):
    if status != _lib.OK:
        exc = ValueError if status == _lib.ERR_INVALID_ARGUMENT else RuntimeError
        raise exc("pymsda: " + _lib.error_text(status))


def _forward(value, levels, loc, attn, sizes, lp=None, flags=0):
    B, S, H, C, L, Q, P = sizes
    out = value.new_empty((B, Q, H * C))
    if value.is_cuda:  # _device_args, inline
        device = value.get_device()
        stream, threads = _current_stream(device), 0
    else:
        device, stream, threads = -1, 0, torch.get_num_threads()
    shapes_ptr, starts_ptr = levels.pointers or levels.read_pointers()
    status = _forward_packed(_pack_forward(
        B, S, H, C, L, Q, P, _DTYPE_CODE[value.dtype], levels.index_code, device, threads,
        0 if lp is None else ctypes.addressof(lp), flags, value.data_ptr(), shapes_ptr,
        starts_ptr, loc.data_ptr(), attn.data_ptr(), out.data_ptr(), stream))
    if status:
        _check(status)
    return out


def _backward(grad_out, value, levels, loc, attn, sizes, need_value, need_loc, need_attn,
              lp=None, flags=0):
    B, S, H, C, L, Q, P = sizes
    grad_out = grad_out.contiguous()
    if grad_out.dtype != value.dtype:
        grad_out = grad_out.to(value.dtype)
    device, stream, threads = _device_args(value)
    # grad_value of a half type: on the CPU the library accumulates it in an f32 buffer, cast
    # once here; on CUDA it has value's dtype (c/msda.h: the library accumulates in f32 where
    # it must, in the workspace it asks for).
    grad_value = None
    if need_value:
        grad_value = (value.new_empty(value.shape) if device >= 0 or value.dtype in _FULL_DTYPES
                      else value.new_empty(value.shape, dtype=torch.float32))
    grad_loc = torch.empty_like(loc) if need_loc else None
    grad_attn = torch.empty_like(attn) if need_attn else None
    workspace, workspace_bytes = None, 0
    if (need_value and device >= 0
            and (flags & _lib.FLAG_DETERMINISTIC or value.dtype not in _FULL_DTYPES)):
        workspace_bytes = lib.msda_backward_workspace_size(
            B, S, H, C, L, Q, P, _DTYPE_CODE[value.dtype], device, flags)
        if workspace_bytes < 0:
            _check(_lib.ERR_INVALID_ARGUMENT)
        if workspace_bytes > 0:
            workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=value.device)
    shapes_ptr, starts_ptr = levels.pointers or levels.read_pointers()
    status = _msda_backward(
        B, S, H, C, L, Q, P, _DTYPE_CODE[value.dtype], levels.index_code, device, threads,
        lp, flags, value.data_ptr(), shapes_ptr, starts_ptr,
        loc.data_ptr(), attn.data_ptr(), grad_out.data_ptr(),
        grad_value.data_ptr() if need_value else None,
        grad_loc.data_ptr() if need_loc else None,
        grad_attn.data_ptr() if need_attn else None,
        workspace.data_ptr() if workspace is not None else None, workspace_bytes, stream)
    if status:
        _check(status)
    if grad_value is not None and grad_value.dtype != value.dtype:
        grad_value = grad_value.to(value.dtype)
    return grad_value, grad_loc, grad_attn


_FULL_DTYPES = (torch.float32, torch.float64)


def _grads_of_node(ctx, grad_out):
    value, loc, attn = ctx.saved_tensors
    need_value, need_loc, need_attn = ctx.needs_input_grad[:3]
    levels, sizes, lp, flags = ctx.plan
    grads = _backward(grad_out, value, levels, loc, attn, sizes, need_value, need_loc, need_attn,
                      lp, flags)
    return grads + (None,)


_grads_once_differentiable = torch.autograd.function.once_differentiable(_grads_of_node)


class _MSDA(torch.autograd.Function):
    """The eager autograd node (every torch version): forward and backward call C directly."""

    @staticmethod
    def forward(ctx, value, sampling_locations, attention_weights, plan):
        # plan = (levels, sizes, lp, flags): one argument, so apply() has fewer to look at
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        ctx.plan = plan
        levels, sizes, lp, flags = plan
        return _forward(value, levels, sampling_locations, attention_weights, sizes, lp, flags)

    @staticmethod
    def backward(ctx, grad_out):
        # The library's gradients are not differentiable again. With create_graph=True (grad
        # mode on here) once_differentiable makes a second derivative raise instead of being
        # silently 0; otherwise its no_grad wrapper is skipped (a few microseconds a call).
        if torch.is_grad_enabled():
            return _grads_once_differentiable(ctx, grad_out)
        return _grads_of_node(ctx, grad_out)


def _find_apply_direct():
    """torch.autograd.Function.apply is a Python wrapper (functorch transforms, setup_context's
    default arguments) around the C++ apply of torch._C._FunctionBase. Outside functorch
    transforms _MSDA, which has no setup_context, needs none of it, and calling the C++ apply
    directly saves about 2 us a call (4-5 on a slow host). None where this torch is laid out
    otherwise: then _MSDA.apply is used."""
    if _functorch_active is None:
        return None
    try:
        direct = super(torch.autograd.Function, _MSDA).apply
    except AttributeError:
        return None
    wrapper = getattr(torch.autograd.Function.apply, "__func__", None)
    if getattr(direct, "__func__", None) is wrapper or getattr(direct, "__self__", None) is not _MSDA:
        return None
    return direct


_functorch_active = getattr(torch._C, "_are_functorch_transforms_active", None)
_apply_direct = _find_apply_direct()


def _library_serves(device):
    return device.type == "cpu" or (device.type == "cuda" and _has_cuda_kernels)


_has_cuda_kernels = bool(lib.msda_has_cuda())


def _reference(value, spatial_shapes, loc, attn, num_points_list, flags):
    """The pure-PyTorch op, for a device the library does not serve (a GPU without the
    library's CUDA kernels, MPS, ...)."""
    from .reference import ms_deform_attn_pytorch
    return ms_deform_attn_pytorch(
        value, spatial_shapes, loc, attn, num_points_list=num_points_list,
        sampling="nearest" if flags & _lib.FLAG_NEAREST else "bilinear",
        softmax=bool(flags & _lib.FLAG_SOFTMAX))


# ---------------------------------------------------------------------------------------------
# torch.library: pymsda::ms_deform_attn_forward and pymsda::ms_deform_attn_backward
#
# Schema (the tensors as ms_deform_attn documents them; spatial_shapes is always a tensor here):
#   ms_deform_attn_forward(Tensor value, Tensor spatial_shapes, Tensor? level_start_index,
#       Tensor sampling_locations, Tensor attention_weights, SymInt[]? num_points_list,
#       SymInt flags) -> Tensor
#   ms_deform_attn_backward(Tensor grad_output, <the forward's arguments>, bool need_value,
#       bool need_sampling_locations, bool need_attention_weights) -> (Tensor, Tensor, Tensor)
# flags is a bitwise OR of msda_flags (c/msda.h). A gradient that is not needed comes back as an
# empty (0,) tensor; the gradients have the dtypes of value, sampling_locations and
# attention_weights.


def _forward_impl(value: torch.Tensor, spatial_shapes: torch.Tensor,
                  level_start_index: Optional[torch.Tensor], sampling_locations: torch.Tensor,
                  attention_weights: torch.Tensor, num_points_list: Optional[List[int]],
                  flags: int) -> torch.Tensor:
    value, levels, loc, attn, sizes, lp = _prepare(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        num_points_list=num_points_list)
    return _forward(value, levels, loc, attn, sizes, lp, flags)


def _forward_fake(value, spatial_shapes, level_start_index, sampling_locations,
                  attention_weights, num_points_list, flags):
    B, S, H, C, L, Q, P = _check_shapes_only(value, spatial_shapes, level_start_index,
                                             sampling_locations, attention_weights,
                                             num_points_list)
    return value.new_empty((B, Q, H * C))


def _check_grad_output(grad_output, B, Q, H, C, device):
    """The backward op's grad_output (autograd guarantees it for the eager node; a direct caller
    of the op does not, and the library cannot check its size)."""
    if not isinstance(grad_output, torch.Tensor):
        raise TypeError(f"grad_output must be a torch.Tensor, got {type(grad_output).__name__}")
    if (grad_output.shape != (B, Q, H * C) or grad_output.device != device
            or not grad_output.is_floating_point()):
        raise ValueError(f"grad_output must be a float tensor of shape {(B, Q, H * C)} on "
                         f"{device}, got {_describe(grad_output)}")


def _backward_impl(grad_output: torch.Tensor, value: torch.Tensor, spatial_shapes: torch.Tensor,
                   level_start_index: Optional[torch.Tensor], sampling_locations: torch.Tensor,
                   attention_weights: torch.Tensor, num_points_list: Optional[List[int]],
                   flags: int, need_value: bool, need_sampling_locations: bool,
                   need_attention_weights: bool
                   ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    v, levels, loc, attn, sizes, lp = _prepare(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        num_points_list=num_points_list)
    B, S, H, C, L, Q, P = sizes
    _check_grad_output(grad_output, B, Q, H, C, v.device)
    grads = _backward(grad_output, v, levels, loc, attn, sizes, need_value,
                      need_sampling_locations, need_attention_weights, lp, flags)
    return tuple(torch.empty((0,), dtype=like.dtype, device=like.device) if grad is None
                 else grad.to(like.dtype)
                 for grad, like in zip(grads, (value, sampling_locations, attention_weights)))


def _backward_fake(grad_output, value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, num_points_list, flags, need_value,
                   need_sampling_locations, need_attention_weights):
    B, S, H, C, L, Q, P = _check_shapes_only(value, spatial_shapes, level_start_index,
                                             sampling_locations, attention_weights,
                                             num_points_list)
    _check_grad_output(grad_output, B, Q, H, C, value.device)
    return tuple(like.new_empty(like.shape if need else (0,)) for like, need in (
        (value, need_value), (sampling_locations, need_sampling_locations),
        (attention_weights, need_attention_weights)))


def _setup_context(ctx, inputs, output):
    value, spatial_shapes, level_start_index, loc, attn, num_points_list, flags = inputs
    ctx.save_for_backward(value, spatial_shapes, level_start_index, loc, attn)
    ctx.num_points_list, ctx.flags = num_points_list, flags


def _backward_formula(ctx, grad_output):
    value, spatial_shapes, level_start_index, loc, attn = ctx.saved_tensors
    need_value, _, _, need_loc, need_attn = ctx.needs_input_grad[:5]
    grad_value, grad_loc, grad_attn = _backward_op(
        grad_output, value, spatial_shapes, level_start_index, loc, attn, ctx.num_points_list,
        ctx.flags, need_value, need_loc, need_attn)
    return (grad_value if need_value else None, None, None, grad_loc if need_loc else None,
            grad_attn if need_attn else None, None, None)


def _register():
    """The two ops, or (None, None) on a torch without torch.library.custom_op (< 2.4): the
    eager path needs none of it."""
    custom_op = getattr(torch.library, "custom_op", None)
    if custom_op is None:
        return None, None
    forward_op = custom_op("pymsda::ms_deform_attn_forward", mutates_args=())(_forward_impl)
    backward_op = custom_op("pymsda::ms_deform_attn_backward", mutates_args=())(_backward_impl)
    forward_op.register_fake(_forward_fake)
    backward_op.register_fake(_backward_fake)
    forward_op.register_autograd(_backward_formula, setup_context=_setup_context)
    return forward_op, backward_op


_forward_op, _backward_op = _register()
HAS_TORCH_LIBRARY_OPS = _forward_op is not None

_is_compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
_dispatch_modes = getattr(torch._C, "_len_torch_dispatch_stack", None) or (lambda: 0)
_EAGER_TYPES = (torch.Tensor, torch.nn.Parameter)


def _tracing():
    """torch.compile or torch.export tracing, or a dispatch mode (fake tensors, make_fx,
    FlopCounterMode): tensors made now may not be real, so nothing is cached."""
    return _is_compiling() or _dispatch_modes() > 0


def _traced(value, sampling_locations, attention_weights):
    """Whether this call must go through the dispatcher to be seen: _tracing(), or a tensor
    subclass. Plain tensors in eager mode answer False within a few hundred nanoseconds."""
    if _is_compiling() or _dispatch_modes():
        return True
    for t in (value, sampling_locations, attention_weights):
        if type(t) not in _EAGER_TYPES and isinstance(t, torch.Tensor):
            return True
    return False


def _ms_deform_attn_traced(value, spatial_shapes, level_start_index, sampling_locations,
                           attention_weights, num_points_list, flags):
    """ms_deform_attn through pymsda::ms_deform_attn_forward. Written for torch.compile to
    trace: no data is read; host-side shape lists are checked here and become constant tensors
    of the graph; the op's fake implementation checks the rest, its real one checks again."""
    per_level = num_points_list is None
    _check_float_tensor("value", value, 4)
    _check_float_tensor("sampling_locations", sampling_locations, 6 if per_level else 5)
    _check_float_tensor("attention_weights", attention_weights, 5 if per_level else 4)
    device = value.device
    if not isinstance(spatial_shapes, torch.Tensor):
        pairs = _check_pairs(spatial_shapes)
        starts, total = _starts_of(pairs)
        if total != value.shape[1]:
            raise ValueError(
                f"spatial_shapes {list(pairs)} cover sum(H*W) = {total} positions but value "
                f"has S = {value.shape[1]} (value.shape[1])")
        if level_start_index is not None and not isinstance(level_start_index, torch.Tensor):
            if [int(s) for s in level_start_index] != starts:
                raise ValueError(f"level_start_index {list(level_start_index)} does not match "
                                 f"spatial_shapes {list(pairs)}: expected {starts}")
            level_start_index = None
        spatial_shapes = torch.tensor(pairs, dtype=torch.int64, device=device)
        if level_start_index is None:
            level_start_index = torch.tensor(starts, dtype=torch.int64, device=device)
    elif level_start_index is not None and not isinstance(level_start_index, torch.Tensor):
        level_start_index = torch.tensor([int(s) for s in level_start_index],
                                         dtype=spatial_shapes.dtype, device=device)
    if not per_level:
        num_points_list = list(_point_counts(num_points_list, spatial_shapes.shape[0]))
    if not _library_serves(device):
        return _reference(value, spatial_shapes, sampling_locations.to(value.dtype),
                          attention_weights.to(value.dtype), num_points_list, flags)
    if sampling_locations.dtype != value.dtype:
        sampling_locations = sampling_locations.to(value.dtype)
    if attention_weights.dtype != value.dtype:
        attention_weights = attention_weights.to(value.dtype)
    return _forward_op(value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights, num_points_list, flags)


# ---------------------------------------------------------------------------------------------
# public API


_SAMPLING_FLAGS = {"bilinear": 0, "nearest": _lib.FLAG_NEAREST}
_deterministic_algorithms = torch.are_deterministic_algorithms_enabled
_Tensor = torch.Tensor


def _flags(sampling, softmax, deterministic):
    try:
        flags = _SAMPLING_FLAGS[sampling]
    except (KeyError, TypeError):
        raise ValueError(f"sampling must be 'bilinear' or 'nearest', got {sampling!r}") from None
    if softmax:
        flags |= _lib.FLAG_SOFTMAX
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if deterministic:
        flags |= _lib.FLAG_DETERMINISTIC
    return flags


def ms_deform_attn(value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, im2col_step=None, *, num_points_list=None,
                   sampling="bilinear", softmax=False, deterministic=None, validate=False):
    """Multi-Scale Deformable Attention (Deformable DETR's MSDeformAttnFunction).

    Args:
        value: (B, S, H, C) float32/float64/float16/bfloat16, the flattened feature maps of all
            levels, S = sum_l H_l * W_l.
        spatial_shapes: (L, 2) int64 or int32 tensor on any device, rows (H_l, W_l); or a list of
            (H, W) pairs.
        level_start_index: (L,) int64 or int32 tensor, the offset of each level in S; or None to
            derive it from spatial_shapes (without a device synchronisation).
        sampling_locations: (B, Q, H, L, P, 2), last dim (x, y) normalised to [0, 1]: x = 0 is
            the left edge of the level, x = 1 its right edge (pixel centres at (j + 0.5) / W).
            Points outside [0, 1] are allowed; neighbours outside the map contribute 0.
        attention_weights: (B, Q, H, L, P), already normalised by the caller (softmax), or
            logits with softmax=True.
        im2col_step: accepted for compatibility and ignored: any batch size works.
        num_points_list: per-level point counts (RT-DETRv2), a list of L ints >= 0. Then
            sampling_locations is (B, Q, H, N, 2) and attention_weights (B, Q, H, N) with
            N = sum(num_points_list), level 0's points first.
        sampling: "bilinear" (default) or "nearest": read the single pixel
            (clamp(floor(x * W_l + 0.5), 0, W_l - 1), clamp(floor(y * H_l + 0.5), 0, H_l - 1)),
            RT-DETRv2's "discrete" method; the location gradient is then 0.
        softmax: attention_weights are logits; the op applies the softmax over all points of
            each (query, head) itself (forward and backward), saving a separate kernel.
        deterministic: bitwise reproducible gradients (grad_value accumulated in 64-bit fixed
            point on CUDA, with a workspace of 8 bytes per value element; the CPU backward is
            deterministic anyway). None (default) follows
            torch.are_deterministic_algorithms_enabled().
        validate: also check spatial_shapes and level_start_index when they live on the GPU
            (sizes >= 1, sum of H*W == S, starts consistent), which costs a device
            synchronisation (so not inside CUDA graph capture); a bad table raises ValueError.
            The environment variable PYMSDA_VALIDATE=1 turns it on for every call. Without it,
            device-side tables are trusted: tables that disagree with value give wrong numbers
            but never a read or write outside the tensors. Host-side tables (a list or a CPU
            tensor) are always checked. Under torch.compile and torch.export the op checks
            device-side tables only with PYMSDA_VALIDATE=1 (read when the compiled code runs).

    Returns:
        (B, Q, H * C) tensor of value's dtype:
        out[b, q, h*C + c] = sum_{l,p} A[b,q,h,l,p] * bilinear(V_l[b, :, :, h, c],
                                                      loc_x * W_l - 0.5, loc_y * H_l - 0.5),
        i.e. grid_sample(bilinear, padding_mode="zeros", align_corners=False) with
        grid = 2 * loc - 1. sampling_locations and attention_weights of another float dtype are
        cast to value's dtype. Differentiable with respect to value, sampling_locations and
        attention_weights. Half precision accumulates in float32; on CUDA (sm_90 and newer) the
        float32 sums of grad_value are added into the half-precision gradient with atomics,
        each rounded once as it is added (deterministic=True rounds each element once).
        Empty batches or query sets (B = 0, Q = 0) give empty outputs and gradients; meta
        tensors give a meta output.

    Non-finite input (CPU and CUDA, forward and backward):
        A sampling location that is NaN or +-Inf in x or y (or so far outside its level that
        no corner is inside) contributes nothing: the point adds 0 to the output, its weight
        and location gradients are 0 and it scatters nothing into grad_value, whatever its
        attention weight. A NaN or +-Inf attention weight of a point with a corner inside
        enters the sum by IEEE arithmetic: out[b, q, h, :] becomes NaN (NaN weight) or
        non-finite (Inf weight), as do the location gradient of that point and grad_value at
        its corners; its own weight gradient (the bilinear sample) stays finite.

    Autocast (dtype rule):
        The op runs in value's dtype and casts sampling_locations and attention_weights to it;
        it is not itself on an autocast list. Under torch.autocast("cuda", torch.bfloat16) a
        value projected by an nn.Linear is bfloat16, so the op runs in bfloat16 (accumulating in
        float32) even where the locations or the softmaxed weights are float32; their
        gradients come back in their own dtypes. To run it in float32 under autocast, pass
        value.float().

    torch.compile, torch.export, CUDA graphs:
        Where torch has torch.library.custom_op (2.4 and later) the op is registered as
        torch.ops.pymsda.ms_deform_attn_forward / ms_deform_attn_backward with fake
        implementations and autograd, so torch.compile(fullgraph=True) and torch.export trace
        it without a graph break (a list of shapes becomes a constant tensor of the graph).
        Eager calls skip the dispatcher and call the library directly. Nothing in the op reads
        a GPU tensor on the host or synchronises (validate aside), and a list of shapes is
        copied to each device once and cached, so calls can be captured in CUDA graphs once
        the op has run with those shapes outside capture.

    Raises:
        TypeError for a wrong type or dtype and ValueError for a wrong shape, size, device or
        shape table, each naming the argument; ValueError or RuntimeError from the library
        (message from c/msda.h's msda_last_error) should a check in C refuse the call.
    """
    if (num_points_list is None and sampling == "bilinear" and not softmax
            and deterministic is None and not validate and type(value) is _Tensor
            and type(sampling_locations) is _Tensor and type(attention_weights) is _Tensor
            and not _is_compiling() and not _dispatch_modes()):
        out = _common_call(value, spatial_shapes, level_start_index, sampling_locations,
                           attention_weights)
        if out is not None:
            return out
    if sampling == "bilinear" and not softmax and deterministic is None:
        flags = _lib.FLAG_DETERMINISTIC if _deterministic_algorithms() else 0
    else:
        flags = _flags(sampling, softmax, deterministic)
    if HAS_TORCH_LIBRARY_OPS and (
            _is_compiling() or _dispatch_modes() or not (
                type(value) is _Tensor and type(sampling_locations) is _Tensor
                and type(attention_weights) is _Tensor)) and _traced(
                    value, sampling_locations, attention_weights):
        return _ms_deform_attn_traced(value, spatial_shapes, level_start_index,
                                      sampling_locations, attention_weights, num_points_list,
                                      flags)
    value, levels, loc, attn, sizes, lp = _prepare(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        validate, num_points_list)
    if not (_has_cuda_kernels if value.is_cuda else value.device.type == "cpu"):
        device = value.device  # a device the library does not serve
        if device.type == "meta":
            return _MetaMSDA.apply(value, loc, attn, sizes)
        return _reference(value, levels.host if levels.host is not None else levels.shapes,
                          loc, attn, num_points_list, flags)
    if torch.is_grad_enabled() and (value.requires_grad or loc.requires_grad or attn.requires_grad):
        if _apply_direct is not None and not _functorch_active():
            return _apply_direct(value, loc, attn, (levels, sizes, lp, flags))
        return _MSDA.apply(value, loc, attn, (levels, sizes, lp, flags))
    return _forward(value, levels, loc, attn, sizes, lp, flags)  # no graph: skip autograd


def _common_call(value, spatial_shapes, level_start_index, loc, attn):
    """The common eager call (plain tensors of one dtype, per-level points, bilinear, no
    options, level tables already seen) in one pass: the output, or None when anything differs
    from that, and the full path then checks everything and says what is wrong."""
    dtype = value.dtype
    if loc.dtype is not dtype or attn.dtype is not dtype or dtype not in _DTYPE_CODE:
        return None
    try:
        B, S, H, C = value.shape
        Bl, Q, Hl, L, P, two = loc.shape
    except ValueError:
        return None
    if two != 2 or Bl != B or Hl != H or attn.shape != (B, Q, H, L, P):
        return None
    device = value.device
    if loc.device != device or attn.device != device:
        return None
    if type(spatial_shapes) is list:
        if level_start_index is not None:
            return None
        try:
            levels = _list_levels_cache.get((tuple(map(tuple, spatial_shapes)), device))
        except TypeError:
            return None
    else:
        levels = _remembered_tensor_levels(spatial_shapes, level_start_index, device)
    if (levels is None or levels.L != L or (levels.total is not None and levels.total != S)
            or C < 1 or H < 1 or P < 1
            or B * H * (S * C + Q * C + Q * L * P * 2) > _MAX_ELEMENTS):
        return None
    value, loc, attn = value.contiguous(), loc.contiguous(), attn.contiguous()
    if (value.data_ptr() | loc.data_ptr() | attn.data_ptr()) % value.element_size():
        return None
    if not (_has_cuda_kernels if value.is_cuda else device.type == "cpu"):
        return None
    plan = (levels, (B, S, H, C, L, Q, P), None,
            _lib.FLAG_DETERMINISTIC if _deterministic_algorithms() else 0)
    if _is_grad_enabled() and (value.requires_grad or loc.requires_grad or attn.requires_grad):
        if _apply_direct is not None and not _functorch_active():
            return _apply_direct(value, loc, attn, plan)
        return _MSDA.apply(value, loc, attn, plan)
    return _forward(value, levels, loc, attn, plan[1], None, plan[3])


_is_grad_enabled = torch.is_grad_enabled


class MSDeformAttnFunction:
    """Deformable DETR's autograd function, as `MSDeformAttnFunction.apply(value,
    value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
    im2col_step)`; im2col_step is ignored."""

    @staticmethod
    def apply(value, value_spatial_shapes, value_level_start_index, sampling_locations,
              attention_weights, im2col_step=None):
        return ms_deform_attn(value, value_spatial_shapes, value_level_start_index,
                              sampling_locations, attention_weights, im2col_step)

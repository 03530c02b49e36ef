"""The arguments of a call as the C library takes them: every argument checked, the level
tables prepared (one device, one index dtype, checked against value where their numbers can be
read without a device synchronisation, and cached, so a model's calls with the same shapes cost
a dictionary lookup), the per-level point counts as the ctypes table the library takes, the
tensors made contiguous and aligned. The common call (tensors of one dtype in the plain layout,
level tables seen before) is answered in one pass (common); anything else goes on to the
checks, which name what is wrong, and to the preparation of what is new (prepare)."""
import ctypes

import torch

from . import _clib
from ._checks import (DTYPE_CODE, HALF_DTYPES as _HALF, INDEX_CODE, MAX_ELEMENTS,
                      aligned_contiguous, check_levels, check_min_sizes, check_pairs,
                      check_positive, check_sampling, check_shapes_tensor, check_sizes,
                      check_start_index_tensor, check_starts, check_tensors, check_total,
                      elements_fit, point_counts)
from ._clib import check as _check, getenv as _getenv, lib, served_cuda as _served_cuda, \
    serves_cuda as _serves_cuda
from ._torch_private import FAKE, current_raw_stream as _current_stream, recording

_Tensor = torch.Tensor


class BoundedCache(dict):
    """A dict that empties itself rather than grow past `limit` entries. Its keys are the level
    shapes and point counts a model uses, a handful; a full cache means they keep changing,
    and starting over is cheaper than tracking which entries are in use."""

    __slots__ = ("limit",)

    def __init__(self, limit):
        super().__init__()
        self.limit = limit

    def put(self, key, value):
        if len(self) >= self.limit:
            self.clear()
        self[key] = value


_level_points_cache = BoundedCache(256)  # (num_points_list as a tuple, L) -> (total, ctypes table)


def level_points_table(num_points_list, L):
    """num_points_list checked against L, as (total points, ctypes int64 array, kept alive)."""
    try:
        key = (tuple(num_points_list), L)
        hit = _level_points_cache.get(key)
    except TypeError:
        key = hit = None
    if hit is None:
        counts = point_counts(num_points_list, L)
        hit = (sum(counts), (ctypes.c_int64 * L)(*counts))
        if key is not None:
            _level_points_cache.put(key, hit)
    return hit


def _validating(validate):
    """validate, or PYMSDA_VALIDATE=1 (read on every call, so setting it later counts). Only
    asked where it changes something (tables on the GPU)."""
    return validate or _getenv(b"PYMSDA_VALIDATE") == b"1"


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
        self.index_code = INDEX_CODE[shapes.dtype]
        self.L = shapes.shape[0]
        self.pointers = None  # (shapes, starts) data pointers, read at the first library call

    def read_pointers(self):
        """The tables' data pointers, read once: the two tensors are this object's own (cached
        copies made here, or per-call views), which nothing resizes. Not read before a library
        call, since fake and meta tensors have none."""
        self.pointers = (self.shapes.data_ptr(), self.starts.data_ptr())
        return self.pointers


def level_starts(spatial_shapes):
    """level_start_index of spatial_shapes, by the rule of c/msda.h's msda_level_starts: start_l
    = sum over j < l of H_j * W_j. (H, W) pairs give a list of ints; an (L, 2) integer tensor
    gives an (L,) int64 tensor on its device, computed by torch operators that a tracer records
    (a traced or exported graph derives the starts as it runs). The C function also caps the
    starts of tables that overrun S (they read nothing there); tables checked here do not."""
    if isinstance(spatial_shapes, torch.Tensor):
        sizes = spatial_shapes[:, 0] * spatial_shapes[:, 1]
        return torch.cumsum(sizes, 0) - sizes
    starts, total = [], 0
    for h, w in spatial_shapes:
        starts.append(total)
        total += h * w
    return starts


# Level tables built from host-side shapes, per (pairs, device, dtype): a list of shapes is then
# copied to the GPU once, not on every call.
_level_cache = BoundedCache(256)


def _levels_from_host(pairs, device, dtype=torch.int64):
    key = (pairs, device, dtype)
    levels = _level_cache.get(key)
    if levels is None:
        starts = level_starts(pairs)
        total = starts[-1] + pairs[-1][0] * pairs[-1][1]
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
        if not recording() & FAKE:  # under a fake mode these tensors are fake: never keep them
            _level_cache.put(key, levels)
    return levels


# (spatial_shapes given as a list, as a hashable tuple, device) -> _Levels
_list_levels_cache = BoundedCache(256)


def _levels_from_list(spatial_shapes, device):
    """The checked level tables of a list of (H, W) pairs on device, cached: the common call
    costs one tuple and one dictionary lookup."""
    try:
        key = (tuple(map(tuple, spatial_shapes)), device)
        levels = _list_levels_cache.get(key)
    except TypeError:  # not a sequence of sequences, or unhashable: let the check say why
        key = levels = None
    if levels is None:
        levels = _levels_from_host(check_pairs(spatial_shapes), device)
        if key is not None and not recording() & FAKE:
            _list_levels_cache.put(key, levels)
    return levels


def _host_pairs(spatial_shapes, device, validate=False):
    """A spatial_shapes tensor as a tuple of (H, W) int pairs, checked; None when it lives on
    the device that runs the op and reading it there would synchronise (unless validate asks
    for exactly that), or on meta."""
    check_shapes_tensor(spatial_shapes, device)
    if spatial_shapes.device.type == "meta":
        return None
    if (spatial_shapes.device.type != "cpu" and device.type != "cpu"
            and not _validating(validate)):
        return None
    pairs = tuple(tuple(p) for p in spatial_shapes.tolist())
    check_positive(pairs)
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
_tensor_levels_cache = BoundedCache(16)


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
    _tensor_levels_cache.put((id(spatial_shapes), id(level_start_index), device), entry)


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
            and not recording() & FAKE and (levels.host is not None or not _validating(validate))):
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
        check_total(pairs, S)  # raises
    L = len(pairs) if pairs is not None else spatial_shapes.shape[0]

    if level_start_index is not None:
        if not isinstance(level_start_index, torch.Tensor):
            level_start_index = torch.as_tensor(level_start_index)
        check_start_index_tensor(level_start_index, L, device)
        # Read it where that costs no device synchronisation (or validate asks for one).
        if levels is not None and (
                level_start_index.device.type == "cpu" or device.type == "cpu" or (
                level_start_index.device.type != "meta" and _validating(validate))):
            check_starts(level_start_index.tolist(), pairs, levels.host_starts)

    if levels is not None:
        return levels

    # The shapes live on the value's device: reading them here would synchronise, so nothing
    # does; the kernels bounds-check every read instead.
    shapes = aligned_contiguous(spatial_shapes.to(device))
    if level_start_index is not None:
        starts = aligned_contiguous(level_start_index.to(device=device, dtype=shapes.dtype))
    elif device.type == "cuda" and _serves_cuda(device.index) and not recording() & FAKE:
        # derived on the device by one small kernel (c/msda.h), afresh on every call, so that
        # a change of the shapes' numbers is followed
        starts = torch.empty(shapes.shape[0], dtype=shapes.dtype, device=device)
        _check(lib.msda_level_starts(shapes.shape[0], S, INDEX_CODE[shapes.dtype],
                                     device.index, shapes.data_ptr(), starts.data_ptr(),
                                     _current_stream(device.index)))
    else:  # meta tensors, or a device the library does not serve
        starts = level_starts(shapes)
    return _Levels(shapes, starts, None)


def shapes_tensor(spatial_shapes, device: torch.device):
    """spatial_shapes as an (L, 2) tensor, for modules that pass it on to the op. A list becomes
    the op's own cached int64 tensor on device (checked; the same tensor for the same shapes),
    so an eager call copies nothing to the GPU and can be captured in a CUDA graph; while
    torch.compile traces, a constant of the graph. (device is annotated for torch.jit.script of
    MSDeformAttn, which compiles only the first branch: spatial_shapes is a tensor there.)"""
    if isinstance(spatial_shapes, torch.Tensor):
        return spatial_shapes
    if recording() & FAKE:
        return torch.as_tensor(spatial_shapes, device=device)
    return _levels_from_list(spatial_shapes, torch.device(device)).shapes


# ---------------------------------------------------------------------------------------------
# the call

def prepare(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
            validate=False, num_points_list=None, flags=0):
    """Checks every argument (after common() found the call unusual, or for the torch.library
    ops' implementations); returns (value, sampling_locations, attention_weights, call) as the
    C library takes them, call = (levels, sizes, level_points, flags). validate: also read
    shape tables that live on the GPU and check them (a device synchronisation). With
    num_points_list, sampling_locations is (B, Q, H, sum(num_points_list), 2) and
    attention_weights (B, Q, H, sum(num_points_list)); P is then that sum and level_points the
    ctypes table of counts (None without num_points_list)."""
    per_level = num_points_list is None
    B, S, H, C, Q, P, L = check_tensors(value, sampling_locations, attention_weights, per_level)
    levels = _prepare_levels(spatial_shapes, level_start_index, S, value.device, validate)
    L_tables = levels.L
    lp = None
    if not per_level:
        total, lp = level_points_table(num_points_list, L_tables)
        L = check_levels(L_tables, L, P, num_points_list, sampling_locations, total)
    elif L_tables != L:
        check_levels(L_tables, L, P, None, sampling_locations)  # raises
    if C < 1 or H < 1 or L < 1 or P < 1:
        check_min_sizes(H, C, L, P)  # raises
    if not elements_fit(B, S, H, C, L, Q, P):
        check_sizes(B, S, H, C, L if per_level else 1, Q, P)

    loc, attn = points_as_read(value.dtype, sampling_locations, attention_weights)
    value, loc, attn = value.contiguous(), loc.contiguous(), attn.contiguous()
    # One alignment test for the three (the larger element size, the points'): a misaligned
    # one is rare (only torch.frombuffer makes one), so the common call reads each pointer once.
    if (value.data_ptr() | loc.data_ptr() | attn.data_ptr()) % loc.element_size():
        value, loc, attn = aligned_contiguous(value), aligned_contiguous(loc), \
            aligned_contiguous(attn)
    if loc.dtype is not value.dtype:
        flags |= _clib.FLAG_POINTS_F32
    return value, loc, attn, (levels, (B, S, H, C, L, Q, P), lp, flags)


# ---------------------------------------------------------------------------------------------
# the dtypes the points are read in

_F32 = torch.float32


def points_dtype(dtype, loc_dtype, attn_dtype):
    """The dtype rule (ms_deform_attn's docstring, docs/numerics.md): the dtype in which the op
    reads sampling_locations and attention_weights with a value of dtype `dtype`. That dtype
    when both have it, else float32 with a half value, else `dtype`. So autocast's float32
    points are read as float32, a narrower point dtype is widened, and nothing is rounded to
    half precision on the way in; a half value with float32 points is the C library's
    MSDA_POINTS_F32."""
    if loc_dtype is dtype and attn_dtype is dtype:
        return dtype
    return _F32 if dtype in _HALF else dtype


def points_as_read(dtype, loc, attn):
    """sampling_locations and attention_weights in the dtype the op reads them in (points_dtype)
    with a value of dtype `dtype`."""
    to = points_dtype(dtype, loc.dtype, attn.dtype)
    return loc if loc.dtype is to else loc.to(to), attn if attn.dtype is to else attn.to(to)


# ---------------------------------------------------------------------------------------------
# the common call, in one pass

def common(value, spatial_shapes, level_start_index, loc, attn, flags):
    """The common call (tensors in the plain layout on a device the library serves, the points
    in the dtype they are read in, level tables seen before) in one pass: prepare()'s answer,
    or None when anything differs from it (then prepare() checks everything and says what is
    wrong, or prepares what is new)."""
    dtype = value.dtype
    if loc.dtype is not dtype or attn.dtype is not dtype or dtype not in DTYPE_CODE:
        # still the common call with the points in the dtype they are read in: autocast's
        # float32 points with a half value (MSDA_POINTS_F32)
        if (dtype not in DTYPE_CODE or loc.dtype is not attn.dtype
                or points_dtype(dtype, loc.dtype, attn.dtype) is not loc.dtype):
            return None
        flags |= _clib.FLAG_POINTS_F32
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
            or B * H * (S * C + Q * C + Q * L * P * 2) > MAX_ELEMENTS  # (elements_fit)
            or not (device.index in _served_cuda if value.is_cuda else device.type == "cpu")):
        return None
    value, loc, attn = value.contiguous(), loc.contiguous(), attn.contiguous()
    if (value.data_ptr() | loc.data_ptr() | attn.data_ptr()) % loc.element_size():
        return None  # misaligned (torch.frombuffer): prepare copies
    return value, loc, attn, (levels, (B, S, H, C, L, Q, P), None, flags)


# ---------------------------------------------------------------------------------------------
# the options

_SAMPLING_FLAGS = {"bilinear": 0, "nearest": _clib.FLAG_NEAREST}
deterministic_algorithms = torch.are_deterministic_algorithms_enabled


def flags_of(sampling, deterministic):
    """The msda_flags (c/msda.h) of a call's options; ValueError naming a bad sampling."""
    try:
        flags = _SAMPLING_FLAGS[sampling]
    except (KeyError, TypeError):  # (an unhashable sampling)
        flags = None
    if flags is None:
        check_sampling(sampling)  # raises
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if deterministic:
        flags |= _clib.FLAG_DETERMINISTIC
    return flags

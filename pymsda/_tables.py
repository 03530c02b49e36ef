"""spatial_shapes and level_start_index as the C library takes them: one device, one index dtype,
checked against value where their numbers can be read without a device synchronisation, and
cached, so a model's calls with the same shapes cost a dictionary lookup. Also the per-level
point counts (num_points_list) as the ctypes table the library takes, cached the same way."""
import ctypes

import torch

from ._checks import (_INDEX_CODE, _aligned_contiguous, _check_pairs, _check_positive,
                      _check_shapes_tensor, _check_start_index_tensor, _point_counts)
from ._clib import check as _check, lib, \
    serves_cuda as _serves_cuda
from ._clib import getenv as _getenv
from ._torch_private import current_raw_stream as _current_stream, tracing as _tracing

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
_level_cache = BoundedCache(256)


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
        levels = _levels_from_host(_check_pairs(spatial_shapes), device)
        if key is not None and not _tracing():
            _list_levels_cache.put(key, levels)
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
    elif device.type == "cuda" and _serves_cuda(device.index) and not _tracing():
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


def shapes_tensor(spatial_shapes, device: torch.device):
    """spatial_shapes as an (L, 2) tensor, for modules that pass it on to the op. A list becomes
    the op's own cached int64 tensor on device (checked; the same tensor for the same shapes),
    so an eager call copies nothing to the GPU and can be captured in a CUDA graph; while
    torch.compile traces, a constant of the graph. (device is annotated for torch.jit.script of
    MSDeformAttn, which compiles only the first branch: spatial_shapes is a tensor there.)"""
    if isinstance(spatial_shapes, torch.Tensor):
        return spatial_shapes
    if _tracing():
        return torch.as_tensor(spatial_shapes, device=device)
    return _levels_from_list(spatial_shapes, torch.device(device)).shapes

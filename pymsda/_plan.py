"""The one checked path of an eager call: every argument checked, the level tables prepared,
the tensors made contiguous and aligned, as (value, levels, sampling_locations,
attention_weights, sizes, level points). The common call (tensors of one dtype in the plain
layout, level tables seen before) is answered in one pass at the top; anything else goes on to
the checks, which name what is wrong, and to the preparation of what is new."""
import torch

from . import _clib
from ._checks import (_DTYPE_CODE, _MAX_ELEMENTS, _aligned_contiguous, _check_levels,
                      _check_min_sizes, _check_sizes, _check_tensors, _elements_fit)
from ._clib import served_cuda as _served_cuda
from ._tables import (_level_points, _list_levels_cache, _prepare_levels,
                      _remembered_tensor_levels)


def _prepare(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
             validate=False, num_points_list=None):
    """Checks every argument; returns the tensors in the form the C library takes (after _common
    found the call unusual, or for the traced ops' real implementations). validate:
    also read shape tables that live on the GPU and check them (a device synchronisation).
    With num_points_list, sampling_locations is (B, Q, H, sum(num_points_list), 2) and
    attention_weights (B, Q, H, sum(num_points_list)); the returned P is that sum and lp the
    ctypes table of counts (None without num_points_list)."""
    per_level = num_points_list is None
    B, S, H, C, Q, P, L = _check_tensors(value, sampling_locations, attention_weights, per_level)
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
    if not _elements_fit(B, S, H, C, L, Q, P):
        _check_sizes(B, S, H, C, L if per_level else 1, Q, P)

    sampling_locations, attention_weights = _points(value.dtype, sampling_locations,
                                                    attention_weights)
    return _contiguous(value, levels, sampling_locations, attention_weights,
                       (B, S, H, C, L, Q, P), lp)


_F32, _HALF = torch.float32, (torch.float16, torch.bfloat16)


def _points(dtype, loc, attn):
    """The dtype rule (ops.ms_deform_attn): sampling_locations and attention_weights as the op
    reads them, in value's dtype `dtype`, or in float32 with a half value unless both are of
    its dtype. So autocast's float32 points are read as float32, a narrower point dtype is
    widened, and nothing is rounded to half precision on the way in."""
    if loc.dtype is dtype and attn.dtype is dtype:
        return loc, attn
    to = _F32 if dtype in _HALF else dtype
    return loc if loc.dtype is to else loc.to(to), attn if attn.dtype is to else attn.to(to)


def _softmax_points(value, loc, attn):
    """softmax=True: attention_weights (logits) softmaxed over each (query, head)'s points, to
    be passed to the plain op. The composition's backward is the faster (kernels/TUNING.md:
    softmax=True). The softmax runs in the dtype the op reads the points in (_points), so
    logits that are widened to float32 are widened first; it is torch's own softmax otherwise
    (under autocast, float32)."""
    x = attn.flatten(3) if attn.dim() == 5 else attn  # (B, Q, H, L * P) or (B, Q, H, N)
    dtype = value.dtype
    to = attn.dtype if loc.dtype is dtype and attn.dtype is dtype else (
        _F32 if dtype in _HALF else dtype)
    if to is not attn.dtype:
        x = x.softmax(-1, dtype=to)
    elif to in _HALF and x.device.type == "cpu":  # (torch 1.13 has no half softmax on the CPU)
        x = x.softmax(-1, dtype=_F32).to(to)
    else:
        x = x.softmax(-1)
    return x.view(attn.shape)


def _common(value, spatial_shapes, level_start_index, loc, attn, flags):
    """The common call (tensors of one dtype in the plain layout on a device the library serves,
    level tables seen before) in one pass: the arguments of _autograd._run, or None when
    anything differs from it (then _prepare checks everything and says what is wrong, or
    prepares what is new)."""
    dtype = value.dtype
    if loc.dtype is not dtype or attn.dtype is not dtype or dtype not in _DTYPE_CODE:
        if not (loc.dtype is _F32 and attn.dtype is _F32 and dtype in _HALF):  # autocast's
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
            or B * H * (S * C + Q * C + Q * L * P * 2) > _MAX_ELEMENTS  # (_elements_fit)
            or not (device.index in _served_cuda if value.is_cuda else device.type == "cpu")):
        return None
    value, loc, attn = value.contiguous(), loc.contiguous(), attn.contiguous()
    if (value.data_ptr() | loc.data_ptr() | attn.data_ptr()) % loc.element_size():
        return None  # misaligned (torch.frombuffer): _prepare copies
    return value, loc, attn, (levels, (B, S, H, C, L, Q, P), None, flags)


def _contiguous(value, levels, loc, attn, sizes, lp):
    value, loc, attn = value.contiguous(), loc.contiguous(), attn.contiguous()
    # One alignment test for the three (the larger element size, the points'): a misaligned
    # one is rare (only torch.frombuffer makes one), so the common call reads each pointer once.
    if (value.data_ptr() | loc.data_ptr() | attn.data_ptr()) % loc.element_size():
        value, loc, attn = _aligned_contiguous(value), _aligned_contiguous(loc), \
            _aligned_contiguous(attn)
    return value, levels, loc, attn, sizes, lp


_SAMPLING_FLAGS = {"bilinear": 0, "nearest": _clib.FLAG_NEAREST}
_deterministic_algorithms = torch.are_deterministic_algorithms_enabled


def _flags(sampling, deterministic):
    """The msda_flags (c/msda.h) of a call's options; ValueError naming a bad sampling."""
    try:
        flags = _SAMPLING_FLAGS[sampling]
    except (KeyError, TypeError):
        raise ValueError(f"sampling must be 'bilinear' or 'nearest', got {sampling!r}") from None
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    if deterministic:
        flags |= _clib.FLAG_DETERMINISTIC
    return flags

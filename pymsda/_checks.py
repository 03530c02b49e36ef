"""Argument checks of the MSDA op: each names the argument, the expected shape, dtype or device,
and what was given. The fast checks answer the common call in one pass and fall back to the
named ones, which say what is wrong."""
import torch

from . import _clib

# torch's dtypes by their msda_dtype codes, and the half types (pymsda/_clib.py: DTYPES)
DTYPE_CODE = {getattr(torch, name): code for code, name, _ in _clib.DTYPES}
HALF_DTYPES = tuple(getattr(torch, name) for _, name, half in _clib.DTYPES if half)
_DTYPE_NAMES = [name for _, name, _ in _clib.DTYPES]
INDEX_CODE = {torch.int64: _clib.INDEX_I64, torch.int32: _clib.INDEX_I32}


# ---------------------------------------------------------------------------------------------
# argument checks (shape-only ones are shared with the fake implementations)


def _describe(t):
    return f"shape {tuple(t.shape)}, dtype {t.dtype}, device {t.device}"


# The layout each tensor argument has, by its rank (the smaller with num_points_list: N points
# in all, level 0's first)
_LAYOUTS = {("value", 4): "(B, S, H, C)",
            ("sampling_locations", 6): "(B, Q, H, L, P, 2)",
            ("sampling_locations", 5): "(B, Q, H, N, 2) with num_points_list",
            ("attention_weights", 5): "(B, Q, H, L, P)",
            ("attention_weights", 4): "(B, Q, H, N) with num_points_list"}


def check_float_tensor(name, t, ndim):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in DTYPE_CODE:
        raise TypeError(f"{name} must be {', '.join(_DTYPE_NAMES[:-1])} or {_DTYPE_NAMES[-1]}, "
                        f"got {_describe(t)}")
    if t.dim() != ndim:
        layout = _LAYOUTS.get((name, ndim))
        raise ValueError(f"{name} must have {ndim} dimensions"
                         + (f" {layout}" if layout else "") + f", got {_describe(t)}")


def _check_index_device(name, t, device):
    """An index tensor must be readable where the op runs: on the CPU or on value's device
    (another GPU is copied from). A meta one holds no numbers to read."""
    if t.device.type == "meta" and device.type != "meta":
        raise ValueError(f"{name} is on meta but value is on {device}: index tensors must be "
                         f"on the CPU or on value's device, got {_describe(t)}")


# The C library counts elements and bytes in int64 (msda_forward's size check): a tensor whose
# byte count at 8 bytes an element passes 2^63 cannot be indexed.
MAX_ELEMENTS = (2 ** 63 - 1) // 8


def elements_fit(B, S, H, C, L, Q, P):
    """Whether value, sampling_locations and the output together stay within MAX_ELEMENTS (one
    product: true of every real call)."""
    return B * H * (S * C + Q * C + Q * L * P * 2) <= MAX_ELEMENTS


def check_sizes(B, S, H, C, L, Q, P):
    """Refuses sizes the kernels cannot index before anything tries to copy or allocate them
    (an expanded view of such a size costs no memory, its contiguous copy would)."""
    if elements_fit(B, S, H, C, L, Q, P):
        return
    for what, count in (("value (B, S, H, C)", B * S * H * C),
                        ("sampling_locations (B, Q, H, L, P, 2)", B * Q * H * L * P * 2),
                        ("the output (B, Q, H*C) of value and sampling_locations",
                         B * Q * H * C)):
        if count > MAX_ELEMENTS:
            raise ValueError(f"{what} has {count} elements, more than the {MAX_ELEMENTS} "
                             f"pymsda can index (64-bit byte offsets): "
                             f"B={B} S={S} H={H} C={C} L={L} Q={Q} P={P}")


def aligned_contiguous(t):
    """t contiguous and aligned to its element size (the C library refuses a misaligned
    pointer; torch.frombuffer can make one)."""
    t = t.contiguous()
    if t.data_ptr() % t.element_size():
        t = t.clone()
    return t


def check_tensors(value, sampling_locations, attention_weights, per_level):
    """Types, ranks, devices and the sizes value, sampling_locations and attention_weights share.
    Returns (B, S, H, C, Q, P, L); L is sampling_locations' level count, None without per_level
    (num_points_list), where P is then the number of points of all levels."""
    # One pass for the common call (a few hundred nanoseconds); anything unexpected goes to the
    # checks below, which name whatever is wrong.
    try:
        if (isinstance(value, torch.Tensor) and value.dtype in DTYPE_CODE
                and sampling_locations.dtype in DTYPE_CODE
                and attention_weights.dtype in DTYPE_CODE):
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
    """check_tensors' checks one by one: raises, naming the argument, for the first one that
    fails; returns as check_tensors when none does."""
    loc_ndim = 6 if per_level else 5
    check_float_tensor("value", value, 4)
    check_float_tensor("sampling_locations", sampling_locations, loc_ndim)
    check_float_tensor("attention_weights", attention_weights, loc_ndim - 1)
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


def point_counts(num_points_list, L):
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


def check_levels(L_tables, L, P, num_points_list, sampling_locations, counts_total=None):
    """The level count of the shape tables against sampling_locations (or num_points_list,
    whose total, computed by the caller, is counts_total); returns L."""
    if num_points_list is None:
        if L_tables != L:
            raise ValueError(f"spatial_shapes has {L_tables} levels but "
                             f"sampling_locations has L = {L}: {_describe(sampling_locations)}")
    else:
        L = L_tables
        if counts_total is None:
            counts_total = sum(point_counts(num_points_list, L))
        if counts_total != P:
            raise ValueError(f"sampling_locations has {P} points per query and head but "
                             f"num_points_list {list(num_points_list)} sums to {counts_total}: "
                             f"{_describe(sampling_locations)}")
    return L


def check_min_sizes(H, C, L, P):
    if C < 1 or H < 1 or L < 1 or P < 1:
        raise ValueError(f"H, C, L and P must be >= 1, got H={H} C={C} (value) and L={L} P={P} "
                         "(sampling_locations)")


def check_shapes_tensor(spatial_shapes, device):
    if spatial_shapes.dtype not in INDEX_CODE:
        raise TypeError(
            f"spatial_shapes must be an int64 or int32 tensor, got {_describe(spatial_shapes)}")
    if spatial_shapes.dim() != 2 or spatial_shapes.shape[1] != 2 or spatial_shapes.shape[0] < 1:
        raise ValueError(
            f"spatial_shapes must have shape (L, 2) with L >= 1, got {_describe(spatial_shapes)}")
    _check_index_device("spatial_shapes", spatial_shapes, device)


def check_start_index_tensor(level_start_index, L, device):
    if level_start_index.dtype not in INDEX_CODE:
        raise TypeError("level_start_index must be an int64 or int32 tensor, got "
                        f"{_describe(level_start_index)}")
    if level_start_index.dim() != 1 or level_start_index.shape[0] != L:
        raise ValueError(f"level_start_index must have shape ({L},) to match spatial_shapes, "
                         f"got {_describe(level_start_index)}")
    _check_index_device("level_start_index", level_start_index, device)


def check_shapes_only(value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights, num_points_list):
    """Every check that needs no numbers (the fake implementations: shapes may be symbolic and
    the shape tables hold no data). Returns (B, S, H, C, L, Q, P)."""
    per_level = num_points_list is None
    B, S, H, C, Q, P, L = check_tensors(value, sampling_locations, attention_weights, per_level)
    check_shapes_tensor(spatial_shapes, value.device)
    L_tables = spatial_shapes.shape[0]
    if level_start_index is not None:
        check_start_index_tensor(level_start_index, L_tables, value.device)
    L = check_levels(L_tables, L, P, num_points_list, sampling_locations)
    check_min_sizes(H, C, L, P)
    check_sizes(B, S, H, C, L if per_level else 1, Q, P)
    return B, S, H, C, L, Q, P


def check_pairs(spatial_shapes):
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
    check_positive(pairs)
    return pairs


def check_positive(pairs):
    for level, (h, w) in enumerate(pairs):
        if h < 1 or w < 1:
            raise ValueError(
                f"spatial_shapes: level {level} has size ({h}, {w}); sizes must be >= 1")


def check_total(pairs, S):
    """The positions the levels of spatial_shapes (checked pairs) cover against value's S."""
    total = sum(h * w for h, w in pairs)
    if total != S:
        raise ValueError(f"spatial_shapes {list(pairs)} cover sum(H*W) = {total} positions but "
                         f"value has S = {S} (value.shape[1])")


def check_starts(given, pairs, expected):
    """level_start_index read on the host (a list of ints) against the starts of spatial_shapes
    (checked pairs)."""
    if given != expected:
        raise ValueError(f"level_start_index {given} does not match spatial_shapes "
                         f"{list(pairs)}: expected {expected}")


SAMPLINGS = ("bilinear", "nearest")


def check_sampling(sampling):
    if sampling not in SAMPLINGS:
        raise ValueError(f"sampling must be 'bilinear' or 'nearest', got {sampling!r}")


def check_grad_output(grad_output, B, Q, H, C, device):
    """The backward op's grad_output (autograd guarantees it for the eager node; a direct caller
    of the op does not, and the library cannot check its size)."""
    if not isinstance(grad_output, torch.Tensor):
        raise TypeError(f"grad_output must be a torch.Tensor, got {type(grad_output).__name__}")
    if (grad_output.shape != (B, Q, H * C) or grad_output.device != device
            or not grad_output.is_floating_point()):
        raise ValueError(f"grad_output must be a float tensor of shape {(B, Q, H * C)} on "
                         f"{device}, got {_describe(grad_output)}")

"""The MSDA operator: argument checks, the calls into the C library, and autograd."""
import ctypes
import os

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

# The raw cudaStream_t of the current stream. torch._C._cuda_getCurrentRawStream returns it as an
# int without building a Stream object; older or unusual torch builds fall back to the public API.
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream(device_index):
    if _raw_stream is not None:
        return _raw_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


# ---------------------------------------------------------------------------------------------
# argument checks


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
    sizes = f"B={B} S={S} H={H} C={C} L={L} Q={Q} P={P}"
    for what, count in (("value (B, S, H, C)", B * S * H * C),
                        ("sampling_locations (B, Q, H, L, P, 2)", B * Q * H * L * P * 2),
                        ("the output (B, Q, H*C) of value and sampling_locations",
                         B * Q * H * C)):
        if count > _MAX_ELEMENTS:
            raise ValueError(f"{what} has {count} elements, more than the {_MAX_ELEMENTS} "
                             f"pymsda can index (64-bit byte offsets): {sizes}")


def _aligned_contiguous(t):
    """t contiguous and aligned to its element size (the C library refuses a misaligned
    pointer; torch.frombuffer can make one)."""
    t = t.contiguous()
    if t.data_ptr() % t.element_size():
        t = t.clone()
    return t


def _validate_requested(validate):
    return validate or os.environ.get("PYMSDA_VALIDATE", "") == "1"


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


class _Levels:
    """spatial_shapes and level_start_index, as the C library wants them on one device.

    host: the (H, W) pairs when they are known on the host (a list, or a CPU tensor), else None.
    """

    __slots__ = ("shapes", "starts", "index_code", "host")

    def __init__(self, shapes, starts, host):
        self.shapes, self.starts, self.host = shapes, starts, host
        self.index_code = _INDEX_CODE[shapes.dtype]


# Level tables built from host-side shapes, per (pairs, device, dtype): a list of shapes is then
# copied to the GPU once, not on every call.
_level_cache = {}


def _levels_from_host(pairs, device, dtype=torch.int64):
    key = (pairs, device, dtype)
    levels = _level_cache.get(key)
    if levels is None:
        starts, total = [], 0
        for h, w in pairs:
            starts.append(total)
            total += h * w
        shapes = torch.tensor(pairs, dtype=dtype).reshape(len(pairs), 2)
        starts = torch.tensor(starts, dtype=dtype)
        if device.type != "cpu":
            shapes, starts = shapes.to(device), starts.to(device)
        levels = _Levels(shapes, starts, pairs)
        if len(_level_cache) > 256:
            _level_cache.clear()
        _level_cache[key] = levels
    return levels


def _check_pairs(spatial_shapes):
    """A list of (H, W) pairs as a tuple of positive int pairs, or an exception naming it."""
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
    return pairs


_pairs_cache = {}  # spatial_shapes given as a list (as a hashable tuple) -> its checked pairs


def _host_pairs(spatial_shapes, device, validate=False):
    """spatial_shapes as a tuple of (H, W) int pairs, checked; None when it lives on the device
    that runs the op and reading it there would synchronise (unless validate asks for exactly
    that), or on meta."""
    if isinstance(spatial_shapes, torch.Tensor):
        if spatial_shapes.dtype not in _INDEX_CODE:
            raise TypeError(
                f"spatial_shapes must be an int64 or int32 tensor, got {_describe(spatial_shapes)}")
        if spatial_shapes.dim() != 2 or spatial_shapes.shape[1] != 2 or spatial_shapes.shape[0] < 1:
            raise ValueError(
                f"spatial_shapes must have shape (L, 2) with L >= 1, got {_describe(spatial_shapes)}")
        _check_index_device("spatial_shapes", spatial_shapes, device)
        if spatial_shapes.device.type == "meta":
            return None
        if spatial_shapes.device.type != "cpu" and device.type != "cpu" and not validate:
            return None
        pairs = tuple(tuple(p) for p in spatial_shapes.tolist())
    else:
        try:
            key = tuple(map(tuple, spatial_shapes))
            pairs = _pairs_cache.get(key)
        except TypeError:  # not a sequence of sequences, or unhashable: let the check say why
            key = pairs = None
        if pairs is None:
            pairs = _check_pairs(spatial_shapes)
            if key is not None and len(_pairs_cache) < 256:
                _pairs_cache[key] = pairs
    for level, (h, w) in enumerate(pairs):
        if h < 1 or w < 1:
            raise ValueError(
                f"spatial_shapes: level {level} has size ({h}, {w}); sizes must be >= 1")
    return pairs


def _prepare_levels(spatial_shapes, level_start_index, S, device, validate=False):
    pairs = _host_pairs(spatial_shapes, device, validate)
    if pairs is not None:
        total = sum(h * w for h, w in pairs)
        if total != S:
            raise ValueError(
                f"spatial_shapes {list(pairs)} cover sum(H*W) = {total} positions but value has "
                f"S = {S} (value.shape[1])")
    L = len(pairs) if pairs is not None else spatial_shapes.shape[0]

    if level_start_index is not None:
        if not isinstance(level_start_index, torch.Tensor):
            level_start_index = torch.as_tensor(level_start_index)
        if level_start_index.dtype not in _INDEX_CODE:
            raise TypeError("level_start_index must be an int64 or int32 tensor, got "
                            f"{_describe(level_start_index)}")
        if level_start_index.dim() != 1 or level_start_index.shape[0] != L:
            raise ValueError(f"level_start_index must have shape ({L},) to match spatial_shapes, "
                             f"got {_describe(level_start_index)}")
        _check_index_device("level_start_index", level_start_index, device)
        # Read it where that costs no device synchronisation (or validate asks for one).
        readable = level_start_index.device.type == "cpu" or device.type == "cpu" or (
            validate and level_start_index.device.type != "meta")
        if pairs is not None and readable:
            expected, total = [], 0
            for h, w in pairs:
                expected.append(total)
                total += h * w
            given = level_start_index.tolist()
            if given != expected:
                raise ValueError(f"level_start_index {given} does not match spatial_shapes "
                                 f"{list(pairs)}: expected {expected}")

    if pairs is not None:
        dtype = spatial_shapes.dtype if isinstance(spatial_shapes, torch.Tensor) else torch.int64
        return _levels_from_host(pairs, device, dtype)

    # The shapes live on the value's device: reading them here would synchronise, so nothing
    # does; the kernels bounds-check every read instead.
    shapes = _aligned_contiguous(spatial_shapes.to(device))
    if level_start_index is None:
        sizes = shapes[:, 0] * shapes[:, 1]
        starts = torch.cumsum(sizes, 0) - sizes
    else:
        starts = level_start_index
    starts = _aligned_contiguous(starts.to(device=device, dtype=shapes.dtype))
    return _Levels(shapes, starts, None)


_level_points_cache = {}  # num_points_list as a tuple -> its ctypes int64 array (kept alive)


def _level_points(num_points_list, L):
    """num_points_list checked against L, as (total points, ctypes int64 array)."""
    key = None
    try:
        key = tuple(num_points_list)
        hit = _level_points_cache.get(key)
        if hit is not None and len(key) == L:
            return hit
        counts = [int(n) for n in key]
        ok = all(float(n).is_integer() for n in key)
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
    hit = (sum(counts), (ctypes.c_int64 * L)(*counts))
    if len(_level_points_cache) > 256:
        _level_points_cache.clear()
    _level_points_cache[key] = hit
    return hit


def _prepare(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
             validate=False, num_points_list=None):
    """Checks every argument; returns the tensors in the form the C library takes. validate:
    also read shape tables that live on the GPU and check them (a device synchronisation).
    With num_points_list, sampling_locations is (B, Q, H, sum(num_points_list), 2) and
    attention_weights (B, Q, H, sum(num_points_list)); the returned P is that sum and lp the
    ctypes table of counts (None without num_points_list)."""
    per_level = num_points_list is None
    loc_shape = "(B, Q, H, L, P, 2)" if per_level else "(B, Q, H, sum(num_points_list), 2)"
    _check_float_tensor("value", value, 4)
    _check_float_tensor("sampling_locations", sampling_locations, 6 if per_level else 5)
    _check_float_tensor("attention_weights", attention_weights, 5 if per_level else 4)
    B, S, H, C = value.shape
    if per_level:
        Bl, Q, Hl, L, P, two = sampling_locations.shape
    else:
        Bl, Q, Hl, P, two = sampling_locations.shape
        L = None
    if two != 2:
        raise ValueError(f"sampling_locations must have shape {loc_shape}, got "
                         f"{_describe(sampling_locations)}")
    for dim, name, expected, got in (("B", "batch", B, Bl), ("H", "heads", H, Hl)):
        if got != expected:
            raise ValueError(
                f"sampling_locations has {name} {dim} = {got} but value has {dim} = {expected}: "
                f"value {_describe(value)}, sampling_locations {_describe(sampling_locations)}")
    expected_attn = sampling_locations.shape[:-1]
    if attention_weights.shape != expected_attn:
        raise ValueError(
            f"attention_weights must have shape {loc_shape[:-4]}) = {tuple(expected_attn)} to "
            f"match value and sampling_locations, got {_describe(attention_weights)}")
    device = value.device
    for name, t in (("sampling_locations", sampling_locations),
                    ("attention_weights", attention_weights)):
        if t.device != device:
            raise ValueError(f"{name} is on {t.device} but value is on {device}: all tensors "
                             "must be on one device")

    levels = _prepare_levels(spatial_shapes, level_start_index, S, device, validate)
    lp = None
    if per_level:
        if levels.shapes.shape[0] != L:
            raise ValueError(f"spatial_shapes has {levels.shapes.shape[0]} levels but "
                             f"sampling_locations has L = {L}: {_describe(sampling_locations)}")
    else:
        L = levels.shapes.shape[0]
        total, lp = _level_points(num_points_list, L)
        if total != P:
            raise ValueError(f"sampling_locations has {P} points per query and head but "
                             f"num_points_list {list(num_points_list)} sums to {total}: "
                             f"{_describe(sampling_locations)}")
    if C < 1 or H < 1 or L < 1 or P < 1:
        raise ValueError(f"H, C, L and P must be >= 1, got H={H} C={C} (value) and L={L} P={P} "
                         "(sampling_locations)")
    _check_sizes(B, S, H, C, L if per_level else 1, Q, P)

    # Mixed float dtypes (autocast) follow value's dtype.
    if sampling_locations.dtype != value.dtype:
        sampling_locations = sampling_locations.to(value.dtype)
    if attention_weights.dtype != value.dtype:
        attention_weights = attention_weights.to(value.dtype)
    return (_aligned_contiguous(value), levels, _aligned_contiguous(sampling_locations),
            _aligned_contiguous(attention_weights), (B, S, H, C, L, Q, P), lp)


# ---------------------------------------------------------------------------------------------
# calls into the C library


def _device_args(t):
    if t.device.type == "cuda":
        index = t.device.index
        return index, _current_stream(index), 0
    return -1, None, torch.get_num_threads()


def _check(status):
    if status != _lib.OK:
        exc = ValueError if status == _lib.ERR_INVALID_ARGUMENT else RuntimeError
        raise exc("pymsda: " + _lib.error_text(status))


def _forward(value, levels, loc, attn, sizes, lp=None, flags=0):
    B, S, H, C, L, Q, P = sizes
    out = value.new_empty((B, Q, H * C))
    device, stream, threads = _device_args(value)
    _check(lib.msda_forward(
        B, S, H, C, L, Q, P, _DTYPE_CODE[value.dtype], levels.index_code, device, threads,
        lp, flags, value.data_ptr(), levels.shapes.data_ptr(), levels.starts.data_ptr(), loc.data_ptr(),
        attn.data_ptr(), out.data_ptr(), stream))
    return out


def _backward(grad_out, value, levels, loc, attn, sizes, need_value, need_loc, need_attn,
              lp=None, flags=0):
    B, S, H, C, L, Q, P = sizes
    grad_out = grad_out.contiguous()
    if grad_out.dtype != value.dtype:
        grad_out = grad_out.to(value.dtype)
    # grad_value accumulates in f32 for half types (c/msda.h), then is cast once.
    acc_dtype = value.dtype if value.dtype in (torch.float32, torch.float64) else torch.float32
    grad_value = torch.empty(value.shape, dtype=acc_dtype, device=value.device) if need_value else None
    grad_loc = torch.empty_like(loc) if need_loc else None
    grad_attn = torch.empty_like(attn) if need_attn else None
    device, stream, threads = _device_args(value)
    workspace, workspace_bytes = None, 0
    if flags & _lib.FLAG_DETERMINISTIC and need_value and device >= 0:
        workspace_bytes = lib.msda_backward_workspace_size(
            B, S, H, C, L, Q, P, _DTYPE_CODE[value.dtype], device, flags)
        if workspace_bytes < 0:
            _check(_lib.ERR_INVALID_ARGUMENT)
        if workspace_bytes > 0:
            workspace = torch.empty(workspace_bytes, dtype=torch.uint8, device=value.device)
    _check(lib.msda_backward(
        B, S, H, C, L, Q, P, _DTYPE_CODE[value.dtype], levels.index_code, device, threads,
        lp, flags, value.data_ptr(), levels.shapes.data_ptr(), levels.starts.data_ptr(),
        loc.data_ptr(), attn.data_ptr(), grad_out.data_ptr(),
        grad_value.data_ptr() if need_value else None,
        grad_loc.data_ptr() if need_loc else None,
        grad_attn.data_ptr() if need_attn else None,
        workspace.data_ptr() if workspace is not None else None, workspace_bytes, stream))
    if grad_value is not None and grad_value.dtype != value.dtype:
        grad_value = grad_value.to(value.dtype)
    return grad_value, grad_loc, grad_attn


class _MSDA(torch.autograd.Function):
    @staticmethod
    def forward(ctx, value, sampling_locations, attention_weights, levels, sizes, lp, flags):
        ctx.save_for_backward(value, sampling_locations, attention_weights)
        ctx.levels, ctx.sizes, ctx.lp, ctx.flags = levels, sizes, lp, flags
        return _forward(value, levels, sampling_locations, attention_weights, sizes, lp, flags)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, grad_out):
        value, loc, attn = ctx.saved_tensors
        need_value, need_loc, need_attn = ctx.needs_input_grad[:3]
        grads = _backward(grad_out, value, ctx.levels, loc, attn, ctx.sizes,
                          need_value, need_loc, need_attn, ctx.lp, ctx.flags)
        return grads + (None,) * 4


def _library_serves(device):
    return device.type == "cpu" or (device.type == "cuda" and _has_cuda_kernels)


_has_cuda_kernels = bool(lib.msda_has_cuda())


# ---------------------------------------------------------------------------------------------
# public API


_SAMPLING_FLAGS = {"bilinear": 0, "nearest": _lib.FLAG_NEAREST}


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
            tensor) are always checked.

    Returns:
        (B, Q, H * C) tensor of value's dtype:
        out[b, q, h*C + c] = sum_{l,p} A[b,q,h,l,p] * bilinear(V_l[b, :, :, h, c],
                                                      loc_x * W_l - 0.5, loc_y * H_l - 0.5),
        i.e. grid_sample(bilinear, padding_mode="zeros", align_corners=False) with
        grid = 2 * loc - 1. sampling_locations and attention_weights of another float dtype are
        cast to value's dtype. Differentiable with respect to value, sampling_locations and
        attention_weights. Half precision accumulates in float32. Empty batches or query sets
        (B = 0, Q = 0) give empty outputs and gradients; meta tensors give a meta output.

    Non-finite input (CPU and CUDA, forward and backward):
        A sampling location that is NaN or +-Inf in x or y (or so far outside its level that
        no corner is inside) contributes nothing: the point adds 0 to the output, its weight
        and location gradients are 0 and it scatters nothing into grad_value, whatever its
        attention weight. A NaN or +-Inf attention weight of a point with a corner inside
        enters the sum by IEEE arithmetic: out[b, q, h, :] becomes NaN (NaN weight) or
        non-finite (Inf weight), as do the location gradient of that point and grad_value at
        its corners; its own weight gradient (the bilinear sample) stays finite.

    Raises:
        TypeError for a wrong type or dtype and ValueError for a wrong shape, size, device or
        shape table, each naming the argument; ValueError or RuntimeError from the library
        (message from c/msda.h's msda_last_error) should a check in C refuse the call.
    """
    flags = _flags(sampling, softmax, deterministic)
    value, levels, loc, attn, sizes, lp = _prepare(
        value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
        _validate_requested(validate), num_points_list)
    if value.device.type == "meta":
        return _MetaMSDA.apply(value, loc, attn, sizes)
    if not _library_serves(value.device):
        from .reference import ms_deform_attn_pytorch
        if lp is not None or flags & (_lib.FLAG_NEAREST | _lib.FLAG_SOFTMAX):
            raise NotImplementedError(
                f"pymsda: this build of the library has no CUDA kernels, and the pure-PyTorch "
                f"fallback on {value.device} supports neither num_points_list, "
                f"sampling='nearest' nor softmax=True (rebuild with nvcc on the PATH)")
        return ms_deform_attn_pytorch(value, levels.shapes, loc, attn)
    if torch.is_grad_enabled() and (value.requires_grad or loc.requires_grad or attn.requires_grad):
        return _MSDA.apply(value, loc, attn, levels, sizes, lp, flags)
    return _forward(value, levels, loc, attn, sizes, lp, flags)  # no graph: skip autograd


class MSDeformAttnFunction:
    """Deformable DETR's autograd function, as `MSDeformAttnFunction.apply(value,
    value_spatial_shapes, value_level_start_index, sampling_locations, attention_weights,
    im2col_step)`; im2col_step is ignored."""

    @staticmethod
    def apply(value, value_spatial_shapes, value_level_start_index, sampling_locations,
              attention_weights, im2col_step=None):
        return ms_deform_attn(value, value_spatial_shapes, value_level_start_index,
                              sampling_locations, attention_weights, im2col_step)

"""Which CUDA kernel serves a forward or backward call (c/msda.h: msda_forward_route,
msda_backward_route).

The CUDA forward and backward each choose one route per call in the C library (c/routes.c) and
launch it. This module asks the same functions, so a test can check that every route is reached
and a user can see which kernel their shapes get:

    >>> pymsda.routes.forward_route(2, 19947, 8, 32, 4, 19947, 4, torch.bfloat16)
    'wide'
    >>> pymsda.routes.backward_route(2, 19947, 8, 32, 4, 900, 4, torch.float32,
    ...                              multiprocessors=132, sm90_code=True)
    Route(kernel='direct', deterministic=False, f32_workspace=False)

Forward kernels: 'none' (no queries: nothing to write), 'generic' (float64, channel counts other
than 4 * 2^k up to 128, more than 2^31 value elements, misaligned tensors), 'fast' (geometry
staged in shared memory, 4 channels a thread), 'wide' (the fast kernel with 8 channels a thread:
half-precision encoders, 65536 or more (b, q, h) items), 'direct' (no staging, an item's points
split over up to 4 lane groups: plain problems of at most 4 points an item, or of few items).
The forward's choice needs no GPU.

Backward kernels: 'none' (no queries: grad_value only zeroed), 'generic' (as the forward's),
'point' (the fast per-point kernel), 'point_sliced' (few items: each item's points split over
several blocks), 'point_pipelined' (plain float32 / bfloat16 decoders), 'aggregated' (encoders,
Q = S: corners merged per value row), 'direct' (plain decoders of at most 4 points an item, or
float32 / float16 ones of few items: the direct forward's form, loads overlapping the zeroing
of grad_value). Modifiers: deterministic (fixed-point sums in a workspace) and
f32_workspace (a half-precision grad_value summed in float32: where the GPU code predates
sm_90). float32 points with a half value (autocast's call) take the all-half call's route, in
both passes.
"""
import collections

import torch

from . import _clib
from ._checks import DTYPE_CODE
from ._args import flags_of, level_points_table, points_dtype as _points_dtype

Route = collections.namedtuple("Route", "kernel deterministic f32_workspace")

ALL_GRADS = ("value", "sampling_locations", "attention_weights")
_GRAD_BITS = {"value": 1, "sampling_locations": 2, "attention_weights": 4}


def _problem(B, S, H, C, L, Q, P, dtype, num_points_list, sampling, deterministic,
             points_dtype, device):
    """msda_args of the sizes, dtype and options a route query names (device: its index)."""
    if dtype not in DTYPE_CODE:
        raise TypeError(f"dtype must be one of {list(DTYPE_CODE)}, got {dtype!r}")
    level_points = None
    if num_points_list is not None:
        total, level_points = level_points_table(num_points_list, L)
        if total != P:
            raise ValueError(f"num_points_list {list(num_points_list)} sums to {total}, P = {P}")
    flags = flags_of(sampling, deterministic)
    if points_dtype is not None and _points_dtype(dtype, points_dtype, points_dtype) is not dtype:
        flags |= _clib.FLAG_POINTS_F32  # float32 points with a half value
    return _clib.pack_args(B=B, S=S, H=H, C=C, L=L, Q=Q, P=P, dtype=DTYPE_CODE[dtype],
                          device=device, flags=flags, level_points=level_points)


def _checked(route):
    if route < 0:
        raise ValueError("pymsda: " + _clib.lib.msda_last_error().decode())
    return route


def forward_route(B, S, H, C, L, Q, P, dtype, *, num_points_list=None, sampling="bilinear",
                  aligned=True, points_dtype=None):
    """The kernel the CUDA forward runs (a name of _clib.FWD_ROUTE_KERNELS: 'none', 'generic',
    'fast', 'wide', 'direct') for these sizes (as in ms_deform_attn: value (B, S, H, C), L levels, Q
    queries, P points per level, or per-level counts in num_points_list with P their sum), dtype
    (value's) and options. points_dtype: that of sampling_locations and attention_weights
    (default: value's; float32 with a half value, autocast's call, takes the all-half call's
    route). softmax=True has the plain call's route (ms_deform_attn composes torch's softmax
    with it). aligned: value and output 16-byte aligned (torch's allocations are). The choice
    depends on no GPU: any build answers."""
    args = _problem(B, S, H, C, L, Q, P, dtype, num_points_list, sampling, False, points_dtype,
                    -1)
    route = _checked(_clib.lib.msda_forward_route(args, int(bool(aligned))))
    return _clib.FWD_ROUTE_KERNELS[route]


def backward_route(B, S, H, C, L, Q, P, dtype, *, num_points_list=None, sampling="bilinear",
                   deterministic=False, grads=ALL_GRADS, aligned=True,
                   device=None, multiprocessors=None, sm90_code=None, points_dtype=None):
    """The Route the CUDA backward takes for these sizes (as in ms_deform_attn: value
    (B, S, H, C), L levels, Q queries, P points per level, or per-level counts in
    num_points_list with P their sum), dtype (value's), options and wanted gradients (names from
    ALL_GRADS). points_dtype: that of sampling_locations and attention_weights (default:
    value's; float32 with a half value is autocast's call, which takes the all-half call's
    route). softmax=True has the plain call's route (ms_deform_attn composes torch's softmax
    with it). aligned: value, grad_output and grad_value 16-byte aligned (torch's
    allocations are). The GPU: give multiprocessors and sm90_code (whether the code it runs is
    built for sm_90 or newer) to ask without one, or a CUDA device (default: the current one)."""
    if dtype not in DTYPE_CODE:
        raise TypeError(f"dtype must be one of {list(DTYPE_CODE)}, got {dtype!r}")
    unknown = set(grads) - set(_GRAD_BITS)
    if unknown:
        raise ValueError(f"grads must name gradients among {ALL_GRADS}, got {sorted(unknown)}")
    explicit = multiprocessors is not None and sm90_code is not None
    if explicit:
        index, multiprocessors, sm90_code = -1, int(multiprocessors), int(bool(sm90_code))
        if multiprocessors < 1:
            raise ValueError(f"multiprocessors must be >= 1, got {multiprocessors}")
    else:
        if not torch.cuda.is_available():
            raise ValueError("backward_route: no CUDA device to ask; give multiprocessors and "
                             "sm90_code")
        index = torch.device(device if device is not None else "cuda").index
        index = torch.cuda.current_device() if index is None else index
        multiprocessors, sm90_code = 0, -1
    args = _problem(B, S, H, C, L, Q, P, dtype, num_points_list, sampling, deterministic,
                    points_dtype, index)
    route = _checked(_clib.lib.msda_backward_route(args, sum(_GRAD_BITS[g] for g in set(grads)),
                                                  int(bool(aligned)), multiprocessors,
                                                  sm90_code))
    return Route(_clib.ROUTE_KERNELS[route & _clib.ROUTE_KERNEL_MASK],
                 bool(route & _clib.ROUTE_DETERMINISTIC), bool(route & _clib.ROUTE_F32_WORKSPACE))

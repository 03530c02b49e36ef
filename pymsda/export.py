"""Export: what pymsda.ms_deform_attn records under each tracer, and the TensorRT option.

    torch.jit.trace              the registered op pymsda::ms_deform_attn_forward (torch >= 2.4:
                                 the traced graph runs pymsda's kernels and differentiates);
                                 on an older torch the decomposition below
    torch.onnx.export            the decomposition (pymsda/_decompose.py) into standard ONNX ops,
      (dynamo=False and True)    opset 11 and later; or, inside onnx_options(tensorrt=True), one
                                 MultiscaleDeformableAttnPlugin_TRT node where the plugin can
                                 express the call
    torch.export, torch.compile  the registered op (pymsda/_library.py); decompositions() turns
                                 it into the decomposition in an ExportedProgram (for
                                 torch.onnx.export of the program)
    torch.jit.script             the op pymsda::ms_deform_attn (pymsda/_script.py), whose kernel
                                 is ms_deform_attn: scripted code computes what eager code does;
                                 drop-ins TorchScript cannot compile raise saying what works
                                 (pymsda/_torch_private.py: not_scriptable,
                                 script_unsupported_because)

The decomposition reads the level sizes from spatial_shapes as the graph runs when it is a
tensor (so image sizes may vary), or bakes them in when it is a list.

TensorRT's plugin (NVIDIA/TensorRT, plugin/multiscaleDeformableAttnPlugin/
multiscaleDeformableAttnPlugin.cpp; version "1" is the IPluginV2DynamicExt plugin, deprecated
since TensorRT 10.11, "2" its IPluginV3 successor with the same inputs and output):
    inputs   value (N, S, M, D), spatial_shapes (L, 2) int32, level_start_index (L,) int32,
             sampling_locations (N, Lq, M, L, P, 2), attention_weights (N, Lq, M, L, P);
             the float inputs all float32 or all float16
    output   (N, Lq, M, D), value's type; no attributes of its own
TensorRT's ONNX parser imports a node of an unknown op type as the plugin of that name, with
the node's attributes plugin_version (default "1") and plugin_namespace (default ""), so
`trtexec --onnx=model.onnx` needs no custom code.
"""
import contextlib
import threading
import warnings

import torch

from . import _lib
from ._checks import _check_pairs, _point_counts
from ._decompose import decompose
from ._library import HAS_TORCH_LIBRARY_OPS, _ms_deform_attn_traced
from ._tables import _starts_of
from ._torch_private import jit_tracing_state

__all__ = ["onnx_options", "decompositions", "TENSORRT_PLUGIN"]

TENSORRT_PLUGIN = "MultiscaleDeformableAttnPlugin_TRT"
_TENSORRT_DOMAIN = "trt"
_METHODS = ("gather", "grid_sample")


class _Options(threading.local):
    tensorrt = False
    plugin_version = "1"
    method = "gather"


_options = _Options()


@contextlib.contextmanager
def onnx_options(tensorrt=False, plugin_version="1", method="gather"):
    """Options for the ONNX graphs that torch.onnx.export records for ms_deform_attn inside the
    `with` block (this thread):

        tensorrt: emit one MultiscaleDeformableAttnPlugin_TRT node (TensorRT's own plugin)
            for each call the plugin can express (num_points_list with the same count on
            every level is reshaped to it); calls with sampling="nearest" or unequal per-level
            point counts warn and get the decomposition.
        plugin_version: "1" (every TensorRT with the plugin) or "2" (TensorRT 10.11 and later).
        method: the decomposition's form, "gather" (default: opset 11 and later, the faster in
            ONNX Runtime) or "grid_sample" (GridSample, opset 16 and later; needs
            spatial_shapes as a list).
    """
    if method not in _METHODS:
        raise ValueError(f"method must be one of {_METHODS}, got {method!r}")
    if str(plugin_version) not in ("1", "2"):
        raise ValueError(f"plugin_version must be '1' or '2', got {plugin_version!r}")
    saved = (_options.tensorrt, _options.plugin_version, _options.method)
    _options.tensorrt, _options.plugin_version, _options.method = (
        bool(tensorrt), str(plugin_version), method)
    try:
        yield
    finally:
        _options.tensorrt, _options.plugin_version, _options.method = saved


# ---------------------------------------------------------------------------------------------
# where ops.ms_deform_attn comes in

_tracing_state = jit_tracing_state


def _onnx_exporting():
    return torch.onnx.is_in_onnx_export()


def _jit_traced(value, spatial_shapes, level_start_index, sampling_locations,
                attention_weights, num_points_list, flags):
    """ms_deform_attn while the TorchScript tracer records (torch.jit.trace, and
    torch.onnx.export(dynamo=False), which traces first)."""
    if _onnx_exporting():
        return _onnx(value, spatial_shapes, level_start_index, sampling_locations,
                     attention_weights, num_points_list, flags, dynamo=False)
    if HAS_TORCH_LIBRARY_OPS:
        return _ms_deform_attn_traced(value, spatial_shapes, level_start_index,
                                      sampling_locations, attention_weights, num_points_list,
                                      flags)
    return _decomposed(value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights, num_points_list, flags, "gather")


def _dynamo_traced(value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, num_points_list, flags):
    """ms_deform_attn while torch.export / dynamo traces: the decomposition (or the TensorRT
    node) for torch.onnx.export(dynamo=True), which has no ONNX function for the registered
    op; the registered op otherwise."""
    if _onnx_exporting():
        return _onnx(value, spatial_shapes, level_start_index, sampling_locations,
                     attention_weights, num_points_list, flags, dynamo=True)
    return _ms_deform_attn_traced(value, spatial_shapes, level_start_index, sampling_locations,
                                  attention_weights, num_points_list, flags)


def _onnx(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
          num_points_list, flags, dynamo):
    if _options.tensorrt:
        reason = _tensorrt_refusal(spatial_shapes, num_points_list, flags)
        if reason is None:
            return _tensorrt_node(value, spatial_shapes, level_start_index, sampling_locations,
                                  attention_weights, num_points_list, flags, dynamo)
        warnings.warn(f"pymsda: TensorRT's {TENSORRT_PLUGIN} cannot express {reason}; this "
                      "call is exported as the decomposition into standard ONNX ops instead",
                      stacklevel=4)
    return _decomposed(value, spatial_shapes, level_start_index, sampling_locations,
                       attention_weights, num_points_list, flags, _options.method)


def decompositions():
    """A decomposition table for ExportedProgram.run_decompositions: pymsda's op
    (torch.ops.pymsda.ms_deform_attn_forward, what torch.export records) written with standard
    torch operators, the graph torch.onnx.export records for the op (inside onnx_options, with
    those options; method="grid_sample" needs shapes as a list, which an exported program no
    longer has). For an ExportedProgram that torch.onnx.export, or any runtime without pymsda,
    should take:

        exported = torch.export.export(model, args)
        torch.onnx.export(exported.run_decompositions(pymsda.export.decompositions()), ...)

    Other operators are left as they are; merge the table into another (e.g.
    torch.export.default_decompositions()) to decompose those too."""
    if not HAS_TORCH_LIBRARY_OPS:
        raise RuntimeError(f"pymsda: torch {torch.__version__} has no torch.library.custom_op, "
                           "so no pymsda op is recorded by torch.export to decompose")
    return {torch.ops.pymsda.ms_deform_attn_forward.default: _exported_forward}


def _exported_forward(value, spatial_shapes, level_start_index, sampling_locations,
                      attention_weights, num_points_list, flags):
    """pymsda::ms_deform_attn_forward's decomposition (its arguments: pymsda/_library.py)."""
    return _onnx(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                 num_points_list, flags, dynamo=True)


def _tables(spatial_shapes, level_start_index):
    """spatial_shapes as checked (H, W) pairs when given as a list, else the tensor as it is;
    level_start_index as a tensor or None (derived from the shapes)."""
    if not isinstance(spatial_shapes, torch.Tensor):
        spatial_shapes = list(_check_pairs(spatial_shapes))
        level_start_index = None  # a list is checked against the shapes by the eager path
    elif level_start_index is not None and not isinstance(level_start_index, torch.Tensor):
        level_start_index = torch.tensor([int(s) for s in level_start_index],
                                         dtype=torch.int64)
    return spatial_shapes, level_start_index


def _decomposed(value, spatial_shapes, level_start_index, sampling_locations,
                attention_weights, num_points_list, flags, method):
    spatial_shapes, level_start_index = _tables(spatial_shapes, level_start_index)
    counts = None
    if num_points_list is not None:
        counts = list(_point_counts(num_points_list, len(spatial_shapes)))
    return decompose(value, spatial_shapes, level_start_index, sampling_locations,
                     attention_weights, counts, nearest=bool(flags & _lib.FLAG_NEAREST),
                     method=method)


# ---------------------------------------------------------------------------------------------
# TensorRT's MultiscaleDeformableAttnPlugin_TRT

def _tensorrt_refusal(spatial_shapes, num_points_list, flags):
    """Why the plugin cannot run this call, or None."""
    if flags & _lib.FLAG_NEAREST:
        return "sampling='nearest' (it samples bilinearly)"
    if num_points_list is not None and len({int(n) for n in num_points_list}) != 1:
        return (f"num_points_list={list(num_points_list)} (it takes the same number of points "
                "on every level)")
    return None


def _plugin_tables(spatial_shapes, level_start_index, device):
    """The plugin's int32 spatial_shapes (L, 2) and level_start_index (L,)."""
    if not isinstance(spatial_shapes, torch.Tensor):
        pairs = _check_pairs(spatial_shapes)
        starts, _ = _starts_of(pairs)
        return (torch.tensor(pairs, dtype=torch.int32, device=device),
                torch.tensor(starts, dtype=torch.int32, device=device))
    shapes = spatial_shapes.to(device=device, dtype=torch.int32)
    if level_start_index is None:
        sizes = shapes[:, 0] * shapes[:, 1]
        level_start_index = torch.cumsum(sizes, 0) - sizes
    elif not isinstance(level_start_index, torch.Tensor):
        level_start_index = torch.tensor([int(s) for s in level_start_index])
    return shapes, level_start_index.to(device=device, dtype=torch.int32)


def _tensorrt_node(value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, num_points_list, flags, dynamo):
    """One plugin node: float32 unless value and both point tensors are float16 (the plugin
    takes one float type for all three; a half value with float32 points, or a bfloat16 or
    float64 value, runs in float32, as pymsda's kernels compute it), output cast to value's
    dtype."""
    B, Q, H, C = value.shape[0], sampling_locations.shape[1], value.shape[2], value.shape[3]
    shapes, starts = _plugin_tables(spatial_shapes, level_start_index, value.device)
    L = shapes.shape[0]
    loc, attn = sampling_locations, attention_weights
    if num_points_list is not None:  # equal counts: the (B, Q, H, L, P) layout
        P = int(num_points_list[0])
        loc = loc.reshape(B, Q, H, L, P, 2)
        attn = attn.reshape(B, Q, H, L, P)
    if value.dtype == torch.float16 and loc.dtype == torch.float16 \
            and attn.dtype == torch.float16:
        dtype = torch.float16
    else:
        dtype = torch.float32
    out = _plugin(_as(value, dtype), shapes, starts, _as(loc, dtype), _as(attn, dtype),
                  _options.plugin_version, dynamo)
    return _as(out, value.dtype)


def _as(t, dtype):
    """t in dtype, recording no Cast where it has it already."""
    return t if t.dtype == dtype else t.to(dtype)


def _plugin(value, shapes, starts, loc, attn, version, dynamo):
    """(B, Q, H*C) from one plugin node and a Reshape."""
    B, Q, H, C = value.shape[0], loc.shape[1], value.shape[2], value.shape[3]
    if not dynamo:
        return _TensorRTNode.apply(value, shapes, starts, loc, attn, version)
    symbolic = getattr(getattr(torch.onnx, "ops", None), "symbolic", None)
    if symbolic is None:
        raise RuntimeError(
            f"pymsda: torch {torch.__version__} has no torch.onnx.ops.symbolic, which "
            "torch.onnx.export(dynamo=True) needs to write TensorRT's plugin node; export with "
            "dynamo=False, or use torch >= 2.8")
    node = symbolic(f"{_TENSORRT_DOMAIN}::{TENSORRT_PLUGIN}", (value, shapes, starts, loc, attn),
                    {"plugin_version": version, "plugin_namespace": ""}, dtype=value.dtype,
                    shape=(B, Q, H, C), version=1)
    return node.reshape(B, Q, H * C)


class _TensorRTNode(torch.autograd.Function):
    """The plugin node for the TorchScript exporter (its symbolic); run eagerly (while the
    exporter traces) it computes the same numbers with the decomposition."""

    @staticmethod
    def forward(ctx, value, shapes, starts, loc, attn, version):
        return decompose(value, shapes, starts, loc, attn)

    @staticmethod
    def symbolic(g, value, shapes, starts, loc, attn, version):
        node = g.op(f"{_TENSORRT_DOMAIN}::{TENSORRT_PLUGIN}", value, shapes, starts, loc, attn,
                    plugin_version_s=version, plugin_namespace_s="")
        sizes = value.type().varyingSizes()
        if sizes is not None and len(sizes) == 4:
            node.setType(value.type().with_sizes([None, None, sizes[2], sizes[3]]))
        keep_batch_and_queries = g.op("Constant", value_t=torch.tensor([0, 0, -1]))
        return g.op("Reshape", node, keep_batch_and_queries)

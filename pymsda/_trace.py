"""What ms_deform_attn records under ONNX export (pymsda/ops.py's table says when it comes here;
pymsda/export.py what each tracer gets and why): the decomposition into standard ONNX ops
(pymsda/_decompose.py), TensorRT's plugin node or the node of pymsda's ONNX Runtime op
(c/ort_op.c), as onnx_options says (this thread's options, kept here); and the decomposition that
torch.jit.trace records where torch has no torch.library.custom_op."""
import threading
import warnings

import torch

from ._args import level_starts
from ._checks import check_pairs, point_counts
from ._clib import FLAG_NEAREST
from ._decompose import decompose

TENSORRT_PLUGIN = "MultiscaleDeformableAttnPlugin_TRT"
_TENSORRT_DOMAIN = "trt"
# pymsda's ONNX Runtime op (c/ort_op.c: MSDA_ORT_DOMAIN, MSDA_ORT_OP_NAME), version 1
ONNXRUNTIME_DOMAIN, ONNXRUNTIME_OP = "pymsda", "MSDeformAttn"
METHODS = ("gather", "grid_sample")


class _Options(threading.local):
    onnxruntime = False
    tensorrt = False
    plugin_version = "1"
    method = "gather"


options = _Options()


# ---------------------------------------------------------------------------------------------
# where ops.ms_deform_attn comes in

def onnx(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
         num_points_list, flags, dynamo):
    """ms_deform_attn while torch.onnx.export records: dynamo says which exporter (True:
    torch.export's graph, whose registered op has no ONNX function; False: the TorchScript
    tracer's)."""
    if options.onnxruntime:
        return _onnxruntime_node(value, spatial_shapes, level_start_index, sampling_locations,
                                 attention_weights, num_points_list, flags, dynamo)
    if options.tensorrt:
        reason = _tensorrt_refusal(spatial_shapes, num_points_list, flags)
        if reason is None:
            return _tensorrt_node(value, spatial_shapes, level_start_index, sampling_locations,
                                  attention_weights, num_points_list, flags, dynamo)
        warnings.warn(f"pymsda: TensorRT's {TENSORRT_PLUGIN} cannot express {reason}; this "
                      "call is exported as the decomposition into standard ONNX ops instead",
                      stacklevel=3)
    return decomposed(value, spatial_shapes, level_start_index, sampling_locations,
                      attention_weights, num_points_list, flags, options.method)


def exported_forward(value, spatial_shapes, level_start_index, sampling_locations,
                     attention_weights, num_points_list, flags):
    """pymsda::ms_deform_attn_forward's decomposition (its arguments: pymsda/_op.py)."""
    return onnx(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
                num_points_list, flags, dynamo=True)


def _tables(spatial_shapes, level_start_index):
    """spatial_shapes as checked (H, W) pairs when given as a list, else the tensor as it is;
    level_start_index as a tensor or None (derived from the shapes)."""
    if not isinstance(spatial_shapes, torch.Tensor):
        spatial_shapes = list(check_pairs(spatial_shapes))
        level_start_index = None  # a list is checked against the shapes by the eager path
    elif level_start_index is not None and not isinstance(level_start_index, torch.Tensor):
        level_start_index = torch.tensor([int(s) for s in level_start_index],
                                         dtype=torch.int64)
    return spatial_shapes, level_start_index


def decomposed(value, spatial_shapes, level_start_index, sampling_locations, attention_weights,
               num_points_list, flags, method="gather"):
    """ms_deform_attn as the decomposition (pymsda/_decompose.py) in the form `method`."""
    spatial_shapes, level_start_index = _tables(spatial_shapes, level_start_index)
    counts = None
    if num_points_list is not None:
        counts = list(point_counts(num_points_list, len(spatial_shapes)))
    return decompose(value, spatial_shapes, level_start_index, sampling_locations,
                     attention_weights, counts, nearest=bool(flags & FLAG_NEAREST),
                     method=method)


# ---------------------------------------------------------------------------------------------
# TensorRT's MultiscaleDeformableAttnPlugin_TRT

def _tensorrt_refusal(spatial_shapes, num_points_list, flags):
    """Why the plugin cannot run this call, or None."""
    if flags & FLAG_NEAREST:
        return "sampling='nearest' (it samples bilinearly)"
    if num_points_list is not None and len({int(n) for n in num_points_list}) != 1:
        return (f"num_points_list={list(num_points_list)} (it takes the same number of points "
                "on every level)")
    return None


def _plugin_tables(spatial_shapes, level_start_index, device, dtype=torch.int32):
    """A node's spatial_shapes (L, 2) and level_start_index (L,) of dtype (the plugin's int32)."""
    if not isinstance(spatial_shapes, torch.Tensor):
        pairs = check_pairs(spatial_shapes)
        return (torch.tensor(pairs, dtype=dtype, device=device),
                torch.tensor(level_starts(pairs), dtype=dtype, device=device))
    shapes = spatial_shapes.to(device=device, dtype=dtype)
    if level_start_index is None:
        level_start_index = level_starts(shapes)
    elif not isinstance(level_start_index, torch.Tensor):
        level_start_index = torch.tensor([int(s) for s in level_start_index])
    return shapes, level_start_index.to(device=device, dtype=dtype)


def _tensorrt_node(value, spatial_shapes, level_start_index, sampling_locations,
                   attention_weights, num_points_list, flags, dynamo):
    """One plugin node: float32 unless value and both point tensors are float16 (the plugin
    takes one float type for all three; a half value with float32 points, or a bfloat16 or
    float64 value, runs in float32, as pymsda's kernels compute it), output cast to value's
    dtype."""
    B, Q, H = value.shape[0], sampling_locations.shape[1], value.shape[2]
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
                  options.plugin_version, dynamo)
    return _as(out, value.dtype)


def _onnx_symbolic(what):
    """torch.onnx.ops.symbolic, with which torch.onnx.export(dynamo=True) records a node of
    another domain, or an error saying what cannot be written without it."""
    symbolic = getattr(getattr(torch.onnx, "ops", None), "symbolic", None)
    if symbolic is None:
        raise RuntimeError(
            f"pymsda: torch {torch.__version__} has no torch.onnx.ops.symbolic, which "
            f"torch.onnx.export(dynamo=True) needs to write {what}; export with dynamo=False, "
            "or use torch >= 2.8")
    return symbolic


def _as(t, dtype):
    """t in dtype, recording no Cast where it has it already."""
    return t if t.dtype == dtype else t.to(dtype)


def _plugin(value, shapes, starts, loc, attn, version, dynamo):
    """(B, Q, H*C) from one plugin node and a Reshape."""
    B, Q, H, C = value.shape[0], loc.shape[1], value.shape[2], value.shape[3]
    if not dynamo:
        return _TensorRTNode.apply(value, shapes, starts, loc, attn, version)
    node = _onnx_symbolic("TensorRT's plugin node")(f"{_TENSORRT_DOMAIN}::{TENSORRT_PLUGIN}", (value, shapes, starts, loc, attn),
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


# ---------------------------------------------------------------------------------------------
# pymsda's ONNX Runtime op, pymsda::MSDeformAttn (c/ort_op.c)

def _onnxruntime_node(value, spatial_shapes, level_start_index, sampling_locations,
                      attention_weights, num_points_list, flags, dynamo):
    """One pymsda::MSDeformAttn node: value float32 or float16 (float64 and bfloat16 run in
    float32, as TensorRT's node does, output cast back); the points in value's type, or float32
    with a float16 value (autocast's, computed from the float32 numbers as the kernels do); the
    tables int64, read when the graph runs; sampling and num_points_list as attributes."""
    if num_points_list is not None:
        num_points_list = [int(n) for n in point_counts(num_points_list, _levels(spatial_shapes))]
    shapes, starts = _plugin_tables(spatial_shapes, level_start_index, value.device,
                                    torch.int64)
    dtype = value.dtype if value.dtype in (torch.float16, torch.float32) else torch.float32
    point_dtype = (sampling_locations.dtype if dtype == torch.float16 and
                   sampling_locations.dtype in (torch.float16, torch.float32) else dtype)
    attributes = {"sampling": "nearest" if flags & FLAG_NEAREST else "bilinear"}
    if num_points_list is not None:
        attributes["num_points_list"] = num_points_list
    inputs = (_as(value, dtype), shapes, starts, _as(sampling_locations, point_dtype),
              _as(attention_weights, point_dtype))
    if dynamo:
        B, Q = value.shape[0], sampling_locations.shape[1]
        out = _onnx_symbolic("the ONNX Runtime node")(f"{ONNXRUNTIME_DOMAIN}::{ONNXRUNTIME_OP}", inputs, attributes,
                       dtype=dtype, shape=(B, Q, value.shape[2] * value.shape[3]), version=1)
    else:
        out = _OnnxRuntimeNode.apply(*inputs, attributes["sampling"], num_points_list,
                                     _ONNX_TYPES[dtype], _ONNX_TYPES[point_dtype])
    return _as(out, value.dtype)


# ONNX TensorProto data types of the node's inputs
_ONNX_TYPES = {torch.float32: 1, torch.float16: 10, torch.int64: 7}


def _levels(spatial_shapes):
    return spatial_shapes.shape[0] if isinstance(spatial_shapes, torch.Tensor) \
        else len(spatial_shapes)


class _OnnxRuntimeNode(torch.autograd.Function):
    """The node for the TorchScript exporter (its symbolic); run eagerly (while the exporter
    traces) it computes the same numbers with the decomposition."""

    @staticmethod
    def forward(ctx, value, shapes, starts, loc, attn, sampling, counts, value_type, point_type):
        return decompose(value, shapes, starts, loc, attn, counts, nearest=sampling == "nearest")

    @staticmethod
    def symbolic(g, value, shapes, starts, loc, attn, sampling, counts, value_type, point_type):
        attributes = {"sampling_s": sampling}
        if counts is not None:
            attributes["num_points_list_i"] = counts
        # each input cast to the type decided above: the TorchScript exporter's graph may carry
        # another than the traced tensor had (float64 reference points, seen in transformers'
        # Deformable DETR), and the node checks its types when it runs
        value, loc, attn = (g.op("Cast", t, to_i=code) for t, code in
                            ((value, value_type), (loc, point_type), (attn, point_type)))
        shapes, starts = (g.op("Cast", t, to_i=_ONNX_TYPES[torch.int64]) for t in (shapes, starts))
        node = g.op(f"{ONNXRUNTIME_DOMAIN}::{ONNXRUNTIME_OP}", value, shapes, starts, loc, attn,
                    **attributes)
        sizes = value.type().varyingSizes()
        if sizes is not None and len(sizes) == 4 and None not in sizes[2:]:
            node.setType(value.type().with_sizes([None, None, sizes[2] * sizes[3]]))
        return node

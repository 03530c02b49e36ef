"""Export: what pymsda.ms_deform_attn records under each tracer, and the TensorRT option.

    torch.jit.trace              the registered op pymsda::ms_deform_attn_forward (torch >= 2.4:
                                 the traced graph runs pymsda's kernels and differentiates);
                                 on an older torch the decomposition below
    torch.onnx.export            the decomposition (pymsda/_decompose.py) into standard ONNX ops,
      (dynamo=False and True)    opset 11 and later; or, inside onnx_options(tensorrt=True), one
                                 MultiscaleDeformableAttnPlugin_TRT node where the plugin can
                                 express the call; or, inside onnx_options(onnxruntime=True), one
                                 pymsda::MSDeformAttn node, pymsda's own ONNX Runtime op (the
                                 library's RegisterCustomOps, c/ort_op.c) for every call
    torch.export, torch.compile  the registered op (pymsda/_op.py); decompositions() turns
                                 it into the decomposition in an ExportedProgram (for
                                 torch.onnx.export of the program)
    torch.jit.script             the op pymsda::ms_deform_attn (pymsda/ops.py), whose kernel
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

import torch

from ._op import HAS_TORCH_LIBRARY_OPS
from ._trace import (METHODS, ONNXRUNTIME_DOMAIN, ONNXRUNTIME_OP, TENSORRT_PLUGIN,
                     exported_forward, options)

__all__ = ["onnx_options", "decompositions", "TENSORRT_PLUGIN", "ONNXRUNTIME_DOMAIN",
           "ONNXRUNTIME_OP"]


@contextlib.contextmanager
def onnx_options(tensorrt=False, plugin_version="1", method="gather", onnxruntime=False):
    """Options for the ONNX graphs that torch.onnx.export records for ms_deform_attn inside the
    `with` block (this thread):

        onnxruntime: emit one pymsda::MSDeformAttn node (domain "pymsda", version 1) for every
            call: pymsda's own ONNX Runtime op, which runs pymsda's kernels once the session
            options load the library (register_custom_ops_library(pymsda.library_path())).
            Inputs value, spatial_shapes, level_start_index (int64, read at run time),
            sampling_locations, attention_weights (TensorRT's plugin order); attributes
            sampling and num_points_list; output (B, Q, H*C). docs/export.md.
        tensorrt: emit one MultiscaleDeformableAttnPlugin_TRT node (TensorRT's own plugin)
            for each call the plugin can express (num_points_list with the same count on
            every level is reshaped to it); calls with sampling="nearest" or unequal per-level
            point counts warn and get the decomposition.
        plugin_version: "1" (every TensorRT with the plugin) or "2" (TensorRT 10.11 and later).
        method: the decomposition's form, "gather" (default: opset 11 and later, the faster in
            ONNX Runtime) or "grid_sample" (GridSample, opset 16 and later; needs
            spatial_shapes as a list).
    """
    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    if str(plugin_version) not in ("1", "2"):
        raise ValueError(f"plugin_version must be '1' or '2', got {plugin_version!r}")
    if tensorrt and onnxruntime:
        raise ValueError("onnx_options: choose one of tensorrt=True and onnxruntime=True (one "
                         "node type a graph)")
    saved = (options.tensorrt, options.plugin_version, options.method, options.onnxruntime)
    options.tensorrt, options.plugin_version, options.method, options.onnxruntime = (
        bool(tensorrt), str(plugin_version), method, bool(onnxruntime))
    try:
        yield
    finally:
        (options.tensorrt, options.plugin_version, options.method,
         options.onnxruntime) = saved


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
    return {torch.ops.pymsda.ms_deform_attn_forward.default: exported_forward}

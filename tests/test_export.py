"""Export: what ms_deform_attn records under torch.jit.trace / script and both ONNX
exporters, checked by running what was recorded (TorchScript, ONNX Runtime) on inputs other
than the traced ones and comparing with eager and the float64 oracle; and the TensorRT node's
structure, run with the node replaced by the decomposition. Every entry point (MSDeformAttn,
the drop-ins) under every tracer: tests/test_export_entry_points.py."""
import inspect
import io
import warnings

import numpy as np
import pytest
import torch

import pymsda
from pymsda import export
from pymsda._decompose import decompose
from conftest import NEEDS_ONNX, expects_torchscript_deprecation, requires_torch_feature
from factories import (flat_size, level_start_index_of, make_inputs, make_point_inputs,
                       oracle_forward, oracle_forward_general, rel_l2)

onnx = pytest.importorskip("onnx", reason=NEEDS_ONNX)
ort = pytest.importorskip("onnxruntime", reason=NEEDS_ONNX)

SHAPES = [(5, 7), (3, 4), (1, 1), (2, 6)]  # rectangular, a 1x1 level
HAS_CUSTOM_OP = pymsda.ops.HAS_TORCH_LIBRARY_OPS
requires_dynamo_exporter = requires_torch_feature(
    HAS_CUSTOM_OP and "dynamo" in getattr(torch.onnx.export, "__code__").co_varnames,
    "torch.onnx.export(dynamo=True) with torch.library custom ops")
F32_BOUND = 1e-5  # ONNX Runtime against eager, float32
NEEDS_ONNXSCRIPT = 'torch.onnx.export(dynamo=True) needs onnxscript: pip install ".[onnx]"'


def _onnxscript_missing():
    try:
        import onnxscript  # noqa: F401
        return False
    except ImportError:
        return True


class Call(torch.nn.Module):
    """ms_deform_attn with fixed options; the level tables as a list, a tensor built inside
    (a constant of the graph) or a graph input (shapes="input")."""

    def __init__(self, shapes, tables="list", **options):
        super().__init__()
        self.shapes, self.tables, self.options = shapes, tables, options

    def forward(self, value, sampling_locations, attention_weights, spatial_shapes=None):
        if self.tables == "list":
            spatial_shapes = self.shapes
        elif self.tables == "constant":
            spatial_shapes = torch.as_tensor(self.shapes)
        return pymsda.ms_deform_attn(value, spatial_shapes, None, sampling_locations,
                                     attention_weights, **self.options)


# the TorchScript exporter as torch.onnx.export(dynamo=False), or without the keyword on a
# torch whose export has none (before 2.5: that exporter is the only one)
_TORCHSCRIPT = ({"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters
                else {})


def _to_onnx(module, args, dynamo=False, opset=17, tables="list", quiet=True):
    """The checked ONNX model of module, batch and query axes dynamic; quiet: without the
    exporters' warnings (and pymsda's)."""
    names = ["value", "sampling_locations", "attention_weights"]
    if tables == "input":
        names.append("spatial_shapes")
    f = io.BytesIO()
    with warnings.catch_warnings():
        if quiet:
            warnings.simplefilter("ignore")
        if dynamo:
            batch, queries = torch.export.Dim("batch"), torch.export.Dim("queries")
            dims = ({0: batch}, {0: batch, 1: queries}, {0: batch, 1: queries})
            if tables == "input":
                dims += (None,)
            torch.onnx.export(module, args, f, dynamo=True, input_names=names,
                              dynamic_shapes=dims, verbose=False)
        else:
            axes = {"value": [0], "sampling_locations": [0, 1], "attention_weights": [0, 1]}
            if tables == "input":
                axes["value"] = [0, 1]
            torch.onnx.export(module, args, f, **_TORCHSCRIPT, opset_version=opset,
                              input_names=names, dynamic_axes=axes)
    model = onnx.load_from_string(f.getvalue())
    onnx.checker.check_model(model)
    return model


def _run(model, *tensors):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return torch.from_numpy(session.run(None, dict(zip(names, (t.numpy() for t in tensors))))[0])


def _inputs(generator, batch, queries, dtype=torch.float32, shapes=SHAPES, points=3, **kw):
    inputs = make_inputs(generator, batch, queries, 3, 5, shapes, points, dtype=dtype,
                         kink_free=True, **kw)
    return inputs["value"], inputs["sampling_locations"], inputs["attention_weights"], inputs


# ---- the decomposition itself, against the float64 oracle -----------------------------------

@pytest.mark.parametrize("method", ["gather", "grid_sample"])
@pytest.mark.parametrize("tables", ["list", "tensor"])
def test_decomposition_matches_f64_oracle(generator, method, tables):
    if method == "grid_sample" and tables == "tensor":
        pytest.skip("the grid_sample form takes a list of shapes only")
    value, loc, attn, inputs = _inputs(generator, 2, 9, dtype=torch.float64)
    shapes = SHAPES if tables == "list" else inputs["spatial_shapes"]
    out = decompose(value, shapes, None, loc, attn, method=method)
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12


@pytest.mark.parametrize("nearest", [False, True])
@pytest.mark.parametrize("tables", ["list", "tensor"])
def test_decomposition_options_match_f64_oracle(generator, nearest, tables):
    counts = [2, 0, 3, 1]
    inputs = make_point_inputs(generator, 2, 9, 3, 5, SHAPES, counts, logits=True)
    shapes = SHAPES if tables == "list" else inputs["spatial_shapes"]
    out = decompose(inputs["value"], shapes, inputs["level_start_index"],
                    inputs["sampling_locations"], inputs["attention_weights"].softmax(-1), counts,
                    nearest=nearest)
    expected = oracle_forward_general(inputs, num_points_list=counts, nearest=nearest,
                                      softmax=True)
    assert rel_l2(out, expected) < 1e-12


@pytest.mark.parametrize("sampling", ["bilinear", "nearest"])
@pytest.mark.parametrize("method", ["gather", "grid_sample"])
def test_decomposition_non_finite_locations_add_nothing_like_the_kernels(generator, sampling,
                                                                         method):
    value, loc, attn, _ = _inputs(generator, 2, 9, dtype=torch.float64)
    loc, attn = loc.clone(), attn.clone()
    loc[0, 0, 0, 0, 0, 0] = float("nan")
    attn[0, 0, 0, 0, 0] = float("nan")  # a NaN weight on a NaN location: still nothing
    loc[0, 1, 1, 1, 1, 1] = float("inf")
    loc[1, 2, 2, 3, 2, 0] = -float("inf")
    loc[1, 3, 0, 0, 1, 1] = 1e30
    eager = pymsda.ms_deform_attn(value, SHAPES, None, loc, attn, sampling=sampling)
    out = decompose(value, SHAPES, None, loc, attn, nearest=sampling == "nearest",
                    method=method)
    assert torch.isfinite(out).all()
    assert rel_l2(out, eager) < 1e-12


# ---- torch.jit.trace and torch.jit.script ----------------------------------------------------

def _other_inputs(generator, dtype=torch.float32):
    """Inputs of another batch and query count than those traced."""
    return _inputs(generator, 3, 4, dtype=dtype)


def test_jit_trace_of_the_op_reruns_to_eager_on_other_inputs(generator):
    value, loc, attn, _ = _inputs(generator, 2, 9)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(Call(SHAPES), (value, loc, attn))
    kinds = {node.kind() for node in traced.graph.nodes()}
    if HAS_CUSTOM_OP:
        assert "pymsda::ms_deform_attn_forward" in kinds
    value, loc, attn, inputs = _other_inputs(generator)
    out = traced(value, loc, attn)
    assert out.shape == (3, 4, 15)
    assert rel_l2(out, oracle_forward(inputs)) < 1e-6


def test_jit_trace_of_the_op_differentiates(generator):
    value, loc, attn, _ = _inputs(generator, 2, 9, dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (value, loc, attn)]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        traced = torch.jit.trace(Call(SHAPES), tuple(leaves))
    grads = torch.autograd.grad(traced(*leaves).square().sum(), leaves)
    eager_leaves = [t.detach().clone().requires_grad_() for t in leaves]
    expected = torch.autograd.grad(
        pymsda.ms_deform_attn(eager_leaves[0], SHAPES, None, *eager_leaves[1:]).square().sum(),
        eager_leaves)
    for grad, want in zip(grads, expected):
        assert rel_l2(grad, want) < 1e-12


@expects_torchscript_deprecation
def test_jit_script_of_a_function_calling_the_op_records_the_op(generator):
    def f(value, loc, attn):
        return pymsda.ms_deform_attn(value, [(5, 7), (3, 4), (1, 1), (2, 6)], None, loc, attn)
    scripted = torch.jit.script(f)
    assert "pymsda::ms_deform_attn" in {node.kind() for node in scripted.graph.nodes()}
    value, loc, attn, inputs = _other_inputs(generator)
    assert rel_l2(scripted(value, loc, attn), oracle_forward(inputs)) < 1e-6


# ---- ONNX: both exporters, ONNX Runtime against eager ---------------------------------------

EXPORTERS = [pytest.param(False, id="torchscript"),
             pytest.param(True, id="dynamo", marks=requires_dynamo_exporter)]


def _check_onnx_runs_to_eager(model, generator, dtype=torch.float32, bound=F32_BOUND, **options):
    """The graph on inputs of another batch and query count than exported, against eager."""
    value, loc, attn, _ = _other_inputs(generator, dtype)
    expected = pymsda.ms_deform_attn(value, SHAPES, None, loc, attn, **options)
    out = _run(model, value, loc, attn)
    assert out.dtype == dtype and out.shape == expected.shape
    assert rel_l2(out, expected) < bound
    return out


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("tables", ["list", "constant"])
def test_onnx_export_runs_to_eager_with_dynamic_batch_and_queries(generator, dynamo, tables):
    if dynamo and _onnxscript_missing():
        pytest.skip(NEEDS_ONNXSCRIPT)
    value, loc, attn, _ = _inputs(generator, 2, 9)
    model = _to_onnx(Call(SHAPES, tables), (value, loc, attn), dynamo=dynamo)
    assert "Gather" in {node.op_type for node in model.graph.node}
    assert all(node.domain in ("", "ai.onnx") for node in model.graph.node)
    _check_onnx_runs_to_eager(model, generator)


@pytest.mark.parametrize("opset", [11, 13, 16, 17])
def test_onnx_export_gather_form_at_every_opset(generator, opset):
    value, loc, attn, _ = _inputs(generator, 2, 9)
    model = _to_onnx(Call(SHAPES), (value, loc, attn), opset=opset)
    assert model.opset_import[0].version == opset
    assert "GridSample" not in {node.op_type for node in model.graph.node}
    _check_onnx_runs_to_eager(model, generator)


@pytest.mark.parametrize("opset", [16, 17])
def test_onnx_export_grid_sample_form(generator, opset):
    value, loc, attn, _ = _inputs(generator, 2, 9)
    with export.onnx_options(method="grid_sample"):
        model = _to_onnx(Call(SHAPES), (value, loc, attn), opset=opset)
    assert "GridSample" in {node.op_type for node in model.graph.node}
    _check_onnx_runs_to_eager(model, generator)


def test_onnx_export_reads_spatial_shapes_when_they_are_an_input(generator):
    """Level sizes that change at run time (another image size) are read by the graph."""
    value, loc, attn, inputs = _inputs(generator, 2, 9)
    model = _to_onnx(Call(SHAPES, "input"), (value, loc, attn, inputs["spatial_shapes"]),
                     tables="input")
    other = [(4, 6), (2, 3), (3, 1), (1, 5)]
    value, loc, attn, inputs = _inputs(generator, 3, 4, shapes=other)
    out = _run(model, value, loc, attn, inputs["spatial_shapes"])
    assert rel_l2(out, oracle_forward(inputs)) < 1e-6


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("sampling", ["bilinear", "nearest"])
def test_onnx_export_per_level_points_nearest_and_softmax(generator, dynamo, sampling):
    if dynamo and _onnxscript_missing():
        pytest.skip(NEEDS_ONNXSCRIPT)
    counts = [2, 0, 3, 1]
    options = dict(num_points_list=counts, sampling=sampling, softmax=True)

    def inputs(batch, queries):
        made = make_point_inputs(generator, batch, queries, 3, 5, SHAPES, counts, logits=True,
                                 dtype=torch.float32)
        return made, (made["value"], made["sampling_locations"], made["attention_weights"])
    _, args = inputs(2, 9)
    model = _to_onnx(Call(SHAPES, **options), args, dynamo=dynamo)
    made, args = inputs(3, 4)
    expected = oracle_forward_general(made, num_points_list=counts,
                                      nearest=sampling == "nearest", softmax=True)
    assert rel_l2(_run(model, *args), expected) < 1e-6


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("points", ["float16", "float32"])
def test_onnx_export_float16(generator, dynamo, points):
    """A float16 value with float16 points, or with float32 points (autocast's): computed in
    float32 as the kernels do, output in float16."""
    if dynamo and _onnxscript_missing():
        pytest.skip(NEEDS_ONNXSCRIPT)
    point_dtype = getattr(torch, points)
    value, loc, attn, _ = _inputs(generator, 2, 9, dtype=torch.float16)
    model = _to_onnx(Call(SHAPES), (value, loc.to(point_dtype), attn.to(point_dtype)),
                     dynamo=dynamo)
    value, loc, attn, inputs = _other_inputs(generator, torch.float16)
    loc, attn = loc.to(point_dtype), attn.to(point_dtype)
    out = _run(model, value, loc, attn)
    eager = pymsda.ms_deform_attn(value, SHAPES, None, loc, attn)
    assert out.dtype == torch.float16
    # the same float32 computation rounded once: at most one half-precision rounding apart
    assert rel_l2(out, eager) < 1e-3
    assert rel_l2(out, oracle_forward(inputs)) < 2 * rel_l2(eager, oracle_forward(inputs)) + 1e-4


@pytest.mark.parametrize("name", ["small_enc", "dec300", "ddetr_dec"])
def test_onnx_runtime_matches_eager_on_benchmark_shapes(name):
    """The CPU shapes of pymsda/bench/shapes.json, locations uniform in [-0.05, 1.05]: ONNX
    Runtime within 1e-5 (relative L2) of eager in float32."""
    import json
    import os
    with open(os.path.join(os.path.dirname(pymsda.__file__), "bench", "shapes.json")) as f:
        shape = json.load(f)["cpu"][name]
    levels = [tuple(level) for level in shape["levels"]]
    B, H, C, P = shape["B"], shape["H"], shape["C"], shape["P"]
    Q = shape["Q"] or flat_size(levels)
    generator = torch.Generator().manual_seed(29)
    value = torch.randn(B, flat_size(levels), H, C, generator=generator)
    loc = torch.rand(B, Q, H, len(levels), P, 2, generator=generator) * 1.1 - 0.05
    attn = torch.rand(B, Q, H, len(levels), P, generator=generator)
    attn = attn / attn.sum((-1, -2), keepdim=True)
    small = [t[:1, :5] if t is not value else t[:1] for t in (value, loc, attn)]
    model = _to_onnx(Call(levels), tuple(small))
    out = _run(model, value, loc, attn)
    assert rel_l2(out, pymsda.ms_deform_attn(value, levels, None, loc, attn)) < F32_BOUND


# ---- TensorRT's MultiscaleDeformableAttnPlugin_TRT -------------------------------------------

def _plugin_nodes(model):
    return [node for node in model.graph.node if node.op_type == export.TENSORRT_PLUGIN]


def _constant_of(model, name):
    for init in model.graph.initializer:
        if init.name == name:
            return onnx.numpy_helper.to_array(init)
    for node in model.graph.node:
        if node.op_type == "Constant" and node.output[0] == name:
            return onnx.numpy_helper.to_array(node.attribute[0].t)
    raise AssertionError(f"{name} is not a constant of the graph")


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("version", ["1", "2"])
def test_tensorrt_node_structure(generator, dynamo, version):
    """One node as TensorRT's ONNX parser finds the plugin: op type
    MultiscaleDeformableAttnPlugin_TRT, plugin_version / plugin_namespace attributes, inputs
    (value, spatial_shapes int32 (L, 2), level_start_index int32 (L,), sampling_locations,
    attention_weights) with the graph's own tensors, and its (B, Q, H, C) output reshaped to
    (B, Q, H*C) as the graph's output."""
    if dynamo and _onnxscript_missing():
        pytest.skip(NEEDS_ONNXSCRIPT)
    value, loc, attn, _ = _inputs(generator, 2, 9)
    with export.onnx_options(tensorrt=True, plugin_version=version):
        model = _to_onnx(Call(SHAPES), (value, loc, attn), dynamo=dynamo)
    (node,) = _plugin_nodes(model)
    assert node.domain == "trt"
    assert {a.name: a.s.decode() for a in node.attribute} == {
        "plugin_version": version, "plugin_namespace": ""}
    assert list(node.input[:1]) + list(node.input[3:]) == [
        "value", "sampling_locations", "attention_weights"]
    shapes, starts = _constant_of(model, node.input[1]), _constant_of(model, node.input[2])
    assert shapes.dtype == np.int32 and shapes.tolist() == [list(p) for p in SHAPES]
    assert starts.dtype == np.int32 and starts.tolist() == level_start_index_of(SHAPES)
    (reshape,) = [n for n in model.graph.node if node.output[0] in n.input]
    assert reshape.op_type == "Reshape" and reshape.output[0] == model.graph.output[0].name
    assert {n.op_type for n in model.graph.node} <= {export.TENSORRT_PLUGIN, "Reshape",
                                                    "Constant", "Shape", "Concat", "Slice",
                                                    "Gather", "Unsqueeze"}
    assert "GatherElements" not in {n.op_type for n in model.graph.node}


def _as_function(model, domain, name):
    """model's graph as a FunctionProto domain.name (initializers become Constant nodes)."""
    constants = [onnx.helper.make_node("Constant", [], [init.name], value=init)
                 for init in model.graph.initializer]
    return onnx.helper.make_function(
        domain, name, [i.name for i in model.graph.input], [o.name for o in model.graph.output],
        constants + list(model.graph.node), list(model.opset_import))


class PluginSemantics(torch.nn.Module):
    """The plugin's contract written with the decomposition: its five inputs as TensorRT takes
    them (int32 tables read at run time), output (B, Q, H, C)."""

    def forward(self, value, spatial_shapes, level_start_index, sampling_locations,
                attention_weights):
        out = decompose(value, spatial_shapes, level_start_index, sampling_locations,
                        attention_weights)
        return out.reshape(value.shape[0], -1, value.shape[2], value.shape[3])


def _with_decomposed_plugin(model, dtype):
    """model with its plugin node served by PluginSemantics, as a model-local function."""
    node = _plugin_nodes(model)[0]
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    value, loc, attn, inputs = _inputs(torch.Generator().manual_seed(0), 2, 9, dtype=dtype)
    args = (value, inputs["spatial_shapes"].int(), inputs["level_start_index"].int(), loc, attn)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(PluginSemantics(), args, f, **_TORCHSCRIPT, opset_version=opset,
                          input_names=["value", "shapes", "starts", "loc", "attn"],
                          dynamic_axes={"value": [0], "loc": [0, 1], "attn": [0, 1]})
    semantics = onnx.load_from_string(f.getvalue())
    model.functions.append(_as_function(semantics, node.domain, node.op_type))
    onnx.checker.check_model(model)
    return model


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("case", ["float32", "softmax", "equal_counts", "float16",
                                  "half_value_f32_points"])
def test_tensorrt_node_replaced_by_the_decomposition_runs_to_eager(generator, dynamo, case):
    if dynamo and _onnxscript_missing():
        pytest.skip(NEEDS_ONNXSCRIPT)
    dtype = torch.float16 if case in ("float16", "half_value_f32_points") else torch.float32
    options = {"softmax": {"softmax": True},
               "equal_counts": {"num_points_list": [3] * len(SHAPES)}}.get(case, {})

    def args(batch, queries):
        value, loc, attn, inputs = _inputs(generator, batch, queries, dtype=dtype)
        if case == "half_value_f32_points":
            loc, attn = loc.float(), attn.float()
        if "num_points_list" in options:
            loc, attn = loc.flatten(3, 4), attn.flatten(3, 4)
        return value, loc, attn
    with export.onnx_options(tensorrt=True):
        model = _to_onnx(Call(SHAPES, **options), args(2, 9), dynamo=dynamo)
    assert len(_plugin_nodes(model)) == 1
    plugin_dtype = torch.float16 if case == "float16" else torch.float32
    model = _with_decomposed_plugin(model, plugin_dtype)
    value, loc, attn = args(3, 4)
    out = _run(model, value, loc, attn)
    eager = pymsda.ms_deform_attn(value, SHAPES, None, loc, attn, **options)
    assert out.dtype == value.dtype and out.shape == eager.shape
    assert rel_l2(out, eager) < (1e-3 if dtype == torch.float16 else 1e-6)


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("what", ["nearest", "unequal_counts"])
def test_tensorrt_option_falls_back_to_the_decomposition_with_a_warning(generator, dynamo,
                                                                        what):
    if dynamo and _onnxscript_missing():
        pytest.skip(NEEDS_ONNXSCRIPT)
    options = ({"sampling": "nearest"} if what == "nearest"
               else {"num_points_list": [4, 3, 1, 4]})
    value, loc, attn, _ = _inputs(generator, 2, 9, points=3)
    if what == "unequal_counts":
        loc, attn = loc.flatten(3, 4), attn.flatten(3, 4)
    with export.onnx_options(tensorrt=True), pytest.warns(UserWarning, match="cannot express"):
        model = _to_onnx(Call(SHAPES, **options), (value, loc, attn), dynamo=dynamo,
                         quiet=False)
    assert not _plugin_nodes(model)
    value, loc, attn, _ = _other_inputs(generator)
    if what == "unequal_counts":
        loc, attn = loc.flatten(3, 4), attn.flatten(3, 4)
    assert rel_l2(_run(model, value, loc, attn),
                  pymsda.ms_deform_attn(value, SHAPES, None, loc, attn, **options)) < 1e-6


@requires_dynamo_exporter
def test_tensorrt_node_from_an_exported_program_runs_to_eager(generator):
    """An ExportedProgram decomposed inside onnx_options(tensorrt=True): the plugin node, its
    tables computed from the program's shape constant."""
    if _onnxscript_missing():
        pytest.skip(NEEDS_ONNXSCRIPT)
    value, loc, attn, _ = _inputs(generator, 2, 9)
    batch, queries = torch.export.Dim("batch"), torch.export.Dim("queries")
    program = torch.export.export(Call(SHAPES), (value, loc, attn), dynamic_shapes=(
        {0: batch}, {0: batch, 1: queries}, {0: batch, 1: queries}))
    with export.onnx_options(tensorrt=True):
        program = program.run_decompositions(export.decompositions())
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(program, (value, loc, attn), f, dynamo=True)
    model = onnx.load_from_string(f.getvalue())
    assert len(_plugin_nodes(model)) == 1
    value, loc, attn, _ = _other_inputs(generator)
    out = _run(_with_decomposed_plugin(model, torch.float32), value, loc, attn)
    assert rel_l2(out, pymsda.ms_deform_attn(value, SHAPES, None, loc, attn)) < 1e-6


def test_onnx_options_reject_unknown_values():
    with pytest.raises(ValueError, match="method"):
        with export.onnx_options(method="bicubic"):
            pass
    with pytest.raises(ValueError, match="plugin_version"):
        with export.onnx_options(plugin_version="3"):
            pass

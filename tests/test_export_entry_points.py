"""Every entry point under every tracer: pymsda.ms_deform_attn, MSDeformAttn and each drop-in
of pymsda.compat, recorded by torch.jit.trace, torch.jit.script, both ONNX exporters and
torch.export (and the ExportedProgram given to torch.onnx.export), then run (TorchScript, ONNX
Runtime, the exported program) on inputs of another batch and query count and compared with
eager; or refused with an error that names pymsda and says what to do. What each
records (the op, the decomposition) is checked in tests/test_export.py and
tests/test_torch_library.py against the float64 oracle."""
import importlib.util
import inspect
import io
import warnings
from typing import List, Tuple

import pytest
import torch

import pymsda
from pymsda import export
from pymsda.compat import (_switch, deformable_detr, extension, mmcv, paddle, rfdetr, rtdetr,
                           transformers, ultralytics)
from conftest import NEEDS_ONNX, expects_torchscript_deprecation, requires_torch_feature
from factories import flat_size, level_start_index_of, make_inputs, rel_l2

pytestmark = expects_torchscript_deprecation  # every entry point is scripted and traced

ort = pytest.importorskip("onnxruntime", reason=NEEDS_ONNX)

SHAPES = [(5, 7), (3, 4), (1, 1), (2, 6)]  # rectangular, a 1x1 level
STARTS = level_start_index_of(SHAPES)
HAS_CUSTOM_OP = pymsda.ops.HAS_TORCH_LIBRARY_OPS
HAS_EXPORT = HAS_CUSTOM_OP and hasattr(getattr(torch, "export", None), "export")
requires_export = requires_torch_feature(HAS_EXPORT, "torch.export with torch.library custom ops")
requires_dynamo_exporter = requires_torch_feature(
    HAS_EXPORT and "dynamo" in inspect.signature(torch.onnx.export).parameters
    and importlib.util.find_spec("onnxscript") is not None,
    "torch.onnx.export(dynamo=True) (or no onnxscript, which it needs)")
_TORCHSCRIPT = ({"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters
                else {})  # torch 1.13's export has only the TorchScript exporter, no keyword


# ---- the entry points, as functions of (value, loc, attn, shapes, starts) --------------------
# value (B, S, H, C), loc (B, Q, H, L, P, 2), attn (B, Q, H, L, P), shapes (L, 2), starts (L,)

def _ms_deform_attn(value, loc, attn, shapes, starts):
    return pymsda.ms_deform_attn(value, shapes, starts, loc, attn)


def _deformable_detr(value, loc, attn, shapes, starts):
    return deformable_detr.MSDeformAttnFunction.apply(value, shapes, starts, loc, attn, 64)


def _extension(value, loc, attn, shapes, starts):
    return extension.ms_deform_attn_forward(value, shapes, starts, loc, attn, 64)


def _mmcv(value, loc, attn, shapes, starts):
    return mmcv.MultiScaleDeformableAttnFunction.apply(value, shapes, starts, loc, attn, 64)


def _mask2former(value, loc, attn, shapes, starts):
    return transformers.multi_scale_deformable_attention(value, shapes, loc, attn)


def _rtdetr(value, loc, attn, shapes, starts):
    return rtdetr.deformable_attention_core_func(value, shapes, loc, attn)


def _rtdetr_v2_discrete(value, loc, attn, shapes, starts):
    return rtdetr.deformable_attention_core_func_v2(value, shapes, loc.flatten(3, 4),
                                                    attn.flatten(3, 4), [3, 3, 3, 3], "discrete")


def _ultralytics(value, loc, attn, shapes, starts):
    return ultralytics.multi_scale_deformable_attn_pytorch(value, shapes, loc.flatten(3, 4),
                                                           attn.flatten(3, 4))


def _rfdetr(value, loc, attn, shapes, starts):  # value in RF-DETR's (B, H, C, S) layout
    return rfdetr.ms_deform_attn_core_pytorch(value.permute(0, 2, 3, 1), shapes, loc,
                                              attn.flatten(3, 4))


def _paddle(value, loc, attn, shapes, starts):
    return paddle.ms_deformable_attn(value, shapes, starts, loc, attn)


def _paddle_fallback_name(value, loc, attn, shapes, starts):
    return paddle.deformable_attention_core_func(value, shapes, starts, loc, attn)


def _mmcv_pytorch(value, loc, attn, shapes, starts):
    return mmcv.multi_scale_deformable_attn_pytorch(value, shapes, loc, attn)


def _deformable_detr_pytorch(value, loc, attn, shapes, starts):
    return deformable_detr.ms_deform_attn_core_pytorch(value, shapes, loc, attn)


SCRIPTABLE = [_ms_deform_attn, _deformable_detr, _extension, _mmcv, _mask2former, _rtdetr,
              _rtdetr_v2_discrete, _ultralytics, _rfdetr, _paddle, _paddle_fallback_name]
PURE_PYTORCH = [_mmcv_pytorch, _deformable_detr_pytorch]  # the reference, as in the originals


class Function(torch.nn.Module):
    """A function entry point, the level tables constants of the graph."""

    def __init__(self, function):
        super().__init__()
        self.function = function

    def forward(self, value, loc, attn):
        return self.function(value, loc, attn, torch.tensor(SHAPES), torch.tensor(STARTS))


class KernelLayer(torch.nn.Module):
    """HF transformers' kernel layer, as its models call it."""

    def __init__(self):
        super().__init__()
        self.layer = transformers.MultiScaleDeformableAttention()

    def forward(self, value, loc, attn):
        return self.layer(value, torch.tensor(SHAPES), SHAPES, torch.tensor(STARTS), loc, attn, 64)


class Module(torch.nn.Module):
    """A module entry point: forward(query, reference_points, input_flatten)."""

    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        if kind == "MSDeformAttn":
            self.attention = pymsda.MSDeformAttn(d_model=32, n_levels=4, n_heads=4, n_points=2)
        elif kind == "mmcv":
            self.attention = mmcv.MultiScaleDeformableAttention(32, 4, 4, 2, dropout=0.0,
                                                                batch_first=True)
        else:
            self.attention = rtdetr.MSDeformableAttention(embed_dim=32, num_heads=4,
                                                          num_levels=4, num_points=2)
        torch.nn.init.normal_(self.attention.sampling_offsets.weight, std=0.3)
        torch.nn.init.normal_(self.attention.attention_weights.weight, std=0.3)

    def forward(self, query, reference_points, flat):
        shapes, starts = torch.tensor(SHAPES), torch.tensor(STARTS)
        if self.kind == "MSDeformAttn":
            return self.attention(query, reference_points, flat, shapes, starts)
        if self.kind == "mmcv":
            return self.attention(query, value=flat, reference_points=reference_points,
                                  spatial_shapes=shapes, level_start_index=starts)
        return self.attention(query, reference_points, flat, SHAPES)


# name -> (make the module, its inputs' kind, whether it records pymsda's op)
ENTRIES = {f.__name__.lstrip("_"): (lambda f=f: Function(f), "points", True) for f in SCRIPTABLE}
ENTRIES.update({f.__name__.lstrip("_"): (lambda f=f: Function(f), "points", False)
                for f in PURE_PYTORCH})
ENTRIES["transformers_kernel_layer"] = (KernelLayer, "points", True)
ENTRIES["MSDeformAttn"] = (lambda: Module("MSDeformAttn"), "module", True)
ENTRIES["rtdetr_v2_module"] = (lambda: Module("rtdetr"), "module", True)
# mmcv's module runs the pure-PyTorch MSDA while exporting, as mmcv's own does off CUDA
ENTRIES["mmcv_module"] = (lambda: Module("mmcv"), "module", False)


def _args(generator, kind, batch, queries):
    if kind == "points":
        inputs = make_inputs(generator, batch, queries, 3, 5, SHAPES, 3, dtype=torch.float32,
                             kink_free=True)
        return inputs["value"], inputs["sampling_locations"], inputs["attention_weights"]
    return (torch.randn(batch, queries, 32, generator=generator),
            torch.rand(batch, queries, len(SHAPES), 2, generator=generator),
            torch.randn(batch, flat_size(SHAPES), 32, generator=generator))


def _entry(name, generator):
    """(module in eval mode, inputs to record with, other inputs, eager output on those)."""
    make, kind, _ = ENTRIES[name]
    module = make().eval()
    recorded, other = _args(generator, kind, 2, 9), _args(generator, kind, 3, 4)
    with torch.no_grad():
        return module, recorded, other, module(*other)


def _dims(name):
    """torch.export's dynamic batch and query sizes of the three inputs."""
    batch, queries = torch.export.Dim("batch"), torch.export.Dim("queries")
    if ENTRIES[name][1] == "points":
        return {0: batch}, {0: batch, 1: queries}, {0: batch, 1: queries}
    return {0: batch, 1: queries}, {0: batch, 1: queries}, {0: batch}


def _run_onnx(model_bytes, args):
    session = ort.InferenceSession(model_bytes, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    return torch.from_numpy(session.run(None, dict(zip(names, (a.numpy() for a in args))))[0])


def _kinds(block):
    """The kinds of all nodes of a TorchScript graph or block, inside if/else blocks too."""
    kinds = set()
    for node in block.nodes():
        kinds.add(node.kind())
        for inner in node.blocks():
            kinds |= _kinds(inner)
    return kinds


def _quietly(record, *args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return record(*args, **kwargs)


# ---- torch.jit.trace ------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(ENTRIES))
def test_jit_trace_reruns_to_eager_on_other_sizes(generator, name):
    module, recorded, other, expected = _entry(name, generator)
    traced = _quietly(torch.jit.trace, module, recorded)
    kinds = _kinds(traced.inlined_graph)
    assert ("pymsda::ms_deform_attn_forward" in kinds) == (HAS_CUSTOM_OP and ENTRIES[name][2])
    with torch.no_grad():
        out = traced(*other)
    assert out.shape == expected.shape
    assert rel_l2(out, expected) < 1e-6


# ---- torch.jit.script -----------------------------------------------------------------------

@pytest.mark.parametrize("function", SCRIPTABLE, ids=lambda f: f.__name__.lstrip("_"))
def test_jit_script_of_a_function_records_the_op_and_runs_to_eager(generator, function):
    scripted = torch.jit.script(function)
    assert "pymsda::ms_deform_attn" in _kinds(scripted.inlined_graph)
    value, loc, attn = _args(generator, "points", 3, 4)
    args = (value, loc, attn, torch.tensor(SHAPES), torch.tensor(STARTS))
    expected = function(*args)
    assert rel_l2(scripted(*args), expected) < 1e-6


def _listed_op(value, loc, attn, shapes: List[Tuple[int, int]]):
    return pymsda.ms_deform_attn(value, shapes, None, loc, attn, softmax=True)


def _listed_rtdetr(value, loc, attn, shapes: List[Tuple[int, int]]):
    return rtdetr.deformable_attention_core_func(value, shapes, loc, attn)


def _listed_rfdetr(value, loc, attn, shapes: List[Tuple[int, int]]):
    return rfdetr.ms_deform_attn_core_pytorch(value.permute(0, 2, 3, 1), torch.tensor(shapes),
                                              loc, attn.flatten(3, 4), shapes)


@pytest.mark.parametrize("function", [_listed_op, _listed_rtdetr, _listed_rfdetr],
                         ids=["ms_deform_attn", "rtdetr", "rfdetr"])
def test_jit_script_takes_shapes_as_a_list_and_checks_them(generator, function):
    scripted = torch.jit.script(function)
    value, loc, attn = _args(generator, "points", 3, 4)
    assert rel_l2(scripted(value, loc, attn, SHAPES), function(value, loc, attn, SHAPES)) < 1e-6
    with pytest.raises(RuntimeError) as raised:  # the eager checks, by name
        scripted(value, loc, attn, [(5, 7), (3, 4), (1, 1), (2, 7)])
    message = str(raised.value)
    # (torch 1.13's TorchScript interpreter drops the text of an error raised in a Python kernel)
    assert "spatial_shapes" in message or message.rstrip().endswith("RuntimeError:")


def test_jit_script_gradients_and_saved_module_match_eager(generator):
    scripted = torch.jit.script(_listed_op)
    value, loc, attn = _args(generator, "points", 3, 4)
    leaves = [t.clone().requires_grad_() for t in (value, loc, attn)]
    eager_leaves = [t.clone().requires_grad_() for t in (value, loc, attn)]
    grads = torch.autograd.grad(scripted(*leaves, SHAPES).square().sum(), leaves)
    expected = torch.autograd.grad(_listed_op(*eager_leaves, SHAPES).square().sum(),
                                   eager_leaves)
    for grad, want in zip(grads, expected):
        assert rel_l2(grad, want) < 1e-6
    saved = io.BytesIO()
    torch.jit.save(scripted, saved)
    saved.seek(0)
    loaded = torch.jit.load(saved)
    assert rel_l2(loaded(value, loc, attn, SHAPES), _listed_op(value, loc, attn, SHAPES)) < 1e-6


def test_jit_script_of_msdeformattn_trains_and_saves_like_eager(generator):
    module, _, other, expected = _entry("MSDeformAttn", generator)
    attention = module.attention
    shapes, starts = torch.tensor(SHAPES), torch.tensor(STARTS)
    scripted = torch.jit.script(attention)  # shares the parameters
    assert rel_l2(scripted(*other, shapes, starts), expected) < 1e-6
    weight = attention.sampling_offsets.weight
    grad = torch.autograd.grad(scripted(*other, shapes, starts).square().sum(), weight)[0]
    want = torch.autograd.grad(attention(*other, shapes, starts).square().sum(), weight)[0]
    assert rel_l2(grad, want) < 1e-6
    saved = io.BytesIO()
    torch.jit.save(scripted, saved)
    saved.seek(0)
    with torch.no_grad():
        assert rel_l2(torch.jit.load(saved)(*other, shapes, starts), expected) < 1e-6


def _routed(value, loc, attn, shapes, starts):  # a name switched by install()
    return ROUTED(value, shapes, loc, attn)


ROUTED = _switch.routed(rtdetr.deformable_attention_core_func, _mask2former)


def _extension_backward(value, loc, attn, shapes, starts):
    grads = extension.ms_deform_attn_backward(value, shapes, starts, loc, attn,
                                              torch.ones_like(value), 64)
    return grads[0]


@pytest.mark.parametrize("function", PURE_PYTORCH + [_extension_backward, _routed],
                         ids=lambda f: f.__name__.lstrip("_"))
def test_jit_script_of_an_unscriptable_function_says_what_works(function):
    with pytest.raises(RuntimeError, match=r"pymsda: .*torch\.jit\.trace"):
        torch.jit.script(function)


@pytest.mark.parametrize("make", [
    lambda: mmcv.MultiScaleDeformableAttention(32, 4, 4, 2),
    lambda: rtdetr.MSDeformableAttention(embed_dim=32, num_heads=4, num_levels=4),
    lambda: transformers.MultiScaleDeformableAttention(),
], ids=["mmcv_module", "rtdetr_v2_module", "transformers_kernel_layer"])
def test_jit_script_of_a_model_holding_an_unscriptable_module_says_what_works(make):
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = make()

        def forward(self, x):
            return x
    with pytest.raises(RuntimeError, match=r"pymsda: .*torch\.jit\.trace"):
        torch.jit.script(Model())


def test_jit_script_of_the_op_itself_says_to_script_its_caller():
    with pytest.raises(RuntimeError, match="script the function or module that calls it"):
        torch.jit.script(pymsda.ms_deform_attn)


# ---- ONNX: both exporters; ONNX Runtime against eager ----------------------------------------

@pytest.mark.parametrize("dynamo", [pytest.param(False, id="torchscript"),
                                    pytest.param(True, id="dynamo",
                                                 marks=requires_dynamo_exporter)])
@pytest.mark.parametrize("name", list(ENTRIES))
def test_onnx_export_runs_to_eager_on_other_sizes(generator, name, dynamo):
    module, recorded, other, expected = _entry(name, generator)
    f = io.BytesIO()
    if dynamo:
        _quietly(torch.onnx.export, module, recorded, f, dynamo=True,
                 dynamic_shapes=_dims(name))
    else:
        axes = {"a": [0], "b": [0, 1], "c": [0, 1]}
        if ENTRIES[name][1] == "module":
            axes = {"a": [0, 1], "b": [0, 1], "c": [0]}
        _quietly(torch.onnx.export, module, recorded, f, **_TORCHSCRIPT, opset_version=17,
                 input_names=list(axes), dynamic_axes=axes)
    out = _run_onnx(f.getvalue(), other)
    assert out.shape == expected.shape
    assert rel_l2(out, expected) < 1e-5


# ---- torch.export, and its ExportedProgram given to torch.onnx.export -------------------------

# torch.export of the pure-PyTorch MSDA (the entries that record no op of pymsda's) with a
# dynamic query axis: torch 2.11 stops on guards it cannot prove (min(6*Q, 18*Q) == 6*Q,
# ConstraintViolationError; seen on the GPU machine's torch 2.11.0), 2.13 and 2.14 pass. The
# projects' own pure-PyTorch functions are the same code: nothing of pymsda's is involved.
_EXPORT_PROVES_MIN_GUARDS = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 13)


def _exported(name, module, recorded):
    if not ENTRIES[name][2] and not _EXPORT_PROVES_MIN_GUARDS:
        pytest.skip(f"torch {torch.__version__}'s torch.export cannot export the pure-PyTorch MSDA "
                    "with a dynamic query axis (its own guard min(6*Q, 18*Q) == 6*Q); 2.13 can")
    return _quietly(torch.export.export, module, recorded, dynamic_shapes=_dims(name))


def _op_nodes(program):
    """pymsda's op in the program's graph and its subgraphs (torch.no_grad blocks)."""
    return [node for graph_module in program.graph_module.modules()
            if isinstance(graph_module, torch.fx.GraphModule) for node in graph_module.graph.nodes
            if node.op == "call_function"
            and node.target is torch.ops.pymsda.ms_deform_attn_forward.default]


@requires_export
@pytest.mark.parametrize("name", list(ENTRIES))
def test_torch_export_program_runs_to_eager_on_other_sizes(generator, name):
    module, recorded, other, expected = _entry(name, generator)
    program = _exported(name, module, recorded)
    assert len(_op_nodes(program)) == (1 if ENTRIES[name][2] else 0)
    out = program.module()(*other)
    assert out.shape == expected.shape
    assert rel_l2(out, expected) < 1e-6


# the op as each kind of entry point records it: plain, with options (per-level points,
# nearest), inside a torch.no_grad block, in a module; and a program without it
@requires_dynamo_exporter
@pytest.mark.parametrize("name", ["ms_deform_attn", "rtdetr_v2_discrete", "extension",
                                  "MSDeformAttn", "mmcv_module"])
def test_exported_program_decomposed_for_onnx_runs_to_eager(generator, name):
    module, recorded, other, expected = _entry(name, generator)
    program = _exported(name, module, recorded).run_decompositions(export.decompositions())
    assert not _op_nodes(program)
    assert rel_l2(program.module()(*other), expected) < 1e-6  # the decomposition, in torch
    f = io.BytesIO()
    _quietly(torch.onnx.export, program, recorded, f, dynamo=True)
    assert rel_l2(_run_onnx(f.getvalue(), other), expected) < 1e-5


@requires_dynamo_exporter
@pytest.mark.parametrize("name", ["ms_deform_attn", "MSDeformAttn"])
def test_exported_program_holding_the_op_given_to_onnx_says_to_decompose(generator, name):
    module, recorded, _, _ = _entry(name, generator)
    program = _exported(name, module, recorded)
    with pytest.raises(Exception, match=r"pymsda\.export\.decompositions\(\)"):
        _quietly(torch.onnx.export, program, recorded, io.BytesIO(), dynamo=True)

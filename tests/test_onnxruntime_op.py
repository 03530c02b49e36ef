"""ONNX Runtime's op pymsda::MSDeformAttn (c/ort_op.c) on the CPU provider, and the node that
torch.onnx.export records for it inside pymsda.export.onnx_options(onnxruntime=True).

- One-node models (tests/onnx_node.py): the node against the float64 oracle and eager pymsda,
  two batch and image sizes through one session, 1 and 2 intra-op threads, int32 tables,
  nearest sampling and per-level points, float16 (and float32 points with a float16 value);
- every bad input the op refuses, each raised by session.run with a message naming the input
  and the layout it expects (the session still runs afterwards), and the bad attributes
  refused when the session is made; a model loaded without the library: ONNX Runtime's own
  unknown-op error;
- export under both exporters: one node per call, dynamic batch and query axes, onnx.checker,
  run on other sizes (and, with the tables a graph input, another image size) against eager
  pymsda and the oracle.
The deployment without torch and the other end of the onnxruntime range:
tests/test_onnxruntime_deployment.py; real models: tests/test_onnxruntime_models.py."""
import inspect
import io
import warnings

import numpy as np
import pytest
import torch

import pymsda
from conftest import requires_torch_feature
from onnx_node import node_model, oracle_of, random_inputs, rel_l2, session

onnx = pytest.importorskip("onnx", reason="the ONNX tests need onnx (installed by .ci/run)")
ort = pytest.importorskip("onnxruntime", reason="the ONNX tests need onnxruntime")

LIBRARY = pymsda.library_path()
SHAPES = [(5, 7), (3, 4), (1, 1), (2, 6)]
OTHER_SHAPES = [(9, 4), (2, 3), (4, 4), (1, 5)]  # another image: other sizes, other S


@pytest.fixture
def rng(generator):
    return np.random.default_rng(int(torch.randint(0, 2**31, (1,), generator=generator)))


def run(model, feed, threads=2):
    return session(model.SerializeToString(), LIBRARY, threads).run(None, feed)[0]


def eager(feed, counts=None, nearest=False):
    t = {k: torch.from_numpy(v) for k, v in feed.items()}
    return pymsda.ms_deform_attn(t["value"], t["spatial_shapes"], t["level_start_index"],
                                 t["sampling_locations"], t["attention_weights"],
                                 num_points_list=counts,
                                 sampling="nearest" if nearest else "bilinear").numpy()


# ---- the op against the oracle -----------------------------------------------------------------

@pytest.mark.parametrize("threads", [1, 2])
def test_node_matches_f64_oracle_and_eager_at_two_sizes_in_one_session(rng, threads):
    sess = session(node_model().SerializeToString(), LIBRARY, threads)
    for batch, queries, shapes in ((2, 33, SHAPES), (3, 70, OTHER_SHAPES)):
        feed = random_inputs(rng, batch, queries, shapes)
        out = sess.run(None, feed)[0]
        assert out.shape == (batch, queries, 15) and out.dtype == np.float32
        assert rel_l2(out, oracle_of(feed)) < 1e-6
        assert rel_l2(out, eager(feed)) < 1e-6


def test_node_int32_tables(rng):
    feed = random_inputs(rng, 2, 9, SHAPES, index_type=np.int32)
    assert rel_l2(run(node_model(index_type=np.int32), feed), oracle_of(feed)) < 1e-6


@pytest.mark.parametrize("nearest", [False, True])
def test_node_per_level_points_and_nearest_sampling(rng, nearest):
    counts = [2, 0, 3, 1]
    model = node_model(num_points_list=counts, sampling="nearest" if nearest else "bilinear")
    for batch, queries in ((2, 9), (1, 40)):
        feed = random_inputs(rng, batch, queries, SHAPES, counts=counts)
        out = run(model, feed)
        assert rel_l2(out, oracle_of(feed, counts, nearest)) < 1e-6
        assert rel_l2(out, eager(feed, counts, nearest)) < 1e-6


@pytest.mark.parametrize("points", [np.float16, np.float32])
def test_node_float16_accumulates_in_float32(rng, points):
    """A float16 value with float16 points, or with float32 points (autocast's): the same
    float32 computation as eager pymsda, rounded once to float16."""
    feed = random_inputs(rng, 2, 30, SHAPES, value_type=np.float16, point_type=points)
    out = run(node_model(np.float16, points), feed)
    assert out.dtype == np.float16
    reference = eager(feed)
    assert rel_l2(out, reference) < 1e-3
    truth = oracle_of(feed)
    assert rel_l2(out, truth) <= 2 * rel_l2(reference, truth) + 1e-4


# ---- bad input ---------------------------------------------------------------------------------

def _bad(name):
    """(model options, a change of the feed, the words the error must hold)."""
    cases = {
        "value_rank": ({}, lambda f: f.update(value=f["value"][0]),
                       ["input 0 (value)", "(N, S, M, D)"]),
        "value_length": ({}, lambda f: f.update(value=f["value"][:, :-1]),
                         ["input 0 (value)", "S must be sum of H_l * W_l"]),
        "starts": ({}, lambda f: f["level_start_index"].__setitem__(2, 40),
                   ["input 2 (level_start_index)", "start_l = sum over j < l"]),
        "negative_size": ({}, lambda f: f["spatial_shapes"].__setitem__((1, 0), -3),
                          ["input 1 (spatial_shapes)", ">= 0"]),
        "shapes_columns": ({}, lambda f: f.update(spatial_shapes=f["spatial_shapes"][:, :1]),
                           ["input 1 (spatial_shapes)", "(L, 2)"]),
        "starts_length": ({}, lambda f: f.update(level_start_index=f["level_start_index"][:3]),
                          ["input 2 (level_start_index)", "(L,)"]),
        "int32_int64_mix": ({"start_type": np.int32},
                            lambda f: f.update(level_start_index=f["level_start_index"]
                                               .astype(np.int32)),
                            ["input 2 (level_start_index) is int32",
                             "input 1 (spatial_shapes) is int64", "both int32"]),
        "float_shapes": ({"index_type": np.float32, "start_type": np.int64},
                         lambda f: f.update(spatial_shapes=f["spatial_shapes"]
                                            .astype(np.float32)),
                         ["input 1 (spatial_shapes)", "int64 or int32"]),
        "locations_rank": ({}, lambda f: f.update(sampling_locations=f["sampling_locations"]
                                                  [..., 0, :]),
                           ["input 3 (sampling_locations)", "(N, Lq, M, L, P, 2)"]),
        "locations_xyz": ({}, lambda f: f.update(sampling_locations=np.concatenate(
            [f["sampling_locations"], f["sampling_locations"][..., :1]], -1)),
            ["input 3 (sampling_locations)", "(N, Lq, M, L, P, 2)"]),
        "locations_batch": ({}, lambda f: f.update(sampling_locations=f["sampling_locations"]
                                                   [:1]),
                            ["input 3 (sampling_locations)", "(N, Lq, M, L, P, 2)"]),
        "weights_points": ({}, lambda f: f.update(attention_weights=f["attention_weights"]
                                                  [..., :2]),
                           ["input 4 (attention_weights)", "(N, Lq, M, L, P)"]),
        "weights_levels": ({}, lambda f: f.update(attention_weights=f["attention_weights"]
                                                  [:, :, :, :3]),
                           ["input 4 (attention_weights)", "(N, Lq, M, L, P)"]),
        "nan_location": ({}, lambda f: f["sampling_locations"].__setitem__(
            (1, 2, 0, 3, 1, 0), np.nan), ["input 3 (sampling_locations)", "NaN"]),
        "point_type": ({"point_type": np.float16},
                       lambda f: f.update(sampling_locations=f["sampling_locations"]
                                          .astype(np.float16),
                                          attention_weights=f["attention_weights"]
                                          .astype(np.float16)),
                       ["input 3 (sampling_locations) is float16", "value's type"]),
        "point_counts": ({"num_points_list": [3, 3, 3]}, lambda f: None,
                         ["attribute num_points_list has 3 counts", "4 levels"]),
        "flat_points": ({"num_points_list": [3, 3, 3, 3]}, lambda f: None,
                        ["input 3 (sampling_locations)", "(N, Lq, M, sum(num_points_list), 2)"]),
    }
    return cases[name]


BAD = ["value_rank", "value_length", "starts", "negative_size", "shapes_columns",
       "starts_length", "int32_int64_mix", "float_shapes", "locations_rank", "locations_xyz",
       "locations_batch", "weights_points", "weights_levels", "nan_location", "point_type",
       "point_counts", "flat_points"]


@pytest.mark.parametrize("case", BAD)
def test_bad_input_raises_naming_the_input_and_layout(rng, case):
    options, change, words = _bad(case)
    sess = session(node_model(**options).SerializeToString(), LIBRARY)
    good = random_inputs(rng, 2, 9, SHAPES)
    feed = {k: v.copy() for k, v in good.items()}
    change(feed)
    with pytest.raises(Exception) as error:
        sess.run(None, feed)
    message = str(error.value)
    assert "pymsda MSDeformAttn" in message and all(w in message for w in words), message
    if "num_points_list" not in options and "point_type" not in options and \
            "start_type" not in options and "index_type" not in options:
        assert rel_l2(sess.run(None, good)[0], oracle_of(good)) < 1e-6  # still serves


@pytest.mark.parametrize("value_type", [np.float32, np.float16])
@pytest.mark.parametrize("where", ["first", "past a block", "last"])
def test_a_nan_location_is_found_where_it_is(rng, value_type, where):
    """The scan of c/ort_op.c (blocks of 4096 read branch-free) names the first NaN's flat
    element, in the first block, in a later one, and as the very last element; a float16 NaN
    is told from an infinity (which is a point far outside, and serves)."""
    sess = session(node_model(value_type=value_type).SerializeToString(), LIBRARY)
    feed = random_inputs(rng, 2, 300, SHAPES, value_type=value_type)
    flat = feed["sampling_locations"].reshape(-1)
    at = {"first": 5, "past a block": 4096 * 2 + 17, "last": flat.size - 1}[where]
    flat[at - 1] = np.inf
    assert sess.run(None, feed)[0].shape[:2] == (2, 300)
    flat[at] = np.nan
    if where != "last":
        flat[at + 3] = np.nan  # a later NaN is not the one named
    with pytest.raises(Exception) as error:
        sess.run(None, feed)
    assert f"holds NaN (flat element {at} of" in str(error.value), str(error.value)


@pytest.mark.parametrize("attributes, words", [
    ({"sampling": "bicubic"}, ['attribute sampling must be "bilinear" or "nearest"']),
    ({"num_points_list": [2, -1, 3, 1]}, ["attribute num_points_list[1] = -1", ">= 0"]),
    ({"num_points_list": [0, 0, 0, 0]}, ["num_points_list sums to 0"]),
])
def test_bad_attributes_are_refused_when_the_session_is_made(attributes, words):
    with pytest.raises(Exception) as error:
        session(node_model(**attributes).SerializeToString(), LIBRARY)
    assert all(w in str(error.value) for w in words), str(error.value)


def test_a_model_without_the_library_gets_onnx_runtimes_unknown_op_error():
    with pytest.raises(Exception) as error:
        ort.InferenceSession(node_model().SerializeToString(),
                             providers=["CPUExecutionProvider"])
    message = str(error.value)
    assert "MSDeformAttn" in message and "pymsda" in message, message


# ---- export ------------------------------------------------------------------------------------

HAS_DYNAMO_NODE = pymsda.ops.HAS_TORCH_LIBRARY_OPS and hasattr(
    getattr(torch.onnx, "ops", None), "symbolic")
EXPORTERS = [pytest.param(False, id="torchscript"),
             pytest.param(True, id="dynamo", marks=requires_torch_feature(
                 HAS_DYNAMO_NODE, "torch.onnx.ops.symbolic (torch.onnx.export(dynamo=True))"))]


# the TorchScript exporter: dynamo=False, or no keyword on a torch whose export has none (1.13)
TORCHSCRIPT = ({"dynamo": False} if "dynamo" in inspect.signature(torch.onnx.export).parameters
               else {})


class Call(torch.nn.Module):
    def __init__(self, tables="list", **options):
        super().__init__()
        self.tables, self.options = tables, options

    def forward(self, value, loc, attn, spatial_shapes=None):
        shapes = SHAPES if self.tables == "list" else spatial_shapes
        return pymsda.ms_deform_attn(value, shapes, None, loc, attn, **self.options)


def export(module, args, dynamo, tables="list"):
    names = ["value", "loc", "attn"] + (["shapes"] if tables == "input" else [])
    f = io.BytesIO()
    with warnings.catch_warnings(), pymsda.export.onnx_options(onnxruntime=True):
        warnings.simplefilter("ignore")
        if dynamo:
            pytest.importorskip("onnxscript")
            batch, queries = torch.export.Dim("batch"), torch.export.Dim("queries")
            dims = ({0: batch}, {0: batch, 1: queries}, {0: batch, 1: queries})
            torch.onnx.export(module, args, f, dynamo=True, input_names=names,
                              dynamic_shapes=dims + ((None,) if tables == "input" else ()))
        else:
            axes = {"value": [0, 1], "loc": [0, 1], "attn": [0, 1]}
            torch.onnx.export(module, args, f, **TORCHSCRIPT, opset_version=17,
                              input_names=names, dynamic_axes=axes)
    model = onnx.load_from_string(f.getvalue())
    onnx.checker.check_model(model)
    nodes = [n for n in model.graph.node if n.op_type == "MSDeformAttn"]
    assert len(nodes) == 1 and nodes[0].domain == "pymsda"
    assert {o.domain: o.version for o in model.opset_import}["pymsda"] == 1
    return model, nodes[0]


def torch_inputs(rng, batch, queries, shapes=SHAPES, **options):
    feed = random_inputs(rng, batch, queries, shapes, **options)
    return feed, [torch.from_numpy(feed[k]) for k in ("value", "sampling_locations",
                                                        "attention_weights")]


@pytest.mark.parametrize("dynamo", EXPORTERS)
def test_export_records_one_node_that_runs_other_batch_and_queries(rng, dynamo):
    _, args = torch_inputs(rng, 2, 9)
    model, node = export(Call(), tuple(args), dynamo)
    assert {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute} == {
        "sampling": b"bilinear"}
    sess = session(model.SerializeToString(), LIBRARY)
    for batch, queries in ((3, 4), (1, 31)):
        feed, args = torch_inputs(rng, batch, queries)
        out = sess.run(None, dict(zip(("value", "loc", "attn"), (a.numpy() for a in args))))[0]
        assert rel_l2(out, oracle_of(feed)) < 1e-6
        assert rel_l2(out, pymsda.ms_deform_attn(args[0], SHAPES, None, *args[1:])) < 1e-6


def test_export_with_shapes_as_input_runs_another_image_size(rng):
    feed, args = torch_inputs(rng, 2, 9)
    shapes = torch.from_numpy(feed["spatial_shapes"])
    model, _ = export(Call("input"), tuple(args) + (shapes,), False, tables="input")
    sess = session(model.SerializeToString(), LIBRARY)
    feed, args = torch_inputs(rng, 3, 5, OTHER_SHAPES)
    out = sess.run(None, {"value": feed["value"], "loc": feed["sampling_locations"],
                          "attn": feed["attention_weights"], "shapes": feed["spatial_shapes"]})
    assert rel_l2(out[0], oracle_of(feed)) < 1e-6


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("sampling", ["bilinear", "nearest"])
def test_export_per_level_points_nearest_and_softmax(rng, dynamo, sampling):
    counts = [2, 0, 3, 1]
    options = dict(num_points_list=counts, sampling=sampling, softmax=True)
    _, args = torch_inputs(rng, 2, 9, counts=counts)
    model, node = export(Call(**options), tuple(args), dynamo)
    attributes = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert attributes == {"sampling": sampling.encode(), "num_points_list": counts}
    feed, args = torch_inputs(rng, 3, 4, counts=counts)
    logits = feed["attention_weights"]
    out = session(model.SerializeToString(), LIBRARY).run(
        None, {"value": feed["value"], "loc": feed["sampling_locations"], "attn": logits})[0]
    expected = pymsda.ms_deform_attn(*[torch.from_numpy(feed[k]) for k in (
        "value",)], SHAPES, None, *args[1:], **options)
    assert rel_l2(out, expected) < 1e-6
    softmaxed = dict(feed, attention_weights=torch.from_numpy(logits).softmax(-1).numpy())
    assert rel_l2(out, oracle_of(softmaxed, counts, sampling == "nearest")) < 1e-6


@pytest.mark.parametrize("dynamo", EXPORTERS)
@pytest.mark.parametrize("points", [np.float16, np.float32])
def test_export_float16_keeps_float32_points_of_a_half_value(rng, dynamo, points):
    _, args = torch_inputs(rng, 2, 9, value_type=np.float16, point_type=points)
    model, node = export(Call(), tuple(args), dynamo)
    feed, args = torch_inputs(rng, 3, 4, value_type=np.float16, point_type=points)
    out = session(model.SerializeToString(), LIBRARY).run(
        None, dict(zip(("value", "loc", "attn"), (a.numpy() for a in args))))[0]
    assert out.dtype == np.float16
    assert rel_l2(out, pymsda.ms_deform_attn(args[0], SHAPES, None, *args[1:])) < 1e-3


def test_onnx_options_take_one_node_type():
    with pytest.raises(ValueError, match="one of tensorrt=True and onnxruntime=True"):
        with pymsda.export.onnx_options(tensorrt=True, onnxruntime=True):
            pass

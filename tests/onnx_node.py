"""tests/onnx_node.py: one-node ONNX models of pymsda's ONNX Runtime op pymsda::MSDeformAttn and
the random inputs they are run on, numpy only, so that a Python with onnxruntime, numpy and the
pymsda wheel but no torch (tests/onnxruntime_deployment.py) can run what the suite writes.

Models are written with the onnx package (the suite's side); inputs, the float64 oracle
(tests/oracle.py) and sessions need numpy and onnxruntime only."""
import numpy as np

import oracle

INPUTS = ("value", "spatial_shapes", "level_start_index", "sampling_locations",
          "attention_weights")
ONNX_TYPES = {np.float32: 1, np.int32: 6, np.int64: 7, np.float16: 10, np.float64: 11}


def node_model(value_type=np.float32, point_type=None, index_type=np.int64, start_type=None,
               opset=17, **attributes):
    """The model of one MSDeformAttn node whose five inputs are graph inputs of the types given
    and any shape (so every check of the op is reached at run time)."""
    from onnx import TensorProto, helper
    types = [value_type, index_type, start_type or index_type, point_type or value_type,
             point_type or value_type]
    node = helper.make_node("MSDeformAttn", list(INPUTS), ["output"], domain="pymsda",
                            **attributes)
    inputs = [helper.make_tensor_value_info(name, ONNX_TYPES[t], None)
              for name, t in zip(INPUTS, types)]
    output = helper.make_tensor_value_info("output", ONNX_TYPES[value_type], None)
    graph = helper.make_graph([node], "msda", inputs, [output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                    helper.make_opsetid("pymsda", 1)])
    model.ir_version = 8  # opened by onnxruntime 1.17 too
    assert TensorProto.FLOAT == ONNX_TYPES[np.float32]
    return model


def random_inputs(rng, batch, queries, shapes, heads=3, channels=5, points=3, counts=None,
                  value_type=np.float32, point_type=None, index_type=np.int64):
    """The op's five inputs as a feed dict: locations uniform in [-0.1, 1.1] (some corners and
    points outside the levels), weights a softmax over each (query, head)'s points; with counts
    (num_points_list) the flat (N, Lq, M, sum, ...) layout."""
    S = sum(h * w for h, w in shapes)
    L = len(shapes)
    starts = np.cumsum([0] + [h * w for h, w in shapes])[:L]
    value = rng.standard_normal((batch, S, heads, channels))
    tail = (sum(counts),) if counts is not None else (L, points)
    loc = rng.uniform(-0.1, 1.1, (batch, queries, heads) + tail + (2,))
    weights = np.exp(rng.standard_normal((batch, queries, heads) + tail))
    weights /= weights.reshape(batch, queries, heads, -1).sum(-1).reshape(
        (batch, queries, heads) + (1,) * len(tail))
    point_type = point_type or value_type
    return {"value": value.astype(value_type),
            "spatial_shapes": np.array(shapes, dtype=index_type).reshape(L, 2),
            "level_start_index": starts.astype(index_type),
            "sampling_locations": loc.astype(point_type),
            "attention_weights": weights.astype(point_type)}


def oracle_of(feed, counts=None, nearest=False):
    """The float64 oracle on the inputs as fed (after their rounding to the fed types)."""
    return oracle.forward_general(*(feed[name].astype(np.float64) for name in
                                    ("value", "spatial_shapes", "sampling_locations",
                                     "attention_weights")),
                                  num_points_list=counts, nearest=nearest)


def rel_l2(actual, expected):
    actual, expected = np.asarray(actual, np.float64), np.asarray(expected, np.float64)
    assert np.all(np.isfinite(actual)), "result has non-finite entries"
    return float(np.linalg.norm((actual - expected).ravel())
                 / max(np.linalg.norm(expected.ravel()), 1e-300))


def session(model_bytes, library, threads=2):
    """A CPU session with pymsda's op library registered."""
    import onnxruntime as ort
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(library)
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


class Checks:
    """The PASS / FAIL lines of a check script run outside pytest (tests/onnxruntime_deployment.py,
    tests/ort_cuda_check.py), then its closing counts."""

    def __init__(self):
        self.results = []

    def __call__(self, name, condition, detail=""):
        self.results.append(bool(condition))
        print(("PASS " if condition else "FAIL ") + name + (f": {detail}" if detail else ""),
              flush=True)

    def summary(self):
        """Prints 'N passed, N failed'; the exit status (1 on any failure)."""
        passed = sum(self.results)
        print(f"{passed} passed, {len(self.results) - passed} failed")
        return 0 if self.results and all(self.results) else 1

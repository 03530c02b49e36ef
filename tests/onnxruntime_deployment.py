"""A deployment of pymsda's ONNX Runtime op as a user without torch has it: onnxruntime, numpy and
the pymsda wheel only. Runs one-node models that tests/test_onnxruntime_deployment.py wrote
(tests/onnx_node.py) against the float64 oracle (tests/oracle.py, numpy), and checks what such a
user meets: `import pymsda` works, pymsda.library_path() loads with plain ctypes and in ONNX
Runtime, torch-only attributes say `pip install torch`, bad input raises the op's message.

    python tests/onnxruntime_deployment.py MODEL_DIR      # PASS/FAIL lines, then the counts
"""
import ctypes
import importlib.util
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402

from onnx_node import Checks, oracle_of, random_inputs, rel_l2, session  # noqa: E402

SHAPES, OTHER = [(5, 7), (3, 4), (1, 1), (2, 6)], [(9, 4), (2, 3), (4, 4), (1, 5)]
COUNTS = [2, 0, 3, 1]
check = Checks()


def main(model_dir):
    import pymsda
    print(f"onnxruntime {ort.__version__}, numpy {np.__version__}, Python "
          f"{sys.version.split()[0]}, pymsda {pymsda.__file__}")
    check("no torch in this Python", importlib.util.find_spec("torch") is None)
    path = pymsda.library_path()
    check("plain ctypes loads pymsda.library_path()", ctypes.CDLL(path) is not None, path)
    try:
        pymsda.MSDeformAttn
        check("pymsda.MSDeformAttn says pip install torch", False, "no ImportError")
    except ImportError as error:
        check("pymsda.MSDeformAttn says pip install torch", "pip install torch" in str(error),
              str(error))
    rng = np.random.default_rng(0)
    model = os.path.join(model_dir, "{}.onnx")
    sess = session(open(model.format("node"), "rb").read(), path)
    for batch, queries, shapes in ((2, 33, SHAPES), (3, 70, OTHER)):
        feed = random_inputs(rng, batch, queries, shapes)
        error = rel_l2(sess.run(None, feed)[0], oracle_of(feed))
        check(f"float32 B={batch} Q={queries} S={feed['value'].shape[1]} against the oracle",
              error < 1e-6, f"rel-L2 {error:.1e}")
    sess = session(open(model.format("points_nearest"), "rb").read(), path)
    feed = random_inputs(rng, 2, 9, SHAPES, counts=COUNTS)
    error = rel_l2(sess.run(None, feed)[0], oracle_of(feed, COUNTS, nearest=True))
    check("num_points_list and nearest sampling against the oracle", error < 1e-6,
          f"rel-L2 {error:.1e}")
    sess = session(open(model.format("half"), "rb").read(), path)
    feed = random_inputs(rng, 2, 30, SHAPES, value_type=np.float16)
    error = rel_l2(sess.run(None, feed)[0], oracle_of(feed))
    check("float16 against the oracle", error < 2e-3, f"rel-L2 {error:.1e}")
    feed["sampling_locations"][1, 2, 0, 3, 1, 0] = np.nan
    try:
        sess.run(None, feed)
        check("a NaN location raises", False, "no error")
    except Exception as error:  # onnxruntime's own exception types
        check("a NaN location raises", "input 3 (sampling_locations)" in str(error),
              str(error).splitlines()[-1])
    return check.summary()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))

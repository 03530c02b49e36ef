"""pymsda's ONNX Runtime op where users deploy it: a Python with onnxruntime, numpy and the pymsda
wheel but no torch, at both ends of the supported onnxruntime range (1.17 and the newest).
.ci/run makes those environments (fresh venvs: onnxruntime 1.17.3 with numpy 1, onnxruntime
1.32.0, each with the wheel it built) and names their Pythons in PYMSDA_DEPLOY_PYTHONS
(os.pathsep-separated); each runs tests/onnxruntime_deployment.py on the models written here.
Without that variable this test skips (make test has no such venvs)."""
import os
import subprocess

import numpy as np
import pytest

from onnx_node import node_model

pytest.importorskip("onnx", reason="writing the models needs onnx")
PYTHONS = [p for p in os.environ.get("PYMSDA_DEPLOY_PYTHONS", "").split(os.pathsep) if p]
SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "onnxruntime_deployment.py")


@pytest.mark.skipif(not PYTHONS, reason="PYMSDA_DEPLOY_PYTHONS names no torch-free Python "
                    "(.ci/run makes them)")
@pytest.mark.parametrize("python", PYTHONS)
def test_op_runs_without_torch(tmp_path, python):
    models = {"node": node_model(),
              "points_nearest": node_model(num_points_list=[2, 0, 3, 1], sampling="nearest"),
              "half": node_model(np.float16)}
    for name, model in models.items():
        (tmp_path / f"{name}.onnx").write_bytes(model.SerializeToString())
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYMSDA_LIBRARY")}
    done = subprocess.run([python, SCRIPT, str(tmp_path)], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=300)
    print(done.stdout)
    assert done.returncode == 0 and "FAIL" not in done.stdout, done.stdout + done.stderr

"""The CUDA execution provider's kernel of pymsda's ONNX Runtime op (c/ort_cuda.c), checked on a GPU.

Needs a GPU machine with onnxruntime-gpu, onnx, numpy, torch (for eager pymsda on the GPU) and a
pymsda whose library has CUDA kernels for that GPU (e.g. the wheel of `make wheel CUDA_ARCHS=90`);
run from anywhere:

    python tests/ort_cuda_check.py            # PASS/FAIL lines, then "N passed, N failed"

Without the onnx package on the GPU machine: write the models where onnx is installed, bring the
folder, and read them there:

    python tests/ort_cuda_check.py --write-models DIR     # (no GPU needed) then, on the GPU:
    python tests/ort_cuda_check.py --models DIR

One session per case on providers [CUDAExecutionProvider, CPUExecutionProvider], with ONNX
Runtime's profiler on: each check first asserts the MSDeformAttn node ran on the CUDA provider
(not a fallback to the CPU), then compares its output with the float64 oracle (tests/oracle.py)
and with eager pymsda on the GPU: float32 (two batch and image sizes through one session),
num_points_list with nearest sampling, float16 (and float32 points with a float16 value), the
tables as int32; then a bad shape must raise the op's message. Exit status 1 on any failure."""
import glob
import json
import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import numpy as np  # noqa: E402
import onnxruntime as ort  # noqa: E402
import torch  # noqa: E402

import pymsda  # noqa: E402
from onnx_node import Checks, node_model, oracle_of, random_inputs, rel_l2  # noqa: E402

SHAPES, OTHER = [(5, 7), (3, 4), (1, 1), (2, 6)], [(40, 60), (20, 30), (10, 15), (5, 8)]
COUNTS = [2, 0, 3, 1]
check = Checks()


MODELS = {"node": {}, "int32": {"index_type": np.int32},
          "points_nearest": {"num_points_list": COUNTS, "sampling": "nearest"},
          "half": {"value_type": np.float16},
          "half_f32_points": {"value_type": np.float16, "point_type": np.float32}}
model_dir = None  # --models: read the models from there instead of writing them with onnx


class ModelFile:
    """A model read from --models, with the SerializeToString a session is made from."""

    def __init__(self, name):
        with open(os.path.join(model_dir, name + ".onnx"), "rb") as f:
            self.data = f.read()

    def SerializeToString(self):
        return self.data


def model(name):
    return ModelFile(name) if model_dir else node_model(**MODELS[name])


def cuda_session(model, profile_dir):
    options = ort.SessionOptions()
    options.register_custom_ops_library(pymsda.library_path())
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(profile_dir, "msda")
    return ort.InferenceSession(model.SerializeToString(), options,
                                providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


def node_providers(sess):
    """The providers the MSDeformAttn node ran on, from the profile."""
    with open(sess.end_profiling()) as f:
        events = json.load(f)
    return {e["args"].get("provider") for e in events
            if e.get("cat") == "Node" and e["args"].get("op_name") == "MSDeformAttn"}


def eager(feed, counts=None, nearest=False):
    t = {k: torch.from_numpy(v).cuda() for k, v in feed.items()}
    out = pymsda.ms_deform_attn(t["value"], t["spatial_shapes"], t["level_start_index"],
                                t["sampling_locations"], t["attention_weights"],
                                num_points_list=counts,
                                sampling="nearest" if nearest else "bilinear")
    return out.cpu().numpy()


def run_case(name, model, feeds, profile_dir, counts=None, nearest=False, half=False):
    sess = cuda_session(model, profile_dir)
    outs = [sess.run(None, feed)[0] for feed in feeds]
    providers = node_providers(sess)
    check(f"{name}: the node ran on CUDAExecutionProvider", providers == {"CUDAExecutionProvider"},
          f"providers {sorted(p or '?' for p in providers)}")
    for feed, out in zip(feeds, outs):
        size = f"B={feed['value'].shape[0]} Q={feed['sampling_locations'].shape[1]} " \
               f"S={feed['value'].shape[1]}"
        truth, reference = oracle_of(feed, counts, nearest), eager(feed, counts, nearest)
        error, against_eager = rel_l2(out, truth), rel_l2(out, reference)
        if half:
            bound = 2 * rel_l2(reference, truth) + 1e-4
            check(f"{name} {size}: against the oracle", error <= bound,
                  f"rel-L2 {error:.1e} (eager's x2 + 1e-4: {bound:.1e})")
            check(f"{name} {size}: against eager pymsda", against_eager < 1e-3,
                  f"rel-L2 {against_eager:.1e}")
        else:
            check(f"{name} {size}: against the oracle", error < 1e-6, f"rel-L2 {error:.1e}")
            check(f"{name} {size}: against eager pymsda", against_eager < 1e-6,
                  f"rel-L2 {against_eager:.1e}")


def main():
    print(f"onnxruntime {ort.__version__} ({', '.join(ort.get_available_providers())}); torch "
          f"{torch.__version__}; pymsda library {pymsda.library_path()}, CUDA archs "
          f"{' '.join(pymsda.cuda_archs()) or 'none'}")
    preload = getattr(ort, "preload_dlls", None)  # onnxruntime >= 1.21: CUDA, cuDNN from pip
    if preload is not None:
        preload()
    ready = ("CUDAExecutionProvider" in ort.get_available_providers() and pymsda.has_cuda())
    check("onnxruntime has the CUDA provider and pymsda's library CUDA kernels", ready)
    if not ready:
        return check.summary()
    print(f"GPU: {torch.cuda.get_device_name(0)}")
    rng = np.random.default_rng(0)
    with tempfile.TemporaryDirectory() as profiles:
        run_case("float32", model("node"),
                 [random_inputs(rng, 2, 300, SHAPES, heads=8, channels=32, points=4),
                  random_inputs(rng, 3, 900, OTHER, heads=8, channels=32, points=4)], profiles)
        run_case("float32 int32 tables", model("int32"),
                 [random_inputs(rng, 2, 50, SHAPES, index_type=np.int32)], profiles)
        run_case("num_points_list, nearest", model("points_nearest"),
                 [random_inputs(rng, 2, 40, SHAPES, counts=COUNTS)], profiles, COUNTS, True)
        run_case("float16", model("half"),
                 [random_inputs(rng, 2, 300, SHAPES, heads=8, channels=32, points=4,
                                value_type=np.float16),
                  random_inputs(rng, 1, 500, OTHER, heads=8, channels=32, points=4,
                                value_type=np.float16)], profiles, half=True)
        run_case("float16 value, float32 points", model("half_f32_points"),
                 [random_inputs(rng, 2, 300, SHAPES, heads=8, channels=32, points=4,
                                value_type=np.float16, point_type=np.float32)],
                 profiles, half=True)
        sess = cuda_session(model("node"), profiles)
        feed = random_inputs(rng, 2, 9, SHAPES)
        feed["attention_weights"] = feed["attention_weights"][..., :2]
        try:
            sess.run(None, feed)
            check("a bad shape raises the op's message", False, "no error")
        except Exception as error:  # onnxruntime's own exception types
            check("a bad shape raises the op's message",
                  "input 4 (attention_weights)" in str(error), str(error).splitlines()[-1])
        for leftover in glob.glob(os.path.join(profiles, "*")):
            os.remove(leftover)
    return check.summary()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--write-models"]:
        os.makedirs(sys.argv[2], exist_ok=True)
        for name, options in MODELS.items():
            with open(os.path.join(sys.argv[2], name + ".onnx"), "wb") as f:
                f.write(node_model(**options).SerializeToString())
        print(f"wrote {len(MODELS)} models to {sys.argv[2]}")
        sys.exit(0)
    if sys.argv[1:2] == ["--models"]:
        model_dir = sys.argv[2]
    sys.exit(main())

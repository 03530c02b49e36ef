"""ONNX Runtime time of the exported graphs, on the CPU shapes of pymsda/bench/shapes.json:
pymsda's ONNX Runtime op (one pymsda::MSDeformAttn node, onnx_options(onnxruntime=True)), pymsda's
decomposition (both forms) and the graph torch.onnx.export writes for the pure-PyTorch reference
(pymsda.reference), beside eager pymsda on the same threads; then, with --models, whole HF
transformers RT-DETR and Deformable DETR models (random weights, ResNet-50 configs, one image)
exported with the node against the default export (transformers' own MSDA code). Interleaved
runs, medians and 10th-90th percentiles. With --apart, the node and eager pymsda instead, each
in a process of its own (no ONNX Runtime worker spinning beside eager's OpenMP team, no torch in
the node's process), the processes alternated --rounds times, each timing --calls calls.

    python tests/bench_export.py [--reps 20] [--threads 2] [--opset 17] [--models]
    python tests/bench_export.py --apart [--threads 2] [--rounds 3] [--calls 200]
"""
import argparse
import io
import json
import os
import platform
import subprocess
import time
import warnings

import numpy as np
import onnxruntime as ort
import torch

import pymsda
from pymsda.reference import ms_deform_attn_pytorch

FORMS = ["reference", "grid_sample", "gather", "node"]


class Graph(torch.nn.Module):
    def __init__(self, levels, form):
        super().__init__()
        self.levels, self.form = levels, form

    def forward(self, value, sampling_locations, attention_weights):
        if self.form == "reference":
            return ms_deform_attn_pytorch(value, self.levels, sampling_locations,
                                          attention_weights)
        options = ({"onnxruntime": True} if self.form == "node" else {"method": self.form})
        with pymsda.export.onnx_options(**options):
            return pymsda.ms_deform_attn(value, self.levels, None, sampling_locations,
                                         attention_weights)


def session(model_bytes, threads):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.register_custom_ops_library(pymsda.library_path())
    return ort.InferenceSession(model_bytes, options, providers=["CPUExecutionProvider"])


def exported(module, args, opset, names, dynamo=False, axes=None):
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            torch.onnx.export(module, args, f, dynamo=True, input_names=names)
        else:
            torch.onnx.export(module, args, f, dynamo=False, opset_version=opset,
                              input_names=names, dynamic_axes=axes)
    return f.getvalue()


def stats(times):
    t = np.array(times)
    return np.median(t), np.percentile(t, 10), np.percentile(t, 90)


def interleaved(runs, reps):
    """{name: [ms]} of reps rounds, each running every callable once (reversed every other
    round, so drift falls on all alike)."""
    times = {name: [] for name in runs}
    order = list(runs)
    for rep in range(reps):
        for name in (order if rep % 2 == 0 else order[::-1]):
            start = time.perf_counter()
            runs[name]()
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def operator_table(args):
    with open(os.path.join(os.path.dirname(pymsda.__file__), "bench", "shapes.json")) as f:
        shapes = json.load(f)["cpu"]
    print("| shape | reference graph (GridSample) | `method=\"grid_sample\"` | default (`Gather`) "
          "| pymsda node | node alone | eager pymsda | node vs `Gather` |")
    print("|---|---|---|---|---|---|---|---|")
    for name, shape in shapes.items():
        levels = [tuple(level) for level in shape["levels"]]
        S = sum(h * w for h, w in levels)
        B, H, C, P, Q = shape["B"], shape["H"], shape["C"], shape["P"], shape["Q"] or S
        generator = torch.Generator().manual_seed(0)
        value = torch.randn(B, S, H, C, generator=generator)
        loc = torch.rand(B, Q, H, len(levels), P, 2, generator=generator) * 1.1 - 0.05
        attn = torch.rand(B, Q, H, len(levels), P, generator=generator).softmax(-1)
        expected = pymsda.ms_deform_attn(value, levels, None, loc, attn).numpy()
        feeds = {"value": value.numpy(), "loc": loc.numpy(), "attn": attn.numpy()}
        axes = {"value": [0], "loc": [0, 1], "attn": [0, 1]}
        runs, errors = {}, {}
        for form in FORMS:
            sess = session(exported(Graph(levels, form), (value, loc, attn), args.opset,
                                    ["value", "loc", "attn"], axes=axes), args.threads)
            out = sess.run(None, feeds)[0]  # warm-up, and the error against eager
            errors[form] = np.linalg.norm(out - expected) / np.linalg.norm(expected)
            runs[form] = (lambda s: lambda: s.run(None, feeds))(sess)
        times = interleaved(runs, args.reps)
        # the node alone (no other session's workers spinning beside it), then eager pymsda
        # alone: interleaved with sessions, its OpenMP team would share the cores with ONNX
        # Runtime's workers, which spin for a while after each run
        node = runs["node"]
        del runs, sess
        time.sleep(0.5)
        times["node alone"] = interleaved({"node": node}, args.reps)["node"]
        del node
        time.sleep(0.5)
        eager = lambda: pymsda.ms_deform_attn(value, levels, None, loc, attn)  # noqa: E731
        eager()
        times.update(interleaved({"eager": eager}, args.reps))
        cells = []
        for form in FORMS + ["node alone", "eager"]:
            median, low, high = stats(times[form])
            error = f", err {errors[form]:.0e}" if form in errors else ""
            cells.append(f"{median:.2f} ms [{low:.2f}-{high:.2f}{error}]")
        ratio = stats(times["gather"])[0] / stats(times["node"])[0]
        print(f"| {name} (B={B}, Q={Q}, S={S}) | " + " | ".join(cells) + f" | {ratio:.1f}x |",
              flush=True)


def model_table(args):
    """Whole models at one image: transformers' default export against the node."""
    import transformers
    from pymsda.compat import transformers as compat
    stages = dict(out_features=["stage2", "stage3", "stage4"])
    builds = {
        "RT-DETR (ResNet-50)": lambda: transformers.RTDetrForObjectDetection(
            transformers.RTDetrConfig(backbone_config=transformers.RTDetrResNetConfig(**stages),
                                      use_pretrained_backbone=False)),
        "Deformable DETR (ResNet-50)": lambda: transformers.DeformableDetrForObjectDetection(
            transformers.DeformableDetrConfig(backbone_config=transformers.ResNetConfig(**stages),
                                              use_pretrained_backbone=False,
                                              use_timm_backbone=False)),
    }
    print(f"\n| model, image {args.image} | default export | with the pymsda node | speed-up |"
          " max abs diff (logits) |")
    print("|---|---|---|---|---|")
    height, width = (int(v) for v in args.image.split("x"))
    for name, build in builds.items():
        torch.manual_seed(0)
        model = build().eval()
        compat.replace_kernel_layers(model)
        pixels = torch.randn(1, 3, height, width)

        class Logits(torch.nn.Module):
            def forward(self, x):
                out = model(pixel_values=x)
                return out.logits, out.pred_boxes
        sessions = {}
        for variant in ("default", "node"):
            with pymsda.export.onnx_options(onnxruntime=variant == "node"), torch.no_grad():
                sessions[variant] = session(exported(Logits(), (pixels,), args.opset, ["x"],
                                                     dynamo=True), args.threads)
        feeds = {"x": pixels.numpy()}
        outs = {v: s.run(None, feeds)[0] for v, s in sessions.items()}
        times = interleaved({v: (lambda s: lambda: s.run(None, feeds))(s)
                             for v, s in sessions.items()}, max(3, args.reps // 4))
        default, node = stats(times["default"]), stats(times["node"])
        print(f"| {name} | {default[0]:.0f} ms [{default[1]:.0f}-{default[2]:.0f}] | "
              f"{node[0]:.0f} ms [{node[1]:.0f}-{node[2]:.0f}] | {default[0] / node[0]:.2f}x | "
              f"{np.abs(outs['default'] - outs['node']).max():.1e} |", flush=True)


def cpu_shape(name):
    """(levels, value, sampling_locations, attention_weights) of a CPU bench shape, float32
    numpy arrays: locations uniform in [-0.05, 1.05], weights summing to 1 over each query and
    head's points."""
    with open(os.path.join(os.path.dirname(pymsda.__file__), "bench", "shapes.json")) as f:
        shape = json.load(f)["cpu"][name]
    levels = [tuple(level) for level in shape["levels"]]
    S = sum(h * w for h, w in levels)
    B, H, C, P, Q = shape["B"], shape["H"], shape["C"], shape["P"], shape["Q"] or S
    rng = np.random.default_rng(0)
    value = rng.standard_normal((B, S, H, C), dtype=np.float32)
    loc = rng.random((B, Q, H, len(levels), P, 2), dtype=np.float32) * 1.1 - 0.05
    attn = rng.random((B, Q, H, len(levels), P), dtype=np.float32)
    return levels, value, loc.astype(np.float32), attn / attn.sum(-1, keepdims=True)


def child(kind, name, threads, calls):
    """Median ms of `calls` calls of the node (kind "node") or eager pymsda ("eager"), printed."""
    levels, value, loc, attn = cpu_shape(name)
    if kind == "node":
        from onnx_node import node_model
        shapes = np.array(levels, dtype=np.int64)
        starts = np.concatenate([[0], np.cumsum(shapes.prod(1))[:-1]]).astype(np.int64)
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.register_custom_ops_library(pymsda.library_path())
        sess = ort.InferenceSession(node_model().SerializeToString(), options,
                                    providers=["CPUExecutionProvider"])
        feed = dict(zip([i.name for i in sess.get_inputs()], [value, shapes, starts, loc, attn]))
        run = lambda: sess.run(None, feed)  # noqa: E731
    else:
        torch.set_num_threads(threads)
        v, l, a = (torch.from_numpy(x) for x in (value, loc, attn))
        run = lambda: pymsda.ms_deform_attn(v, levels, None, l, a)  # noqa: E731
    for _ in range(20):
        run()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    print(json.dumps(float(np.median(times))))


def apart_table(args):
    import sys
    print("| shape | threads | pymsda node (each round's median) | eager pymsda (each round's median) "
          "| node - eager |")
    print("|---|---|---|---|---|")
    for name in ("dec300", "ddetr_dec"):
        for threads in (args.threads, 1):
            times = {"node": [], "eager": []}
            for rep in range(args.rounds):
                for kind in (("node", "eager") if rep % 2 == 0 else ("eager", "node")):
                    out = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                                          kind, name, str(threads), str(args.calls)],
                                         capture_output=True, text=True, check=True).stdout
                    times[kind].append(json.loads(out.splitlines()[-1]))
            node, eager = (np.median(times[k]) for k in ("node", "eager"))
            cells = [" / ".join(f"{t:.3f}" for t in times[k]) + " ms" for k in ("node", "eager")]
            print(f"| {name} | {threads} | {cells[0]} | {cells[1]} | {(node - eager) * 1e3:+.0f} us |",
                  flush=True)


def main():
    import sys
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        return child(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--opset", type=int, default=17)
    parser.add_argument("--models", action="store_true", help="also the whole-model table")
    parser.add_argument("--image", default="320x320", help="--models' image, HxW")
    parser.add_argument("--apart", action="store_true",
                        help="only the node against eager pymsda, each in a process of its own")
    parser.add_argument("--rounds", type=int, default=3, help="--apart's processes of each")
    parser.add_argument("--calls", type=int, default=200, help="--apart's calls a process")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)  # eager pymsda on the threads the sessions get
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
    print(f"{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
          f"{os.cpu_count()} CPUs; onnxruntime {ort.__version__}, torch {torch.__version__}, "
          f"commit {commit.strip()}; {args.threads} threads, opset {args.opset}, {args.reps} "
          "interleaved runs; median [p10-p90], err: rel-L2 against eager pymsda")
    if args.apart:
        return apart_table(args)
    operator_table(args)
    if args.models:
        model_table(args)


if __name__ == "__main__":
    main()

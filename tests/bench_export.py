"""ONNX Runtime time of the exported graphs: pymsda's decomposition (both forms) against the
graph torch.onnx.export writes for the pure-PyTorch reference (pymsda.reference), on the CPU
shapes of pymsda/bench/shapes.json. Interleaved runs, medians and 10th-90th percentiles.

    python tests/bench_export.py [--reps 20] [--threads 2] [--opset 17]
"""
import argparse
import io
import json
import os
import time
import warnings

import numpy as np
import onnxruntime as ort
import torch

import pymsda
from pymsda.reference import ms_deform_attn_pytorch


class Graph(torch.nn.Module):
    def __init__(self, levels, form):
        super().__init__()
        self.levels, self.form = levels, form

    def forward(self, value, sampling_locations, attention_weights):
        if self.form == "reference":
            return ms_deform_attn_pytorch(value, self.levels, sampling_locations,
                                          attention_weights)
        with pymsda.export.onnx_options(method=self.form):
            return pymsda.ms_deform_attn(value, self.levels, None, sampling_locations,
                                         attention_weights)


def session(module, args, opset, threads):
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, f, dynamo=False, opset_version=opset,
                          input_names=["value", "loc", "attn"],
                          dynamic_axes={"value": [0], "loc": [0, 1], "attn": [0, 1]})
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    return ort.InferenceSession(f.getvalue(), options, providers=["CPUExecutionProvider"])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--opset", type=int, default=17)
    args = parser.parse_args()
    with open(os.path.join(os.path.dirname(pymsda.__file__), "bench", "shapes.json")) as f:
        shapes = json.load(f)["cpu"]
    forms = ["reference", "grid_sample", "gather"]
    print(f"onnxruntime {ort.__version__}, torch {torch.__version__}, {args.threads} threads, "
          f"opset {args.opset}, {args.reps} interleaved runs; ms median [p10-p90]")
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
        sessions = {form: session(Graph(levels, form), (value, loc, attn), args.opset,
                                  args.threads) for form in forms}
        times = {form: [] for form in forms}
        for form in forms:  # warm-up, and the error against eager
            out = sessions[form].run(None, feeds)[0]
            error = np.linalg.norm(out - expected) / np.linalg.norm(expected)
            times[form + " error"] = error
        for _ in range(args.reps):
            for form in forms:
                start = time.perf_counter()
                sessions[form].run(None, feeds)
                times[form].append((time.perf_counter() - start) * 1e3)
        row = []
        for form in forms:
            t = np.array(times[form])
            row.append(f"{form} {np.median(t):7.2f} [{np.percentile(t, 10):.2f}-"
                       f"{np.percentile(t, 90):.2f}] (err {times[form + ' error']:.1e})")
        print(f"{name:10s} B={B} Q={Q} S={S}: " + "  ".join(row), flush=True)


if __name__ == "__main__":
    main()

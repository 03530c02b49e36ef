"""python -m pymsda bench: times pymsda against the pure-PyTorch reference and reports both errors.
(`python -m pymsda bench --models`: a training step of whole models, pymsda/bench_models.py.)

What is measured, per named shape (bench_shapes.json, the "gpu" or "cpu" group), dtype and pass:
  fwd     forward only, under torch.no_grad()
  bwd     backward only: the forward runs outside the timed region with requires_grad inputs,
          then torch.autograd.grad(out, (value, loc, attn), grad_out, retain_graph=True) is timed
          (retain_graph, so the same graph can be differentiated again)
  fwdbwd  forward and that backward together
The reference (pymsda.reference.ms_deform_attn_pytorch, grid_sample) is timed the same way; its
backward is autograd through grid_sample. If it fails (out of memory, a dtype it lacks) the row
says "n/a" with the reason and the run goes on.

How: `--sets` input sets are drawn per shape and dtype (seeded, on the device; drawn in f32, or
f64 for f64, then cast) and calls rotate among them so that no set stays cached. After warm-up
calls, every call is timed on its own: CUDA event pairs on the GPU, time.perf_counter on the CPU.
On the GPU a sleep kernel holds the device while the host queues all timed calls, so the events
measure the GPU's time per call rather than the host's launch overhead (--overhead measures that).
A time is the median over reps * sets calls; the table gives the 10th and 90th percentiles beside
it (the spread of the calls). On the CPU every row of the run is timed together, interleaved:
each round runs every shape, dtype, pass and implementation in turn (a fast one repeated to
about 20 ms), for reps rounds and at least 60 s, so that each median spans the whole run and
not one second of a shared machine's drift.

Inputs follow bench_shapes.json "locations". realistic: reference points at each query's own pixel
centre for an encoder (Q = S, queries in value order), uniform in [0.05, 0.95]^2 for a decoder;
offsets in pixels along the head's direction times (p + 1), as Deformable DETR initialises them,
plus N(0, 1) noise; weights a softmax over L*P of N(0, 1). uniform: locations uniform in
[-0.05, 1.05], weights uniform then normalised.

Precision, beside the times: relative L2 error ||out - ref64|| / ||ref64|| of pymsda's forward
against the reference run in float64 on the same (rounded) inputs, the same for its three
gradients, and the reference's own errors (forward and gradients) in the benchmarked dtype.

--overhead adds the host cost of one eager call on a tiny shape (microseconds per call, plain and
requires_grad inputs, level shapes as a list and as device tensors, no synchronisation inside a
loop, the garbage collector off as in timeit; the median of 5 loops).
"""
import argparse
import functools
import gc
import json
import math
import os
import shlex
import statistics
import sys
import time
import zlib

import torch

from . import has_cuda
from .ops import ms_deform_attn
from . import bench_cpu
from .bench_cpu import failure as _failure
from .bench_report import (ERROR_KEYS, GRAD_KEYS, PASSES, _number, environment,  # noqa: F401
                           format_markdown, format_table, plot, write_json)
from ._torch_private import gpu_sleep
from .reference import ms_deform_attn_pytorch

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16, "f64": torch.float64}
DISTRIBUTIONS = ("realistic", "uniform")
SHAPES_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_shapes.json")


def load_shapes():
    """bench_shapes.json as a dict: groups "gpu" and "cpu" of {name: spec}, and "locations"."""
    with open(SHAPES_FILE, encoding="utf-8") as f:
        return json.load(f)


def default_device():
    return "cuda" if torch.cuda.is_available() and has_cuda() else "cpu"


# ---------------------------------------------------------------------------------------------
# inputs


def head_offsets(heads, levels, points, dtype=torch.float64, device="cpu"):
    """(H, L, P, 2) offsets in pixels, Deformable DETR's initialisation: the direction of angle
    2*pi*h/H scaled so its largest component is 1, times (p + 1)."""
    angle = torch.arange(heads, dtype=dtype, device=device) * (2 * math.pi / heads)
    direction = torch.stack([angle.cos(), angle.sin()], -1)
    direction = direction / direction.abs().amax(-1, keepdim=True)
    steps = torch.arange(1, points + 1, dtype=dtype, device=device)
    return (direction[:, None, None, :] * steps[None, None, :, None]).expand(heads, levels, points, 2)


def pixel_centres(levels, dtype=torch.float64, device="cpu"):
    """(S, 2) normalised (x, y) of every value position's pixel centre, level by level, row-major."""
    centres = []
    for h, w in levels:
        ys = (torch.arange(h, dtype=dtype, device=device) + 0.5) / h
        xs = (torch.arange(w, dtype=dtype, device=device) + 0.5) / w
        grid_y, grid_x = torch.meshgrid(ys, xs, indexing="ij")
        centres.append(torch.stack([grid_x.reshape(-1), grid_y.reshape(-1)], -1))
    return torch.cat(centres)


def make_inputs(spec, dtype=torch.float32, device="cpu", dist="realistic", seed=0, noise=1.0,
                points32=False):
    """One input set for a bench_shapes.json spec: a dict with value (B, S, H, C), spatial_shapes
    (a list of (H_l, W_l)), sampling_locations (B, Q, H, L, P, 2), attention_weights
    (B, Q, H, L, P) and grad_output (B, Q, H*C), all of `dtype` on `device`. `noise` is the
    standard deviation, in pixels, of the realistic offsets' noise. points32 (a half dtype):
    locations and weights stay float32, as under autocast, and value_exact holds the value
    before its rounding to `dtype`."""
    device = torch.device(device)
    levels = [(int(h), int(w)) for h, w in spec["levels"]]
    B, H, C, P, L = spec["B"], spec["H"], spec["C"], spec["P"], len(levels)
    S = sum(h * w for h, w in levels)
    encoder = spec.get("Q") is None
    Q = S if encoder else spec["Q"]
    draw = dict(generator=torch.Generator(device=device).manual_seed(seed), device=device,
                dtype=torch.float64 if dtype == torch.float64 else torch.float32)
    value = torch.randn(B, S, H, C, **draw)
    if dist == "realistic":
        if encoder:
            reference = pixel_centres(levels, draw["dtype"], device).expand(B, Q, 2)
        else:
            reference = 0.05 + 0.9 * torch.rand(B, Q, 2, **draw)
        pixels = head_offsets(H, L, P, draw["dtype"], device) + noise * torch.randn(B, Q, H, L, P, 2, **draw)
        level_sizes = torch.tensor([[w, h] for h, w in levels], dtype=draw["dtype"], device=device)
        locations = reference[:, :, None, None, None, :] + pixels / level_sizes[:, None, :]
        weights = torch.randn(B, Q, H, L * P, **draw).softmax(-1).view(B, Q, H, L, P)
    elif dist == "uniform":
        locations = torch.rand(B, Q, H, L, P, 2, **draw) * 1.1 - 0.05
        weights = torch.rand(B, Q, H, L, P, **draw)
        weights = weights / weights.sum((-2, -1), keepdim=True)
    else:
        raise ValueError(f"dist must be one of {DISTRIBUTIONS}, got {dist!r}")
    grad_output = torch.randn(B, Q, H * C, **draw)
    points = torch.float32 if points32 else dtype
    inputs = dict(value=value.to(dtype), spatial_shapes=levels,
                  sampling_locations=locations.to(points), attention_weights=weights.to(points),
                  grad_output=grad_output.to(dtype))
    if points32:
        inputs["value_exact"] = value
    return inputs


# ---------------------------------------------------------------------------------------------
# timing


def _pymsda(value, spatial_shapes, sampling_locations, attention_weights):
    return ms_deform_attn(value, spatial_shapes, None, sampling_locations, attention_weights)


def _pymsda_deterministic(value, spatial_shapes, sampling_locations, attention_weights):
    return ms_deform_attn(value, spatial_shapes, None, sampling_locations, attention_weights,
                          deterministic=True)


IMPLEMENTATIONS = {"pymsda": _pymsda, "reference": ms_deform_attn_pytorch}


def _forward_no_grad(op, inputs):
    with torch.no_grad():
        return op(inputs["value"], inputs["spatial_shapes"], inputs["sampling_locations"],
                  inputs["attention_weights"])


def _forward_backward(op, shapes, leaves, grad_output):
    out = op(leaves[0], shapes, leaves[1], leaves[2])
    return torch.autograd.grad(out, leaves, grad_output)


def pass_calls(op, input_sets, pass_name):
    """One argument-less callable per input set that runs `pass_name` of `op`. For "bwd" the
    forward graphs are built here, outside whatever times the calls."""
    calls = []
    for inputs in input_sets:
        if pass_name == "fwd":
            calls.append(functools.partial(_forward_no_grad, op, inputs))
            continue
        leaves = [inputs[k].detach().requires_grad_()
                  for k in ("value", "sampling_locations", "attention_weights")]
        shapes, grad_output = inputs["spatial_shapes"], inputs["grad_output"]
        if pass_name == "bwd":
            out = op(leaves[0], shapes, leaves[1], leaves[2])
            calls.append(functools.partial(torch.autograd.grad, out, leaves, grad_output,
                                           retain_graph=True))
        else:
            calls.append(functools.partial(_forward_backward, op, shapes, leaves, grad_output))
    return calls


def median_ms(calls, reps, device, warmup):
    """Median milliseconds of one call, over reps rounds of every call in turn, after warmup calls."""
    return time_ms(calls, reps, device, warmup)[0]


def time_ms(calls, reps, device, warmup):
    """(median, 10th, 90th percentile) milliseconds of one call, over reps rounds of every call in
    turn, after warmup calls. Python's cyclic garbage collector is off while the calls run, as
    timeit has it: a collection that happens to fall into one call would charge that call with
    the whole process's garbage."""
    return time_ms_alternated([calls], reps, device, warmup)[0]


def time_ms_alternated(groups, reps, device, warmup):
    """time_ms of each group of calls (lists of equal length), their calls alternated: the i-th
    call of every group, then the (i+1)-th, ..., so that the groups share the run's drift."""
    calls = [call for same_set in zip(*groups) for call in same_set]
    enabled = gc.isenabled()
    gc.disable()
    try:
        times = _times_ms(calls, reps, device, warmup)
    finally:
        if enabled:
            gc.enable()
    return [bench_cpu.percentiles(times[g::len(groups)]) for g in range(len(groups))]


# If the host falls behind the GPU while queuing the timed calls (the sleep kernel ended too
# soon: a slow or busy host), the GPU idles between calls and, worse, inside a call whose kernels
# are not yet queued, which inflates those calls' times. The idle time between one call's end
# event and the next call's start event shows it; the calls are then timed again behind a sleep
# four times as long.
QUEUE_ATTEMPTS = 3
QUEUE_GAP_MS = 0.05


def queue_ran_dry(gaps_ms):
    """Whether more than a tenth of the gaps between consecutive timed calls (GPU milliseconds
    from one call's end event to the next call's start event) exceed QUEUE_GAP_MS: with the
    calls queued ahead of the GPU they follow each other within a few microseconds."""
    return sum(g > QUEUE_GAP_MS for g in gaps_ms) > len(gaps_ms) // 10


def _times_ms(calls, reps, device, warmup):
    for i in range(warmup):
        calls[i % len(calls)]()
    if device.type == "cuda":
        # Hold the GPU with a sleep kernel while the host queues every timed call, so the events
        # time the GPU's work, not the host's launch overhead (--overhead measures that).
        torch.cuda.synchronize(device)
        host = time.perf_counter()
        calls[0]()
        host = time.perf_counter() - host
        torch.cuda.synchronize(device)
        for attempt in range(QUEUE_ATTEMPTS):
            if gpu_sleep is not None:
                queue_s = min(8.0, 4 ** attempt * min(2.0, 1.5 * host * reps * len(calls) + 1e-3))
                clock_khz = getattr(torch.cuda.get_device_properties(device), "clock_rate", 0)
                clock_hz = 1e3 * clock_khz if clock_khz else 2e9
                gpu_sleep(int(queue_s * clock_hz))
            events = []
            for _ in range(reps):
                for call in calls:
                    start = torch.cuda.Event(enable_timing=True)
                    end = torch.cuda.Event(enable_timing=True)
                    start.record()
                    call()
                    end.record()
                    events.append((start, end))
            torch.cuda.synchronize(device)
            if not queue_ran_dry([a[1].elapsed_time(b[0]) for a, b in zip(events, events[1:])]):
                break
        return [start.elapsed_time(end) for start, end in events]
    # CPU (time_ms's other callers; the bench's CPU rows are timed by bench_cpu.time_rows)
    times = []
    for _ in range(reps):
        for call in calls:
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
    return times


def _free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# precision


def rel_l2(actual, expected):
    return ((actual.double() - expected).norm() / expected.norm().clamp_min(1e-300)).item()


def precision(inputs):
    """The errors of ERROR_KEYS for one input set against the float64 reference: pymsda's
    forward and its three gradients (for grad_output of the set), and, in a dtype other than
    f64, the reference's own forward and gradients in that dtype (None where not measured; a
    dtype grid_sample lacks leaves the reference's None with a note)."""
    dtype, shapes, grad_output = inputs["value"].dtype, inputs["spatial_shapes"], inputs["grad_output"]
    keys = ("value", "sampling_locations", "attention_weights")
    errors = dict.fromkeys(ERROR_KEYS)

    def f64_op(value):
        leaves64 = [value.detach().double().requires_grad_()] + [
            inputs[k].detach().double().requires_grad_() for k in keys[1:]]
        out = ms_deform_attn_pytorch(leaves64[0], shapes, leaves64[1], leaves64[2])
        return out.detach(), torch.autograd.grad(out, leaves64, grad_output.double())

    ref64, ref_grads = f64_op(inputs["value"])
    impls = [("", _pymsda)]
    if dtype != torch.float64:
        impls.append(("reference_", ms_deform_attn_pytorch))
    if "value_exact" in inputs:  # float32 points: errors against the unrounded value, beside
        # the yardstick's (only value rounded, the results rounded to the dtypes they come in)
        yard, yard_grads = ref64.to(dtype), [ref_grads[0].to(dtype)] + [
            g.float() for g in ref_grads[1:]]
        ref64, ref_grads = f64_op(inputs["value_exact"])
        errors["value_rounding_forward"] = rel_l2(yard, ref64)
        for key, grad, ref_grad in zip(GRAD_KEYS, yard_grads, ref_grads):
            errors["value_rounding_" + key] = rel_l2(grad, ref_grad)
        del yard, yard_grads
        # the all-half call's grad_value error at the same inputs (its own points, rounded),
        # which autocast's call's is to match
        half = _all_half(inputs)
        half_leaves = [half[k].detach().requires_grad_() for k in keys]
        half_out = _pymsda(half_leaves[0], shapes, half_leaves[1], half_leaves[2])
        half_grad = torch.autograd.grad(half_out, half_leaves[0], grad_output)[0]
        half64 = [half[k].detach().double().requires_grad_() for k in keys]
        out64 = ms_deform_attn_pytorch(half64[0], shapes, half64[1], half64[2])
        errors["all_half_grad_value"] = rel_l2(
            half_grad, torch.autograd.grad(out64, half64[0], grad_output.double())[0])
        del half, half_leaves, half_out, half_grad, half64, out64
    for prefix, op in impls:
        try:
            leaves = [inputs[k].detach().requires_grad_() for k in keys]
            if prefix:  # grid_sample takes one dtype: the points rounded to value's
                leaves[1:] = [t.detach().to(dtype).requires_grad_() for t in leaves[1:]]
            out = op(leaves[0], shapes, leaves[1], leaves[2])
            errors[prefix + "forward"] = rel_l2(out.detach(), ref64)
            grads = torch.autograd.grad(out, leaves, grad_output)
            del out, leaves
            for key, grad, ref_grad in zip(GRAD_KEYS, grads, ref_grads):
                errors[prefix + key] = rel_l2(grad, ref_grad)
        except Exception as error:  # the reference in a dtype grid_sample lacks here: n/a
            if not prefix:
                raise
            errors["reference_error_note"] = _failure(error)
    return errors


# ---------------------------------------------------------------------------------------------
# the run


def measure_overhead(device, reference=True, calls=2000, warmup=200, rounds=5, collect=False):
    """Host microseconds per eager forward call on a tiny shape (B=Q=H=L=P=1, a 4x4 level, C=4),
    with plain and with requires_grad inputs, the level shapes given as a list and (pymsda
    "tables") as spatial_shapes and level_start_index tensors on the device: the median over
    `rounds` loops of `calls` calls, each loop timed to a synchronisation after its last call
    (on CUDA). As timeit does, the garbage collector is off while a loop runs (collect=True
    leaves it on): a collection then walks every object of the process, torch's included, and
    would bill its pause to whichever call happens to trigger it. "torch_add_us" times one torch op, `value.add(1)` (an
    allocation and a kernel launch), in the same way: the host's own speed, which varies between
    machines and machine starts more than the op's code does."""
    spec = {"B": 1, "levels": [[4, 4]], "Q": 1, "H": 1, "C": 4, "P": 1}
    inputs = make_inputs(spec, torch.float32, device)
    result = {"calls": calls, "rounds": rounds}

    def per_call_us(call):
        for _ in range(warmup):
            call()
        per_call = []
        gc_was_on = gc.isenabled()
        for _ in range(rounds):
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            if not collect:
                gc.disable()
            try:
                start = time.perf_counter()
                for _ in range(calls):
                    call()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                per_call.append((time.perf_counter() - start) / calls * 1e6)
            finally:
                if gc_was_on:
                    gc.enable()
        return statistics.median(per_call)

    # pymsda twice: shapes as a list, and as Deformable DETR passes them (spatial_shapes and
    # level_start_index tensors on the value's device).
    tables = (torch.tensor(inputs["spatial_shapes"], device=device),
              torch.zeros(1, dtype=torch.int64, device=device))
    timed = {"pymsda": lambda v, loc, attn: ms_deform_attn(v, inputs["spatial_shapes"], None,
                                                           loc, attn),
             "pymsda_tables": lambda v, loc, attn: ms_deform_attn(v, *tables, loc, attn)}
    if reference:
        timed["reference"] = lambda v, loc, attn: ms_deform_attn_pytorch(
            v, inputs["spatial_shapes"], loc, attn)
    for impl, op in timed.items():
        for mode in ("plain", "requires_grad"):
            args = [inputs[k].detach().requires_grad_(mode == "requires_grad")
                    for k in ("value", "sampling_locations", "attention_weights")]
            result[f"{impl}_{mode}_us"] = per_call_us(lambda: op(*args))
    value = inputs["value"]
    result["torch_add_us"] = per_call_us(lambda: value.add(1))
    return result


def _all_half(inputs):
    """An input set with float32 points (--points f32) as the all-half call has it: its points
    rounded to value's dtype."""
    dtype = inputs["value"].dtype
    return dict(inputs, sampling_locations=inputs["sampling_locations"].to(dtype),
                attention_weights=inputs["attention_weights"].to(dtype))


def _time_pass(input_sets, pass_name, reps, device, warmup, reference, op=_pymsda):
    """The timing columns of one row; a failing reference gives "n/a" and its reason. Input sets
    with float32 points (--points f32) are timed alternated with the all-half call's (the same
    sets, points rounded to value's dtype): "all_half_ms"."""
    row = {"pass": pass_name, "reference_ms": None, "reference_p10_p90_ms": None,
           "reference_note": None, "speedup": None}
    if "value_exact" in input_sets[0]:
        half_sets = [_all_half(inputs) for inputs in input_sets]
        mine, half = time_ms_alternated([pass_calls(op, input_sets, pass_name),
                                         pass_calls(op, half_sets, pass_name)],
                                        reps, device, warmup)
        del half_sets
        row["pymsda_ms"], *row["pymsda_p10_p90_ms"] = mine
        row["all_half_ms"], *row["all_half_p10_p90_ms"] = half
    else:
        row["pymsda_ms"], *row["pymsda_p10_p90_ms"] = time_ms(
            pass_calls(op, input_sets, pass_name), reps, device, warmup)
    _free(device)
    if not reference:
        row["reference_note"] = "not run"
        return row
    try:
        row["reference_ms"], *row["reference_p10_p90_ms"] = time_ms(
            pass_calls(ms_deform_attn_pytorch, input_sets, pass_name), reps, device, warmup)
        row["speedup"] = row["reference_ms"] / row["pymsda_ms"]
    except Exception as error:  # recorded in the row; the run goes on
        row["reference_note"] = _failure(error)
    _free(device)
    return row


def run(shapes=None, device=None, dtypes=None, dist="realistic", passes=PASSES, reps=None,
        sets=3, reference=True, overhead=False, command=None, progress=True,
        deterministic=False, points32=False, seconds=None):
    """Benchmarks every shape x dtype x pass. shapes: {name: spec} (default: the device's group of
    bench_shapes.json); dtypes: names of DTYPES. Returns {"metadata", "settings", "shapes", "rows",
    "overhead"}; one row per shape, dtype and pass, its "errors" shared by the shape's dtype."""
    device = torch.device(device or default_device())
    cuda = device.type == "cuda"
    shapes = shapes if shapes is not None else load_shapes()["gpu" if cuda else "cpu"]
    dtypes = list(dtypes or (["f32", "bf16", "f16"] if cuda else ["f32"]))
    # CPU: 10 calls warm up (a process's first backward faults its pooled gradient buffers in);
    # then 20 rounds at least, interleaved over the whole run (bench_cpu.time_rows)
    reps = reps or (30 if cuda else 20)
    seconds = bench_cpu.CPU_MIN_SECONDS if seconds is None else seconds
    warmup = max(5, sets) if cuda else max(10, sets)  # every input set at least once
    log = functools.partial(print, flush=True) if progress else (lambda *a, **k: None)
    metadata = environment(device, command)
    settings = dict(device=str(device), dtypes=dtypes, dist=dist, passes=list(passes), reps=reps,
                    sets=sets, warmup=warmup, reference=reference, threads=torch.get_num_threads(),
                    deterministic=deterministic, points32=points32,
                    seconds=None if cuda else seconds)
    for key, text in metadata.items():
        log(f"{key + ':':9s} {text}")
    log("settings: " + " ".join(f"{k}={v}" for k, v in settings.items()))
    time_pass = functools.partial(_time_pass, reps=reps, device=device, warmup=warmup,
                                  reference=reference,
                                  op=_pymsda_deterministic if deterministic else _pymsda)
    rows, cpu_jobs, cpu_timing = [], [], None
    for name, spec in shapes.items():
        for dtype_name in dtypes:
            half = DTYPES[dtype_name] in (torch.float16, torch.bfloat16)
            input_sets = [make_inputs(spec, DTYPES[dtype_name], device, dist,
                                      seed=zlib.crc32(f"{name}/{i}".encode()),
                                      points32=points32 and half)
                          for i in range(sets)]
            try:
                errors = precision(input_sets[0])
            except Exception as error:  # the f64 reference itself out of memory: times still count
                errors = dict(dict.fromkeys(ERROR_KEYS), note=_failure(error))
            _free(device)
            if cuda:
                group = [dict(shape=name, dtype=dtype_name, dist=dist, **time_pass(input_sets, p),
                              errors=errors) for p in passes]
                _free(device)
                _log_group(log, group)
            else:  # timed below, all together
                group = [dict(shape=name, dtype=dtype_name, dist=dist, errors=errors, **{"pass": p})
                         for p in passes]
                cpu_jobs += [(row, input_sets) for row in group]
            del input_sets
            rows += group
    if cpu_jobs:
        log(f"timing {len(cpu_jobs)} rows interleaved, {seconds:g} s at least")
        cpu_timing = bench_cpu.time_rows(
            cpu_jobs, reps, warmup, pass_calls, _pymsda_deterministic if deterministic else _pymsda,
            ms_deform_attn_pytorch if reference else None, seconds)
        del cpu_jobs
        for i in range(0, len(rows), len(passes)):
            _log_group(log, rows[i:i + len(passes)])
        log(bench_cpu.drift_line(cpu_timing))
    return {"metadata": metadata, "settings": settings, "shapes": shapes, "rows": rows,
            "overhead": measure_overhead(device, reference) if overhead else None,
            "cpu_timing": cpu_timing}


def _log_group(log, group):
    """One line for a shape and dtype's rows: each pass's median and speed-up, the errors."""
    errors = group[0]["errors"]
    times = "  ".join(f"{r['pass']} {r['pymsda_ms']:.3f} ms"
                      + (f" (all-half {r['all_half_ms']:.3f})" if r.get("all_half_ms") else "")
                      + (f" ({r['speedup']:.1f}x)" if r["speedup"] else "") for r in group)
    rounding = errors.get("value_rounding_forward")
    half = errors.get("all_half_grad_value")
    log(f"{group[0]['shape']} {group[0]['dtype']}: {times}  | fwd error {_number(errors['forward'])}"
        + (f" (value's rounding alone {_number(rounding)})" if rounding else "")
        + (f", grad_value {_number(errors['grad_value'])} (all-half call {_number(half)})"
           if half else ""))


def checked_device(parser, device):
    """--device's value, or the default; a parser error where cuda cannot run pymsda's kernels."""
    device = device or default_device()
    if device == "cuda" and not (torch.cuda.is_available() and has_cuda()):
        parser.error("--device cuda needs a GPU visible to torch and a libpymsda built with CUDA "
                     "kernels (see python -m pymsda info)")
    return device


def _comma_list(allowed):
    def parse(text):
        items = [item.strip() for item in text.split(",") if item.strip()]
        bad = [item for item in items if item not in allowed]
        if bad or not items:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)}")
        return items
    return parse


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--models" or a.startswith("--models=") for a in argv):  # model-level steps
        from .bench_models import main as models_main
        return models_main(argv)
    parser = argparse.ArgumentParser(prog="python -m pymsda bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when a GPU and the library's CUDA kernels are there")
    parser.add_argument("--shapes", help="NAME[,NAME..] of the device's group (default: all)")
    parser.add_argument("--dtype", type=_comma_list(list(DTYPES)),
                        help="comma list of f32,bf16,f16,f64 (default: f32,bf16,f16 on cuda, f32 on cpu)")
    parser.add_argument("--dist", choices=DISTRIBUTIONS, default="realistic")
    parser.add_argument("--pass", dest="passes", type=_comma_list(PASSES), default=list(PASSES))
    parser.add_argument("--reps", type=int, help="timed calls per input set (30 on cuda); on cpu "
                        "interleaved rounds (20 at least, more until 60 s have passed)")
    parser.add_argument("--sets", type=int, default=3, help="distinct input sets, rotated")
    parser.add_argument("--seconds", type=float, default=None,
                        help=f"cpu: time the interleaved rounds for this long at least (default "
                             f"{bench_cpu.CPU_MIN_SECONDS:g}; longer on a shared machine whose speed drifts)")
    parser.add_argument("--no-reference", action="store_true", help="do not time the reference")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for the CPU")
    parser.add_argument("--overhead", action="store_true", help="also the host cost of one call")
    parser.add_argument("--deterministic", action="store_true",
                        help="time pymsda with deterministic=True (bitwise reproducible backward)")
    parser.add_argument("--points", choices=["same", "f32"], default="same",
                        help="f32: float32 locations and weights with the half dtypes (what "
                             "autocast gives), timed alternated with the all-half call (points "
                             "rounded: the all-half column); errors against the unrounded value, "
                             "beside the error of rounding value alone, and grad_value's beside "
                             "the all-half call's")
    parser.add_argument("--json", metavar="FILE", help="write metadata and rows to FILE")
    parser.add_argument("--plot", metavar="FILE.png", help="bar chart of the speed-ups")
    parser.add_argument("--markdown", metavar="FILE", help="write the table as BENCHMARKS.md has it")
    args = parser.parse_args(argv)

    device = checked_device(parser, args.device)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            parser.error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    for option in ("reps", "sets", "threads"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    if args.seconds is not None and not args.seconds >= 0:
        parser.error("--seconds must be a number of seconds >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    group_name = "gpu" if device == "cuda" else "cpu"
    group = load_shapes()[group_name]
    names = [n.strip() for n in args.shapes.split(",")] if args.shapes else list(group)
    unknown = [n for n in names if n not in group]
    if unknown:
        parser.error(f"unknown shape(s) {', '.join(unknown)}; the {group_name} group has "
                     f"{', '.join(group)}")

    result = run({n: group[n] for n in names}, device, args.dtype, args.dist, args.passes,
                 args.reps, args.sets, reference=not args.no_reference, overhead=args.overhead,
                 deterministic=args.deterministic, points32=args.points == "f32",
                 seconds=args.seconds,
                 command=shlex.join(["python", "-m", "pymsda", "bench"] + argv))
    print()
    print(format_table(result), flush=True)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    if args.plot:
        plot(result, args.plot)
        print(f"wrote {args.plot}")
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(format_markdown(result))
        print(f"wrote {args.markdown}")
    return 0

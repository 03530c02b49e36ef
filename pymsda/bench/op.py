"""python -m pymsda bench: times pymsda against the pure-PyTorch reference and reports both errors.
(`python -m pymsda bench --models`: a training step of whole models, pymsda/bench/models.py.)

What is measured, per named shape (pymsda/bench/shapes.json, the "gpu" or "cpu" group), dtype and pass:
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

Inputs follow shapes.json "locations" (pymsda/bench/inputs.py). realistic: reference points at each query's own pixel
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
import functools
import gc
import statistics
import time
import zlib

import torch

from ..ops import ms_deform_attn
from ..reference import ms_deform_attn_pytorch, rel_l2
from . import timing
from .inputs import load_shapes, make_inputs
from .options import DTYPES, default_device
from .report import ERROR_KEYS, GRAD_KEYS, PASSES, number_text, environment
from .timing import failure as _failure, free as _free, pass_calls, time_ms, time_ms_alternated


def _pymsda(value, spatial_shapes, sampling_locations, attention_weights):
    return ms_deform_attn(value, spatial_shapes, None, sampling_locations, attention_weights)


def _pymsda_deterministic(value, spatial_shapes, sampling_locations, attention_weights):
    return ms_deform_attn(value, spatial_shapes, None, sampling_locations, attention_weights,
                          deterministic=True)



# ---------------------------------------------------------------------------------------------
# precision


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


def _all_half(inputs, copies=False):
    """An input set with float32 points (--points f32) as the all-half call has it: its points
    rounded to value's dtype. copies: value and grad_output copied too, for timing. Sharing them,
    the second call of each alternated pair read what the first had just brought into L2: at the
    decoders whichever call ran second was 5-15% faster, in either order (kernels/TUNING.md,
    "The pair's order")."""
    dtype = inputs["value"].dtype
    half = dict(inputs, sampling_locations=inputs["sampling_locations"].to(dtype),
                attention_weights=inputs["attention_weights"].to(dtype))
    if copies:
        half.update(value=inputs["value"].clone(), grad_output=inputs["grad_output"].clone())
    return half


def _time_pass(input_sets, pass_name, reps, device, warmup, reference, op=_pymsda):
    """The timing columns of one row; a failing reference gives "n/a" and its reason. Input sets
    with float32 points (--points f32) are timed alternated with the all-half call's (the same
    sets, points rounded to value's dtype, value and grad_output its own copies): "all_half_ms"."""
    row = {"pass": pass_name, "reference_ms": None, "reference_p10_p90_ms": None,
           "reference_note": None, "speedup": None}
    if "value_exact" in input_sets[0]:
        half_sets = [_all_half(inputs, copies=True) for inputs in input_sets]
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
    shapes.json); dtypes: names of DTYPES. Returns {"metadata", "settings", "shapes", "rows",
    "overhead"}; one row per shape, dtype and pass, its "errors" shared by the shape's dtype."""
    device = torch.device(device or default_device())
    cuda = device.type == "cuda"
    shapes = shapes if shapes is not None else load_shapes()["gpu" if cuda else "cpu"]
    dtypes = list(dtypes or (["f32", "bf16", "f16"] if cuda else ["f32"]))
    # CPU: 10 calls warm up (a process's first backward faults its pooled gradient buffers in);
    # then 20 rounds at least, interleaved over the whole run (timing.time_rows)
    reps = reps or (30 if cuda else 20)
    seconds = timing.CPU_MIN_SECONDS if seconds is None else seconds
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
        log(f"timing {len(cpu_jobs)} row{'s' * (len(cpu_jobs) != 1)} interleaved: {reps} rounds "
            f"and {seconds:g} s at least, the rows printed when all are done")
        cpu_timing = timing.time_rows(
            cpu_jobs, reps, warmup, pass_calls, _pymsda_deterministic if deterministic else _pymsda,
            ms_deform_attn_pytorch if reference else None, seconds,
            progress=timing.progress_reporter(reps, seconds) if progress else None)
        del cpu_jobs
        for i in range(0, len(rows), len(passes)):
            _log_group(log, rows[i:i + len(passes)])
        log(timing.drift_line(cpu_timing))
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
    log(f"{group[0]['shape']} {group[0]['dtype']}: {times}  | fwd error {number_text(errors['forward'])}"
        + (f" (value's rounding alone {number_text(rounding)})" if rounding else "")
        + (f", grad_value {number_text(errors['grad_value'])} (all-half call {number_text(half)})"
           if half else ""))

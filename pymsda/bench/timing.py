"""How python -m pymsda bench times: on the GPU, every call between CUDA events while a sleep
kernel holds the device until the host has queued them all; on the CPU, every row of a run
together, in interleaved rounds (and what the run says of its machine's drift). Also the
percentiles every table gives and the short reason of a failed measurement."""
import functools
import gc
import math
import statistics
import sys
import time

import torch

from .._torch_private import gpu_sleep


def failure(error):
    """A failed measurement's reason, short enough for a table cell."""
    if isinstance(error, torch.cuda.OutOfMemoryError) or "out of memory" in str(error):
        return "out of memory"
    return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"[:120]



def percentiles(times):
    """(median, 10th, 90th percentile) of a list of times."""
    times = sorted(times)
    n = len(times)
    return statistics.median(times), times[int(0.1 * (n - 1))], times[int(round(0.9 * (n - 1)))]


# The CPU rows of a run are timed together, interleaved: every round runs each (shape, dtype,
# pass, implementation) in turn, the order reversed on odd rounds, for at least `reps` rounds
# and CPU_MIN_SECONDS (--seconds). A shared machine's speed drifts with its neighbours' load (on
# a 2-vCPU guest the op's one-second medians switched between ~3.2 and ~5.5 ms in spells of
# 10-50 s: kernels/TUNING.md, CPU); timed in a block of its own, each row caught whatever the
# machine did in its second, and two runs disagreed by up to 61%. Interleaved, every median
# spans the whole run, and the run reports how far its own two halves lie apart (drift_line).
# Within a round a fast entry repeats its calls to about CPU_ROUND_MS, so its median rests on
# many calls.
CPU_MIN_SECONDS = 60.0
CPU_ROUND_MS = 20.0


def time_rows(jobs, reps, warmup, make_calls, op, reference_op=None, seconds=None,
              progress=None):
    """Fills the timing columns of CPU rows. jobs: (row, input_sets) pairs, row["pass"] set;
    make_calls(op, input_sets, pass) gives a row's argument-less calls (pass_calls);
    reference_op None: the reference is not run. A reference that fails (building its graph,
    warming up or later) gets "n/a" and its reason; the others go on. progress(rounds, seconds,
    done) is called between rounds (progress_reporter). Returns the run's rounds, seconds and
    how far each entry's two halves of rounds lie apart (drift_line)."""
    reference = reference_op is not None
    entries = []  # [row, "pymsda" or "reference", calls]
    for row, input_sets in jobs:
        row.update(reference_ms=None, reference_p10_p90_ms=None, speedup=None,
                   reference_note=None if reference else "not run")
        entries.append([row, "pymsda", make_calls(op, input_sets, row["pass"])])
        if reference:
            try:
                entries.append([row, "reference",
                                make_calls(reference_op, input_sets, row["pass"])])
            except Exception as error:
                row["reference_note"] = failure(error)
    repeat, alive = [], []
    for row, name, calls in entries:  # warm up, then one timed pass sizes the repeats
        try:
            for i in range(warmup):
                calls[i % len(calls)]()
            start = time.perf_counter()
            for call in calls:
                call()
            per_call_ms = (time.perf_counter() - start) * 1e3 / len(calls)
        except Exception as error:
            if name == "pymsda":
                raise
            row["reference_note"] = failure(error)
            per_call_ms = None
        alive.append(per_call_ms is not None)
        round_ms = len(calls) * max(per_call_ms or 0.0, 1e-6)
        repeat.append(min(1000, max(1, int(CPU_ROUND_MS / round_ms))) if alive[-1] else 0)
    times = [[] for _ in entries]
    enabled = gc.isenabled()
    gc.disable()
    try:
        begin, rounds = time.perf_counter(), 0
        seconds = CPU_MIN_SECONDS if seconds is None else seconds
        while rounds < reps or (time.perf_counter() - begin < seconds and rounds < 10 * reps):
            order = range(len(entries)) if rounds % 2 == 0 else range(len(entries) - 1, -1, -1)
            for k in order:
                if not alive[k]:
                    continue
                try:
                    for _ in range(repeat[k]):
                        for call in entries[k][2]:
                            start = time.perf_counter()
                            call()
                            times[k].append((rounds, (time.perf_counter() - start) * 1e3))
                except Exception as error:
                    if entries[k][1] == "pymsda":
                        raise
                    entries[k][0]["reference_note"] = failure(error)
                    alive[k] = False
            rounds += 1
            if progress is not None:  # between rounds: outside every timed call
                progress(rounds, time.perf_counter() - begin, False)
        elapsed = time.perf_counter() - begin
        if progress is not None:
            progress(rounds, elapsed, True)
    finally:
        if enabled:
            gc.enable()
    halves = {}  # how far each entry's medians of the first and the second half of rounds lie apart
    for (row, name, _), ts, ok in zip(entries, times, alive):
        if ok:
            row[name + "_ms"], *row[name + "_p10_p90_ms"] = percentiles([t for _, t in ts])
            first = [t for r, t in ts if 2 * r < rounds]
            second = [t for r, t in ts if 2 * r >= rounds]
            if first and second:
                a, b = statistics.median(first), statistics.median(second)
                label = " ".join(str(row.get(key)) for key in ("shape", "dtype", "pass"))
                halves[f"{label} {name}"] = max(a, b) / min(a, b) - 1 if min(a, b) > 0 else 0.0
    for row, _ in jobs:
        if row["reference_ms"] is not None and row["pymsda_ms"] > 0:
            row["speedup"] = row["reference_ms"] / row["pymsda_ms"]
        elif row["reference_note"] is None:
            row["reference_note"] = "failed"
    return {"rounds": rounds, "seconds": elapsed, "halves_apart": halves}


PROGRESS_EVERY_S = 10.0


def progress_reporter(reps, seconds, stream=None):
    """A progress(rounds, elapsed, done) for time_rows: on a terminal, a bar redrawn in place
    after every round; elsewhere (a log, a pipe) a line every PROGRESS_EVERY_S. The run stops
    after `reps` rounds once `seconds` have passed (or after 10 * reps rounds), so the rounds to
    come are estimated from the time per round so far."""
    stream = stream or sys.stdout
    terminal = stream.isatty()
    shown = [0.0]

    def progress(rounds, elapsed, done):
        per_round = elapsed / rounds
        planned = reps if per_round <= 0 else max(reps, min(10 * reps, math.ceil(seconds / per_round)))
        planned = rounds if done else max(planned, rounds + 1)
        text = (f"round {rounds} of {'' if done else 'about '}{planned}, {elapsed:.0f} s"
                + ("" if done else f", about {(planned - rounds) * per_round:.0f} s left"))
        if terminal:
            filled = 30 * rounds // planned
            stream.write(f"\r  timing [{'#' * filled}{'.' * (30 - filled)}] {text}\033[K"
                         + ("\n" if done else ""))
            stream.flush()
        elif not done and elapsed - shown[0] >= PROGRESS_EVERY_S:
            shown[0] = elapsed
            print(f"  timing: {text}", file=stream, flush=True)
    return progress


def drift_line(timing):
    """What the CPU run says of its own machine: how far the medians of its first and second
    half of rounds lie apart (the largest over the rows). A shared machine's speed drifts over
    tens of seconds with its neighbours' load; another run's medians may differ by as much."""
    halves = timing["halves_apart"]
    if not halves:
        return f"{timing['rounds']} rounds in {timing['seconds']:.0f} s"
    worst = max(halves, key=halves.get)
    return (f"{timing['rounds']} rounds in {timing['seconds']:.0f} s; the medians of the first and "
            f"second half of the rounds differ by up to {100 * halves[worst]:.0f}% ({worst}): "
            f"{'the machine held steady' if halves[worst] <= 0.1 else 'the machine drifted, and another run may differ by as much'}")


# ---------------------------------------------------------------------------------------------
# the GPU, and the calls of a pass


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


def time_ms(calls, reps, device, warmup):
    """(median, 10th, 90th percentile) milliseconds of one call, over reps rounds of every call in
    turn, after warmup calls. Python's cyclic garbage collector is off while the calls run, as
    timeit has it: a collection that happens to fall into one call would charge that call with
    the whole process's garbage."""
    return time_ms_alternated([calls], reps, device, warmup)[0]


def time_ms_alternated(groups, reps, device, warmup):
    """time_ms of each group of calls (lists of equal length), their calls alternated: the i-th
    call of every group, then the (i+1)-th, ..., so that the groups share the run's drift. The
    groups' order is reversed on every other round (reps rounded up to even), so each group runs
    first as often as last: a call that follows another on the GPU can find that call's data in
    L2, or its memory freshly reused."""
    n = len(groups)
    forward = [(g, call) for same_set in zip(*groups) for g, call in enumerate(same_set)]
    backward = [(g, call) for same_set in zip(*groups)
                for g, call in reversed(list(enumerate(same_set)))]
    rounds = forward + backward if n > 1 else forward
    enabled = gc.isenabled()
    gc.disable()
    try:
        times = _times_ms([call for _, call in rounds], -(-reps // 2) if n > 1 else reps,
                          device, max(warmup, len(forward)))  # every call at least once
    finally:
        if enabled:
            gc.enable()
    owner = [g for g, _ in rounds]
    return [percentiles([t for k, t in enumerate(times) if owner[k % len(owner)] == g])
            for g in range(n)]


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
    # CPU (time_ms's other callers; the bench's CPU rows are timed by time_rows)
    times = []
    for _ in range(reps):
        for call in calls:
            start = time.perf_counter()
            call()
            times.append((time.perf_counter() - start) * 1e3)
    return times


def free(device):
    if device.type == "cuda":
        torch.cuda.empty_cache()

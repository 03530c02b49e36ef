"""The CPU timing of python -m pymsda bench (pymsda/bench.py): every row of a run timed together,
in interleaved rounds, and what the run says of its machine's drift."""
import gc
import statistics
import time

import torch


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


def time_rows(jobs, reps, warmup, make_calls, op, reference_op=None, seconds=None):
    """Fills the timing columns of CPU rows. jobs: (row, input_sets) pairs, row["pass"] set;
    make_calls(op, input_sets, pass) gives a row's argument-less calls (bench.pass_calls);
    reference_op None: the reference is not run. A reference that fails (building its graph,
    warming up or later) gets "n/a" and its reason; the others go on. Returns the run's
    rounds, seconds and how far each entry's two halves of rounds lie apart (drift_line)."""
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
        elapsed = time.perf_counter() - begin
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

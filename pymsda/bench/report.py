"""python -m pymsda bench: its output (a table, BENCHMARKS.md's markdown, a chart, JSON) and
the environment a table is published with."""
import datetime
import json
import math
import os
import platform
import subprocess
import textwrap

import torch

from .. import _clib, library_path

PASSES = ("fwd", "bwd", "fwdbwd")
ERROR_KEYS = ("forward", "reference_forward", "grad_value", "grad_loc", "grad_attn",
              "reference_grad_value", "reference_grad_loc", "reference_grad_attn")
GRAD_KEYS = ERROR_KEYS[2:5]
TABLE_COLUMNS = 100  # the default table's width at most (--wide: every column)


def _overhead_label(key):
    """"pymsda_plain_us" -> "pymsda plain"; the calibration op by what it runs."""
    if key == "torch_add_us":
        return "torch value.add(1)"
    if key.startswith("pymsda_tables_"):
        return "pymsda " + key[len("pymsda_tables_"):-3] + " (tensor tables)"
    return key[:-3].replace("_", " ", 1)


# ---------------------------------------------------------------------------------------------
# output


def number_text(x, fmt=".1e"):
    return "n/a" if x is None else format(x, fmt)


def _timed(row, who):
    """A row's median time with its 10th-90th percentile spread, when the row has one."""
    spread = row.get(who + "_p10_p90_ms")
    text = f"{row[who + '_ms']:.3f}"
    return text + (f" ({spread[0]:.3f}-{spread[1]:.3f})" if spread else "")


def format_table(result, wide=False):
    """The run as a text table. The default fits 100 columns: each time's median, the speed-up,
    the forward error and the worst of the three gradients' errors, pymsda's and the
    reference's; a reference that failed is "n/a", its reason below the table. wide: every
    time with its p10-p90 spread and every error column (about 190 columns). With --points f32
    the all-half call's time (alternated with pymsda's) is beside pymsda's, and wide adds its
    grad_value error."""
    half = any(row.get("all_half_ms") for row in result["rows"])
    if wide:
        header = ["shape", "dtype", "pass", "pymsda ms (p10-p90)"] + (
            ["all-half ms (p10-p90)"] if half else []) + [
            "reference ms (p10-p90)", "speed-up", "error", "ref error", "grad_value", "grad_loc",
            "grad_attn", "ref grad_value", "ref grad_loc", "ref grad_attn"] + (
            ["all-half grad_value"] if half else [])
    else:
        header = ["shape", "dtype", "pass", "pymsda ms"] + (["all-half ms"] if half else []) + [
            "ref ms", "speed-up", "fwd err", "ref fwd", "grad err", "ref grad"]
    lines, previous, notes = [], None, {}
    for row in result["rows"]:
        errors = row["errors"]
        first = (row["shape"], row["dtype"]) != previous
        previous = (row["shape"], row["dtype"])
        timed = _timed if wide else (lambda row, who: f"{row[who + '_ms']:.3f}")
        if row["reference_ms"] is not None:
            reference = timed(row, "reference")
        elif wide:
            reference = f"n/a ({row['reference_note']})"
        else:
            reference = "n/a"
            notes.setdefault(row["reference_note"], []).append(
                " ".join((row["shape"], row["dtype"], row["pass"])))
        all_half = [timed(row, "all_half") if row.get("all_half_ms") else "n/a"] if half else []
        if wide:
            shown = [number_text(errors[k]) for k in ERROR_KEYS] + (
                [number_text(errors.get("all_half_grad_value"))] if half else [])
        else:
            shown = [number_text(errors["forward"]), number_text(errors["reference_forward"]),
                     number_text(_worst(errors, "")), number_text(_worst(errors, "reference_"))]
        lines.append([row["shape"] if first else "", row["dtype"] if first else "", row["pass"],
                      timed(row, "pymsda"), *all_half, reference,
                      number_text(row["speedup"], ".2f") + ("x" if row["speedup"] else ""),
                      *(shown if first else [""] * len(shown))])
    widths = [max(len(cells[i]) for cells in lines + [header]) for i in range(len(header))]
    text = ["  ".join(cell.rjust(w) if i > 2 else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()
            for cells in [header] + lines]
    if not wide:
        text += ["ref: the pure-PyTorch reference (grid_sample); err: relative L2 error against "
                 "float64;", "grad: the worst of the three gradients' (--wide: each, and every "
                 "time's p10-p90 spread)"]
        text += [textwrap.fill(f"ref n/a ({note}): {', '.join(where)}", TABLE_COLUMNS,
                               subsequent_indent="  ") for note, where in notes.items()]
    overhead = result.get("overhead")
    if overhead:
        text.append(f"\nhost overhead per eager forward call (tiny shape, median of "
                    f"{overhead.get('rounds', 1)} x {overhead['calls']} calls):")
        for key, us in overhead.items():
            if key.endswith("_us"):
                text.append(f"  {_overhead_label(key):26s} {us:8.1f} us")
    return "\n".join(text)


def _worst(errors, prefix):
    """The largest of the three gradients' errors (prefix "reference_": the reference's), None
    where none was measured."""
    measured = [errors.get(prefix + key) for key in GRAD_KEYS]
    measured = [e for e in measured if e is not None]
    if any(math.isnan(e) for e in measured):  # (max() would depend on the order)
        return math.nan
    return max(measured) if measured else None


def format_markdown(result):
    """The result as BENCHMARKS.md takes it: the run's metadata, then one row per shape and
    dtype with the three passes side by side and the errors."""
    meta = result["metadata"]
    lines = [f"- {key}: {meta[key]}" for key in ("date", "device", "driver", "torch", "cuda",
                                                  "commit", "command") if key in meta]
    by_key = {}
    for row in result["rows"]:
        by_key.setdefault((row["shape"], row["dtype"]), {})[row["pass"]] = row
    passes = [p for p in PASSES if any(p in r for r in by_key.values())]
    titles = {"fwd": "forward", "bwd": "backward", "fwdbwd": "fwd+bwd"}
    head = ["shape", "dtype"]
    for p in passes:
        head += [f"{titles[p]} ms", "reference ms", "speed-up"]
    head += ["fwd error", "reference error (same dtype)", "grad errors (value / loc / attn)",
             "reference grad errors"]
    lines += ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (shape, dtype), rows in by_key.items():
        cells = [shape, dtype]
        for p in passes:
            r = rows.get(p)
            if r is None:
                cells += ["", "", ""]
                continue
            ref = number_text(r["reference_ms"], ".3f") if r["reference_ms"] is not None else "n/a"
            cells += [f"{r['pymsda_ms']:.3f}", ref,
                      number_text(r["speedup"], ".1f") + ("x" if r["speedup"] else "")]
        errors = next(iter(rows.values()))["errors"]
        cells += [number_text(errors["forward"]), number_text(errors["reference_forward"]),
                  " / ".join(number_text(errors[k]) for k in GRAD_KEYS),
                  " / ".join(number_text(errors["reference_" + k]) for k in GRAD_KEYS)]
        lines.append("| " + " | ".join(cells) + " |")
    overhead = result.get("overhead")
    if overhead:
        lines += ["", "Host time per eager forward call (tiny shape, median of "
                  f"{overhead.get('rounds', 1)} x {overhead['calls']} calls):", ""]
        for key, us in overhead.items():
            if key.endswith("_us"):
                lines.append(f"- {_overhead_label(key)}: {us:.1f} us")
    return "\n".join(lines) + "\n"


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["shape"], r["dtype"]) for r in result["rows"]))
    passes = list(dict.fromkeys(r["pass"] for r in result["rows"]))
    width = 0.8 / len(passes)
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(groups)), 4.5))
    for k, pass_name in enumerate(passes):
        speedups = [next((r["speedup"] or 0 for r in result["rows"]
                          if (r["shape"], r["dtype"], r["pass"]) == (*g, pass_name)), 0) for g in groups]
        ax.bar([i + (k - (len(passes) - 1) / 2) * width for i in range(len(groups))], speedups,
               width, label=pass_name)
    ax.axhline(1.0, color="gray", linewidth=0.8)
    ax.set_xticks(range(len(groups)), [f"{s}\n{d}" for s, d in groups], fontsize=8)
    ax.set_ylabel("speed-up over the PyTorch reference")
    ax.set_title(f"pymsda on {result['metadata']['device']} ({result['settings']['dist']} inputs)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _json_ready(x):
    """Strict JSON: a non-finite float (the reference's own f16 NaNs) becomes the string "nan"."""
    if isinstance(x, dict):
        return {k: _json_ready(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_json_ready(v) for v in x]
    return str(x) if isinstance(x, float) and not math.isfinite(x) else x


def write_json(result, path):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(_json_ready(result), f, indent=1, allow_nan=False)


def environment(device, command=None):
    """What a benchmark table must be published with."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = f"{_cpu_name()} ({torch.get_num_threads()} threads)"
    built = _clib.lib.msda_cuda_version() if _clib.lib.msda_has_cuda() else 0
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "device": name,
        "driver": _command_output(["nvidia-smi", "--query-gpu=driver_version",
                                   "--format=csv,noheader"]).split("\n")[0] or "n/a",
        "torch": torch.__version__,
        "cuda": f"{torch.version.cuda or 'none'} (torch), "
                f"{f'{built // 1000}.{built % 1000 // 10}' if built else 'none'} (pymsda build)",
        "library": library_path(),
        "commit": _git_commit(),
        "command": command or "n/a",
    }


def _cpu_name():
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or "cpu"


def _command_output(argv, cwd=None):
    try:
        done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return ""
    return done.stdout.strip() if done.returncode == 0 else ""


def _git_commit():
    """The short commit of the checkout this package was imported from, "-dirty" when tracked files
    differ from it; "n/a" for an installed package."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    top = _command_output(["git", "rev-parse", "--show-toplevel"], root)
    if not top or os.path.realpath(top) != os.path.realpath(root):
        return "n/a"
    commit = _command_output(["git", "rev-parse", "--short", "HEAD"], root) or "n/a"
    dirty = _command_output(["git", "status", "--porcelain", "--untracked-files=no"], root)
    return commit + ("-dirty" if dirty else "")

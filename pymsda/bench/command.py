"""python -m pymsda bench: the command line of the operator's bench (op.py); `--models` hands over
to the model bench (models.py)."""
import argparse
import shlex
import sys

import torch

from . import timing
from .inputs import DISTRIBUTIONS, load_shapes
from .op import run
from .options import DTYPES, checked_device, comma_list
from .report import PASSES, format_markdown, format_table, plot, write_json

DESCRIPTION = """\
Times pymsda against the pure-PyTorch reference (grid_sample) on named problem shapes and prints,
for each shape, dtype and pass, the median milliseconds, the speed-up and the relative L2 errors of
both against float64. On the GPU each row is printed as it finishes; on the CPU every row is timed
together, in interleaved rounds for 60 s at least, with progress shown meanwhile. How calls are
timed and inputs drawn: python -m pydoc pymsda.bench.op. A training step of whole models instead:
python -m pymsda bench --models --help."""


def shapes_text():
    """The shapes of shapes.json, one line each, for --help."""
    lines = ["shapes (pymsda/bench/shapes.json; Q=S: an encoder, every value position a query):"]
    groups = load_shapes()
    for group in ("gpu", "cpu"):
        lines.append(f"  {group} (the default on {group.replace('gpu', 'cuda')}):")
        for name, spec in groups[group].items():
            levels = " ".join(f"{h}x{w}" for h, w in spec["levels"])
            queries = f"Q={spec['Q']}" if spec.get("Q") is not None else "Q=S"
            lines.append(f"    {name:14s} B={spec['B']} {queries:6s} H={spec['H']} C={spec['C']} "
                         f"P={spec['P']}  levels {levels}")
    return "\n".join(lines)


def parser():
    cli = argparse.ArgumentParser(prog="python -m pymsda bench", description=DESCRIPTION,
                                  epilog=shapes_text(),
                                  formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--device", choices=["cpu", "cuda"], default=None,
                     help="default: cuda when a GPU and the library's CUDA kernels are there")
    cli.add_argument("--shapes", metavar="NAME[,NAME..]",
                     help="of the device's group, listed below (default: all of it)")
    cli.add_argument("--dtype", type=comma_list(list(DTYPES)), metavar="DTYPE[,DTYPE..]",
                     help="of f32, bf16, f16, f64 (default: f32,bf16,f16 on cuda, f32 on cpu)")
    cli.add_argument("--dist", choices=DISTRIBUTIONS, default="realistic",
                     help="how inputs are drawn: realistic (default) has each query sample "
                          "around its reference point, along its head's direction as Deformable "
                          "DETR initialises the offsets, plus noise; uniform spreads the "
                          "locations over [-0.05, 1.05], the worst case for caches")
    cli.add_argument("--pass", dest="passes", type=comma_list(PASSES), default=list(PASSES),
                     metavar="PASS[,PASS..]",
                     help="of fwd (the forward under no_grad), bwd (the backward alone: its "
                          "forward runs untimed), fwdbwd (both) (default: all three)")
    cli.add_argument("--reps", type=int, help="timed calls per input set (default 30 on cuda); on "
                     "cpu the interleaved rounds (default 20 at least, more until --seconds)")
    cli.add_argument("--sets", type=int, default=3,
                     help="input sets per shape and dtype, rotated between calls so that no set "
                          "stays in cache (default 3)")
    cli.add_argument("--seconds", type=float, default=None,
                     help=f"cpu: time the interleaved rounds for this long at least (default "
                          f"{timing.CPU_MIN_SECONDS:g}; longer on a shared machine whose speed drifts)")
    cli.add_argument("--no-reference", action="store_true", help="do not time the reference")
    cli.add_argument("--threads", type=int, help="torch.set_num_threads for the CPU")
    cli.add_argument("--overhead", action="store_true", help="also the host cost of one call")
    cli.add_argument("--deterministic", action="store_true",
                     help="time pymsda with deterministic=True (bitwise reproducible backward)")
    cli.add_argument("--points", choices=["same", "f32"], default="same",
                     help="f32: float32 locations and weights with the half dtypes (what "
                          "autocast gives), timed alternated with the all-half call (points "
                          "rounded: the all-half column); errors against the unrounded value, "
                          "beside the error of rounding value alone, and grad_value's beside "
                          "the all-half call's (default: same, the points in value's dtype)")
    cli.add_argument("--wide", action="store_true",
                     help="the full table: each time with its p10-p90 spread and every gradient's "
                          "error (about 190 columns; the default table fits 100)")
    cli.add_argument("--json", metavar="FILE", help="write metadata and rows to FILE")
    cli.add_argument("--plot", metavar="FILE.png", help="bar chart of the speed-ups (matplotlib)")
    cli.add_argument("--markdown", metavar="FILE", help="write the table as BENCHMARKS.md has it")
    return cli


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if any(a == "--models" or a.startswith("--models=") for a in argv):  # model-level steps
        from .models import main as models_main
        return models_main(argv)
    cli = parser()
    args = cli.parse_args(argv)

    device = checked_device(cli, args.device)
    if args.plot:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            cli.error("--plot needs matplotlib, which is not installed (pip install matplotlib)")
    for option in ("reps", "sets", "threads"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            cli.error(f"--{option} must be at least 1")
    if args.seconds is not None and not args.seconds >= 0:
        cli.error("--seconds must be a number of seconds >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    group_name = "gpu" if device == "cuda" else "cpu"
    group = load_shapes()[group_name]
    names = [n.strip() for n in args.shapes.split(",")] if args.shapes else list(group)
    unknown = [n for n in names if n not in group]
    if unknown:
        cli.error(f"unknown shape(s) {', '.join(unknown)}; the {group_name} group has "
                  f"{', '.join(group)}")

    result = run({n: group[n] for n in names}, device, args.dtype, args.dist, args.passes,
                 args.reps, args.sets, reference=not args.no_reference, overhead=args.overhead,
                 deterministic=args.deterministic, points32=args.points == "f32",
                 seconds=args.seconds,
                 command=shlex.join(["python", "-m", "pymsda", "bench"] + argv))
    print()
    print(format_table(result, wide=args.wide), flush=True)
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

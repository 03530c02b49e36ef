"""python -m pymsda bench --models: a training step of real detection models, each with its own
MSDA and with pymsda, float32 and bfloat16 autocast.

Models, built from configs with random weights (nothing is downloaded; no timm):
  hf_ddetr            HF transformers DeformableDetrModel, ResNet-50 backbone (transformers'
                      ResNetConfig), 6 + 6 layers, 4 levels, 4 points; GPU size 2 x 800x1066
  hf_rtdetr           HF transformers RTDetrModel, its ResNet-50 backbone config
                      (RTDetrResNetConfig), 6 decoder layers; GPU size 8 x 640x640
  ultralytics_rtdetr  Ultralytics RTDETRDetectionModel("rtdetr-l.yaml"), only where ultralytics
                      imports (otherwise one line says why it is skipped); GPU size 8 x 640x640
--size full (the default on cuda) is those published sizes. --size small (the default on cpu):
1 x 256x320, 2 encoder and 2 decoder layers, so that a run takes a minute or two on two cores.
--size tiny checks the machinery (the tests): 1 x 64x96, one layer, small backbones and widths.
--batch, --image and --layers override the size's.

One step: forward (under torch.autocast(bfloat16) for bf16), a loss, backward and an AdamW step
(zero_grad(set_to_none=True) first). The loss is the mean square of the model's float outputs
(the HF models: the decoder's last_hidden_state, and Deformable DETR's encoder output;
Ultralytics: the boxes and scores of the decoder and of the query selection), so every MSDA
layer and weight gets a gradient without a matcher whose host work would blur the times.

How pymsda is switched, the documented way: HF models are built once, then
pymsda.compat.transformers.replace_kernel_layers(model) swaps in pymsda's kernel layer (it
holds no weights); the replaced layers are kept, and each variant puts its own ones in place.
Ultralytics: pymsda.compat.ultralytics.install() before the pymsda variant, uninstall() after.
One model (and one optimizer) serves all variants of a model, so each variant's peak memory is
that of a process training that one model (weights, gradients and AdamW state included). Calls
into libpymsda (msda_forward and msda_backward) are counted on each variant's first step: a
pymsda variant with none, or an own variant with some, is reported (exit status 1), as is a
variant that fails (out of memory, say; the run goes on without it).

Timing: each variant runs --warmup untimed steps, then --rounds rounds; a round runs --steps
steps of every variant, the variants in order and in reverse order on odd rounds (alternated,
so drift on the machine falls on all of them alike). Each step is timed alone on the host
clock, the GPU synchronised before and after (a training step's time as a user sees it). A
time is the median of rounds * steps steps, beside the 10th and 90th percentiles. Peak memory
(GPU): torch.cuda.max_memory_allocated, reset before each variant's steps, the largest over
the rounds. --time-limit bounds the whole run: each model gets an equal share of the time left
when it starts, and runs as many rounds as fit in it after build and warm-up (at least one).
"""
import argparse
import contextlib
import gc
import shlex
import sys
import time
import warnings

import torch

from .. import _op
from .options import checked_device, comma_list, default_device
from .report import environment, write_json
from .timing import percentiles

MODEL_NAMES = ("hf_ddetr", "hf_rtdetr", "ultralytics_rtdetr")
PATHS = ("own", "pymsda")
DTYPE_NAMES = ("f32", "bf16")
SIZE_NAMES = ("full", "small", "tiny")
# batch, (height, width), layers (None: the config's own). full: the published sizes, for the
# GPU; small: the CPU's default; tiny: a check that the machinery works (the tests), its HF
# models with a small backbone (basic blocks, one per stage), d_model 32 and 20 queries.
SIZES = {
    "full": {"hf_ddetr": (2, (800, 1066), None), "hf_rtdetr": (8, (640, 640), None),
             "ultralytics_rtdetr": (8, (640, 640), None)},
    "small": {"hf_ddetr": (1, (256, 320), 2), "hf_rtdetr": (1, (256, 320), 2),
              "ultralytics_rtdetr": (1, (256, 320), None)},
    "tiny": {"hf_ddetr": (1, (64, 96), 1), "hf_rtdetr": (1, (64, 96), 1),
             "ultralytics_rtdetr": (1, (64, 96), None)},
}
TINY_BACKBONE = dict(embedding_size=16, hidden_sizes=[16, 32, 64, 64], depths=[1, 1, 1, 1],
                     layer_type="basic", out_features=["stage2", "stage3", "stage4"])


# ---------------------------------------------------------------------------------------------
# models: build(layers, tiny) -> (model, loss(model, pixels), switch(path), switched)


class Skip(Exception):
    """A model that cannot be built here; the message says why."""


def _transformers():
    try:
        import transformers
    except Exception as error:
        raise Skip(f"transformers cannot be imported ({type(error).__name__}: {error})")
    return transformers


def _kernel_layer_switch(model):
    """replace_kernel_layers(model), keeping transformers' layers so that either set can be put
    in place: (switch(path), a description of what was switched)."""
    from ..compat import transformers as compat
    own = [(parent, name, child) for parent in list(model.modules())
           for name, child in parent.named_children() if compat._is_kernel_layer(child)]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        replaced = compat.replace_kernel_layers(model)
    ours = [getattr(parent, name) for parent, name, _ in own]

    def switch(path):
        for (parent, name, own_layer), our_layer in zip(own, ours):
            setattr(parent, name, our_layer if path == "pymsda" else own_layer)
    note = "".join(f" ({w.message})" for w in caught)
    return switch, f"replace_kernel_layers: {replaced} kernel layers{note}"


def _square_mean(*tensors):
    return sum(t.float().square().mean() for t in tensors)


def build_hf_ddetr(layers, tiny):
    transformers = _transformers()
    backbone = transformers.ResNetConfig(  # ResNet-50, or TINY_BACKBONE
        **(TINY_BACKBONE if tiny else dict(out_features=["stage2", "stage3", "stage4"])))
    options = dict(encoder_layers=layers, decoder_layers=layers) if layers else {}
    if tiny:
        options.update(d_model=32, encoder_ffn_dim=64, decoder_ffn_dim=64, num_queries=20)
    model = transformers.DeformableDetrModel(
        transformers.DeformableDetrConfig(backbone_config=backbone, **options))

    def loss(model, pixels):
        out = model(pixel_values=pixels)
        return _square_mean(out.last_hidden_state, out.encoder_last_hidden_state)
    return (model, loss) + _kernel_layer_switch(model)


def build_hf_rtdetr(layers, tiny):
    transformers = _transformers()
    # RTDetrConfig's own default backbone spelled out (ResNet-50-vd, three output stages)
    backbone = transformers.RTDetrResNetConfig(
        **(TINY_BACKBONE if tiny else dict(out_features=["stage2", "stage3", "stage4"])))
    options = dict(decoder_layers=layers) if layers else {}
    if tiny:
        options.update(d_model=32, encoder_hidden_dim=32, encoder_in_channels=[32, 64, 64],
                       encoder_ffn_dim=64, decoder_ffn_dim=64, decoder_in_channels=[32, 32, 32],
                       num_queries=20)
    model = transformers.RTDetrModel(transformers.RTDetrConfig(backbone_config=backbone, **options))

    def loss(model, pixels):
        return _square_mean(model(pixel_values=pixels).last_hidden_state)
    return (model, loss) + _kernel_layer_switch(model)


def build_ultralytics_rtdetr(layers, tiny):
    try:
        from ultralytics.nn.tasks import RTDETRDetectionModel
        from ..compat import ultralytics as compat
    except Exception as error:  # not installed, or its torchvision built for another torch
        first_line = (str(error).splitlines() or [""])[0][:160]
        raise Skip(f"ultralytics cannot be imported ({type(error).__name__}: {first_line})")
    model = RTDETRDetectionModel("rtdetr-l.yaml", nc=80, verbose=False)

    def loss(model, pixels):
        dec_boxes, dec_scores, enc_boxes, enc_scores, _ = model.predict(pixels)
        return _square_mean(dec_boxes, dec_scores, enc_boxes, enc_scores)

    def switch(path):
        if path == "pymsda":
            compat.install()
        else:
            compat.uninstall()
    return model, loss, switch, "pymsda.compat.ultralytics.install() / uninstall()"


BUILDERS = {"hf_ddetr": build_hf_ddetr, "hf_rtdetr": build_hf_rtdetr,
            "ultralytics_rtdetr": build_ultralytics_rtdetr}


# ---------------------------------------------------------------------------------------------
# the run


@contextlib.contextmanager
def counting_library_calls():
    """Counts the calls into libpymsda's msda_forward and msda_backward while the block runs."""
    counts = {"forward": 0, "backward": 0}
    originals = _op.c_forward, _op.c_backward

    def counter(entry, key):
        def counted(*args):
            counts[key] += 1
            return entry(*args)
        return counted
    _op.c_forward = counter(originals[0], "forward")
    _op.c_backward = counter(originals[1], "backward")
    try:
        yield counts
    finally:
        _op.c_forward, _op.c_backward = originals


def _synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _free(device):
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def bench_model(name, device, dtypes, batch, image, layers, tiny, rounds, steps, warmup, deadline,
                log):
    """One model's rows (or a skip). Returns a dict: model, size, switched, rounds_run,
    build_s, rows (one per dtype and path) or skipped (the reason)."""
    started = time.perf_counter()
    result = {"model": name, "batch": batch, "image": list(image), "layers": layers, "tiny": tiny}
    torch.manual_seed(0)
    try:
        model, loss_of, switch, switched = BUILDERS[name](layers, tiny)
    except Skip as reason:
        log(f"{name}: skipped: {reason}")
        return dict(result, skipped=str(reason))
    model = model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=1e-4)
    pixels = torch.randn(batch, 3, *image, generator=torch.Generator().manual_seed(1)).to(device)
    result.update(switched=switched, parameters=sum(p.numel() for p in model.parameters()),
                  build_s=time.perf_counter() - started)
    log(f"{name}: {result['parameters'] / 1e6:.1f}M parameters, {batch} x {image[0]}x{image[1]}, "
        f"built in {result['build_s']:.1f} s; pymsda via {switched}")
    variants = [(d, p) for d in dtypes for p in PATHS]

    def step(dtype_name):
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, torch.bfloat16, enabled=dtype_name == "bf16"):
            loss = loss_of(model, pixels)
        loss.backward()
        optimizer.step()

    with counting_library_calls() as counts:
        def run_variant(variant, n, times=None):
            dtype_name, path = variant
            switch(path)
            before = dict(counts)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            for _ in range(n):
                _synchronize(device)
                start = time.perf_counter()
                step(dtype_name)
                _synchronize(device)
                if times is not None:
                    times.append((time.perf_counter() - start) * 1e3)
            peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
            return {k: counts[k] - before[k] for k in counts}, peak

        calls, times, peaks, failed = {}, {v: [] for v in variants}, {v: None for v in variants}, {}

        def attempt(variant, n, record=False):
            """run_variant; a failure (out of memory, an op the model's own path lacks in a
            dtype) is recorded and takes the variant out of the run, which goes on."""
            try:
                per_step, peak = run_variant(variant, n, times[variant] if record else None)
            except Exception as error:
                first_line = (str(error).splitlines() or [""])[0][:200]
                failed[variant] = f"{type(error).__name__}: {first_line}"
                log(f"  {variant[0]} {variant[1]} failed: {failed[variant]}")
                _free(device)
                return None
            if peak is not None and record:
                peaks[variant] = max(peaks[variant] or 0, peak)
            return per_step

        for variant in variants:  # warm-up; the library calls of its first step counted
            calls[variant] = attempt(variant, 1)
            if variant not in failed and warmup > 1:
                attempt(variant, warmup - 1)
        round_started = time.perf_counter()
        rounds_run = 0
        while rounds_run < rounds and len(failed) < len(variants):
            order = variants if rounds_run % 2 == 0 else variants[::-1]
            for variant in order:
                if variant not in failed:
                    attempt(variant, steps, record=True)
            rounds_run += 1
            per_round = (time.perf_counter() - round_started) / rounds_run
            if time.perf_counter() + per_round > deadline:
                break
        switch("own")
    result["rounds_run"] = rounds_run
    result["seconds"] = time.perf_counter() - started
    rows = [_row(dtype_name, path, times[(dtype_name, path)], peaks[(dtype_name, path)],
                 calls[(dtype_name, path)], failed.get((dtype_name, path)))
            for dtype_name, path in variants]
    for row in rows:
        own = next(r for r in rows if r["dtype"] == row["dtype"] and r["path"] == "own")
        if row["path"] == "pymsda" and own["ms"] and row["ms"]:
            row["speedup"] = own["ms"] / row["ms"]
    result["rows"] = rows
    for row in rows:
        dtype_name, path, timed, speedup, peak, calls, note = _cells(row)
        log(f"  {dtype_name:4s} {path:6s} {timed} ms/step" + (f", {speedup}" if speedup else "")
            + (f", peak {peak} GiB" if peak != "n/a" else "")
            + f", library calls/step {calls} (fwd/bwd)" + (f"  {note}" if note else ""))
    return result


def _row(dtype_name, path, ms, peak, calls, error):
    """One variant's result; a variant that failed has error and no times."""
    row = {"dtype": dtype_name, "path": path, "ms": None, "p10_p90_ms": None,
           "steps_timed": len(ms), "peak_bytes": peak, "library_calls_per_step": calls,
           "switch_ok": None, "speedup": None, "error": error}
    if ms:
        row["ms"], *row["p10_p90_ms"] = percentiles(ms)
    if calls is not None:  # its first step ran
        row["switch_ok"] = (calls["forward"] > 0) == (path == "pymsda")
    return row


def _cells(row):
    """dtype, path, ms/step (p10-p90), speed-up, peak GiB, library calls per step, note."""
    timed = "n/a"
    if row["ms"] is not None:
        low, high = row["p10_p90_ms"]
        timed = f"{row['ms']:.1f} ({low:.1f}-{high:.1f})"
    calls = row["library_calls_per_step"]
    note = ""
    if row["error"]:
        note = "FAILED: " + row["error"]
    elif row["switch_ok"] is False:
        note = ("NOT SWITCHED: pymsda's library was never called" if row["path"] == "pymsda"
                else "the own path called pymsda's library")
    return [row["dtype"], row["path"], timed,
            f"{row['speedup']:.2f}x" if row["speedup"] else "",
            f"{row['peak_bytes'] / 2**30:.2f}" if row["peak_bytes"] else "n/a",
            f"{calls['forward']}/{calls['backward']}" if calls else "n/a", note]


def run(names=MODEL_NAMES, device=None, dtypes=None, size=None, rounds=5, steps=None, warmup=2,
        batch=None, image=None, layers=None, time_limit=300.0, command=None, progress=True):
    """Benchmarks the named models at a size of SIZES (default: full on cuda, small on cpu;
    batch, image and layers override it); returns {"metadata", "settings", "models",
    "seconds"}."""
    started = time.perf_counter()
    device = torch.device(device or default_device())
    cuda = device.type == "cuda"
    dtypes = list(dtypes or (["f32", "bf16"] if cuda else ["f32"]))
    size = size or ("full" if cuda else "small")
    steps = steps or (10 if cuda else 3)
    log = (lambda *a: print(*a, flush=True)) if progress else (lambda *a: None)
    metadata = environment(device, command)
    try:
        import transformers
        metadata["transformers"] = transformers.__version__
    except Exception:
        metadata["transformers"] = "n/a"
    settings = dict(device=str(device), dtypes=dtypes, size=size, rounds=rounds, steps=steps,
                    warmup=warmup, time_limit_s=time_limit, threads=torch.get_num_threads())
    for key, text in metadata.items():
        log(f"{key + ':':13s} {text}")
    log("settings: " + " ".join(f"{k}={v}" for k, v in settings.items()))
    models = []
    for index, name in enumerate(names):
        size_batch, size_image, size_layers = SIZES[size][name]
        left = time_limit - (time.perf_counter() - started)
        deadline = time.perf_counter() + left / (len(names) - index)
        models.append(bench_model(name, device, dtypes, batch or size_batch, image or size_image,
                                  layers or size_layers, size == "tiny", rounds, steps, warmup,
                                  deadline, log))
        _free(device)  # the model and its optimizer state, before the next model's build
    return {"metadata": metadata, "settings": settings, "models": models,
            "seconds": time.perf_counter() - started}


def format_table(result):
    header = ["model", "size", "dtype", "path", "ms/step (p10-p90)", "speed-up", "peak GiB",
              "lib calls/step fwd/bwd", "steps timed", ""]
    lines, notes = [], []
    for entry in result["models"]:
        if "skipped" in entry:
            notes.append(f"{entry['model']}: skipped: {entry['skipped']}")
            continue
        size = f"{entry['batch']} x {entry['image'][0]}x{entry['image'][1]}"
        for i, row in enumerate(entry["rows"]):
            *cells, note = _cells(row)
            per_round = row["steps_timed"] // max(1, entry["rounds_run"])
            lines.append([entry["model"] if i == 0 else "", size if i == 0 else ""] + cells
                         + [f"{entry['rounds_run']} x {per_round}", note])
    widths = [max(len(cells[i]) for cells in lines + [header]) for i in range(len(header))]
    text = ["  ".join(cell.ljust(w) if i < 4 or i == len(header) - 1 else cell.rjust(w)
                      for i, (cell, w) in enumerate(zip(cells, widths))).rstrip()
            for cells in [header] + lines]
    return "\n".join(text + notes)


def problems(result):
    """(model, dtype, path, what) for every variant that failed or whose switch check failed."""
    return [(entry["model"], row["dtype"], row["path"], _cells(row)[-1])
            for entry in result["models"] for row in entry.get("rows", []) if _cells(row)[-1]]


def _image(text):
    try:
        height, width = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected HEIGHTxWIDTH, e.g. 640x640")
    return height, width


def main(argv):
    """argv: the arguments after `bench`, --models among them."""
    parser = argparse.ArgumentParser(prog="python -m pymsda bench --models", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="?", const=",".join(MODEL_NAMES),
                        type=comma_list(MODEL_NAMES), metavar="NAME[,NAME..]",
                        help=f"of {', '.join(MODEL_NAMES)} (default: all)")
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="default: cuda when a GPU and the library's CUDA kernels are there")
    parser.add_argument("--dtype", type=comma_list(DTYPE_NAMES),
                        help="f32 and/or bf16 (autocast) (default: f32,bf16 on cuda, f32 on cpu)")
    parser.add_argument("--size", choices=SIZE_NAMES,
                        help="full: the published sizes (default on cuda); small: 1 x 256x320, "
                             "2 + 2 layers (default on cpu); tiny: a check of the machinery")
    parser.add_argument("--rounds", type=int, default=5, help="alternated rounds (default 5)")
    parser.add_argument("--steps", type=int, default=None,
                        help="timed steps per variant and round (default 10 on cuda, 3 on cpu)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant first")
    parser.add_argument("--batch", type=int, help="batch size for every model (default: by device)")
    parser.add_argument("--image", type=_image, help="HEIGHTxWIDTH for every model")
    parser.add_argument("--layers", type=int, help="encoder and decoder layers of the HF models "
                        "(default: the config's 6 on cuda, 2 on cpu; Ultralytics: its yaml's)")
    parser.add_argument("--time-limit", type=float, default=300.0, metavar="SECONDS",
                        help="bound on the whole run: fewer rounds where needed (default 300)")
    parser.add_argument("--threads", type=int, help="torch.set_num_threads for the CPU")
    parser.add_argument("--json", metavar="FILE", help="write metadata and rows to FILE")
    args = parser.parse_args(argv)
    device = checked_device(parser, args.device)
    for option in ("rounds", "steps", "warmup", "batch", "layers", "threads"):
        if getattr(args, option) is not None and getattr(args, option) < 1:
            parser.error(f"--{option} must be at least 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.models or MODEL_NAMES, device, args.dtype, args.size, args.rounds,
                 args.steps, args.warmup, args.batch, args.image, args.layers, args.time_limit,
                 command=shlex.join(["python", "-m", "pymsda", "bench"] + list(argv)))
    print()
    print(format_table(result), flush=True)
    if args.json:
        write_json(result, args.json)
        print(f"wrote {args.json}")
    found = problems(result)
    for model, dtype_name, path, what in found:
        print(f"{model} {dtype_name} {path}: {what}", file=sys.stderr)
    return 1 if found else 0

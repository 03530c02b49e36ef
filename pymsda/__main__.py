"""python -m pymsda: what was loaded and built, then a self-check on every device.

    python -m pymsda          info and self-check (exit status 1 if a check fails)
    python -m pymsda info     info only
    python -m pymsda bench    benchmark against the PyTorch reference (bench --help for options)
"""
import argparse
import platform
import sys

import torch

from . import _lib, cuda_archs, has_cuda, library_path
from .ops import ms_deform_attn
from .reference import ms_deform_attn_pytorch


def _devices():
    devices = [torch.device("cpu")]
    if has_cuda():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return devices


def info():
    lib = _lib.lib
    print(f"pymsda library: {library_path()} (ABI {lib.msda_abi_version()})")
    if lib.msda_has_cuda():
        v = lib.msda_cuda_version()
        print(f"CUDA kernels:   yes, built with CUDA {v // 1000}.{v % 1000 // 10} for "
              f"{' '.join(cuda_archs())}")
    else:
        print("CUDA kernels:   no (CPU-only build)")
    print(f"torch:          {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    print(f"Python:         {platform.python_version()} ({sys.executable})")
    print(f"CPU threads:    {torch.get_num_threads()}")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            sm = f"sm_{p.major}{p.minor}"
            covered = sm in cuda_archs() or any(
                a.startswith("compute_") and int(a[8:]) <= p.major * 10 + p.minor
                for a in cuda_archs())
            note = "" if covered else "  <- NOT covered by the embedded architectures"
            print(f"cuda:{i}:         {p.name}, {sm}, {p.total_memory / 2**30:.0f} GiB{note}")
    else:
        print("GPUs:           none visible to torch")


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm().clamp_min(1e-300)).item()


def check(device):
    """Forward and gradients on random inputs against the float64 reference."""
    g = torch.Generator().manual_seed(0)
    shapes = [(12, 17), (6, 9), (3, 5)]
    B, Q, H, C, L, P = 2, 33, 4, 24, len(shapes), 4
    S = sum(h * w for h, w in shapes)
    value = torch.randn(B, S, H, C, generator=g, dtype=torch.float64)
    loc = torch.rand(B, Q, H, L, P, 2, generator=g, dtype=torch.float64) * 1.1 - 0.05
    attn = torch.rand(B, Q, H, L, P, generator=g, dtype=torch.float64)
    attn = attn / attn.sum((-1, -2), keepdim=True)
    grad = torch.randn(B, Q, H * C, generator=g, dtype=torch.float64)

    inputs = [t.clone().requires_grad_() for t in (value, loc, attn)]
    ref = ms_deform_attn_pytorch(inputs[0], shapes, inputs[1], inputs[2])
    ref_grads = torch.autograd.grad(ref, inputs, grad)

    inputs = [t.to(device, torch.float32).requires_grad_() for t in (value, loc, attn)]
    out = ms_deform_attn(inputs[0], shapes, None, inputs[1], inputs[2])
    grads = torch.autograd.grad(out, inputs, grad.to(device, torch.float32))
    errors = [_rel(out.cpu(), ref)] + [_rel(a.cpu(), b) for a, b in zip(grads, ref_grads)]
    ok = errors[0] < 1e-6 and all(e < 1e-4 for e in errors[1:])
    names = ("forward", "grad_value", "grad_loc", "grad_attn")
    detail = ", ".join(f"{n} {e:.1e}" for n, e in zip(names, errors))
    print(f"self-check {str(device):7s} f32 vs f64 reference: {'PASS' if ok else 'FAIL'} "
          f"(rel. L2 error: {detail})")
    return ok


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["bench"]:  # bench has options of its own
        from .bench import main as bench_main
        return bench_main(argv[1:])
    parser = argparse.ArgumentParser(prog="python -m pymsda", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", nargs="?", default="check", choices=["check", "info", "bench"])
    args = parser.parse_args(argv)
    info()
    if args.command == "info":
        return 0
    results = [check(d) for d in _devices()]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())

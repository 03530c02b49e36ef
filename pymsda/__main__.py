"""python -m pymsda: what was loaded and built, then a self-check on every device.

    python -m pymsda [check]  info (below), then the self-check: on the CPU and on each GPU torch
                              sees, a small problem's forward and its three gradients in float32
                              against the pure-PyTorch reference in float64; PASS within a
                              relative L2 error of 1e-6 (forward) and 1e-4 (gradients). Exit
                              status 1 if a check fails or a GPU has no code the library can run
    python -m pymsda info     which package and library are loaded and why, the CUDA build and
                              its embedded GPU code, the driver, torch, Python, the CPU threads,
                              and for each GPU the code that runs on it (or NOT COVERED and why)
    python -m pymsda bench    time pymsda against the PyTorch reference (bench --help)
    python -m pymsda bench --models   a training step of whole models, their own MSDA vs pymsda
"""
import argparse
import ctypes
import importlib.util
import os
import platform
import re
import sys

from . import _clib, cuda_archs, library_path

# torch, the op and the reference are imported by the commands that use them, not here:
# `python -m pymsda --help` needs none of them.


def _devices():
    import torch

    from . import has_cuda
    devices = [torch.device("cpu")]
    if has_cuda():
        devices += [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
    return devices


def arch_coverage(capability, archs):
    """How the embedded GPU code serves a GPU of compute capability (major, minor).

    archs: the library's list, e.g. ["sm_75", "sm_90a", "compute_121"]. Machine code (SASS) for
    sm_XY runs on X.Z with Z >= Y (an "a" variant only on X.Y itself; an "f" variant on its
    family, X.Z with Z >= Y); PTX compute_XY is JIT-compiled by the driver for any GPU of
    capability >= X.Y. Returns (covered, how): how names the code that runs, or says why none
    can.
    """
    major, minor = capability
    cc = major * 10 + minor
    sass, ptx = [], []
    for arch in archs:
        m = re.fullmatch(r"(sm|compute)_(\d+)([af]?)", arch)
        if not m:
            continue
        number, suffix = int(m.group(2)), m.group(3)
        a_major, a_minor = divmod(number, 10)
        if suffix == "a":  # arch-specific features: that exact GPU only
            runs = number == cc
        elif m.group(1) == "sm":
            runs = a_major == major and a_minor <= minor
        else:
            runs = number <= cc
        if runs:
            (sass if m.group(1) == "sm" else ptx).append((number, arch))
    if sass:
        number, arch = max(sass)
        return True, f"machine code {arch}" + ("" if number == cc else f" (runs on sm_{cc}: same major)")
    if ptx:
        return True, (f"PTX {max(ptx)[1]}, JIT-compiled by the driver at first use (slow first "
                      f"call; the driver must be as new as the CUDA the library was built with)")
    if not archs:
        return False, "the library has no GPU code"
    return False, (f"NOT COVERED: no machine code for sm_{major}x at or below sm_{cc} and no PTX "
                   f"at or below compute_{cc} among {' '.join(archs)}; rebuild on this machine "
                   f"with `make CUDA_ARCHS={cc}` (an nvcc that supports sm_{cc})")


def _driver_cuda_version():
    """The CUDA version the installed driver supports (e.g. 12080), or None without a driver."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
        version = ctypes.c_int(0)
        if libcuda.cuDriverGetVersion(ctypes.byref(version)) == 0:
            return version.value
    except (OSError, AttributeError):
        pass
    return None


def _cuda_text(version):
    return f"{version // 1000}.{version % 1000 // 10}"


def gpu_coverage():
    """[(device index, covered, line)] for every GPU torch sees."""
    import torch
    rows = []
    if not torch.cuda.is_available():
        return rows
    archs = cuda_archs()
    built = bool(_clib.lib.msda_has_cuda())
    for i in range(torch.cuda.device_count()):
        major, minor = torch.cuda.get_device_capability(i)
        name = torch.cuda.get_device_name(i)
        if built:
            covered, how = arch_coverage((major, minor), archs)
        else:
            covered, how = True, ("the library is a CPU-only build: CUDA tensors go to the "
                                  "pure-PyTorch reference")
        rows.append((i, covered, f"cuda:{i}:{' ' * max(1, 10 - len(str(i)))}{name}, sm_{major}{minor}: {how}"))
    return rows


_WHY = {"PYMSDA_LIBRARY": "named by the environment variable PYMSDA_LIBRARY",
        "installed package": "the copy inside the package",
        "source checkout": "the checkout's build/ folder (the package holds no library)"}


def where():
    """Lines saying which pymsda package and library this process uses, and why."""
    package = os.path.dirname(os.path.abspath(__file__))
    checkout = os.path.dirname(package)
    loaded = os.path.realpath(library_path())
    origin = next((o for o, p in _clib.candidate_paths() if os.path.realpath(p) == loaded), None)
    lines = [f"pymsda package: {package}",
             f"pymsda library: {library_path()} (ABI {_clib.lib.msda_abi_version()}): "
             f"{_WHY.get(origin, 'loaded')}"]
    if os.path.isfile(os.path.join(checkout, "c", "msda.h")):
        lines.append("                (a source checkout: Python imports the pymsda of the current "
                     "directory before an installed one; run from another directory to check "
                     "what `pip install .` installed)")
    return lines


def info():
    import torch
    lib = _clib.lib
    for line in where():
        print(line)
    if lib.msda_has_cuda():
        v = lib.msda_cuda_version()
        print(f"CUDA kernels:   yes, built with CUDA {_cuda_text(v)}; embedded: "
              f"{' '.join(cuda_archs())}")
        driver = _driver_cuda_version()
        if driver is not None:
            note = ("" if driver // 1000 >= v // 1000 else
                    f"  <- older than CUDA {_cuda_text(v)}: the CUDA kernels cannot run; "
                    "update the NVIDIA driver")
            print(f"CUDA driver:    supports CUDA {_cuda_text(driver)}{note}")
    else:
        print("CUDA kernels:   no (CPU-only build)")
    print(f"torch:          {torch.__version__} (CUDA {torch.version.cuda or 'none'})")
    print(f"Python:         {platform.python_version()} ({sys.executable})")
    print(f"CPU threads:    {torch.get_num_threads()} (OpenMP runtime: "
          f"{_clib.lib.msda_openmp_runtime().decode() or 'none found, one thread'})")
    coverage = gpu_coverage()
    for _, _, line in coverage:
        print(line)
    if not coverage:
        print("GPUs:           none visible to torch")
    return coverage


def check(device):
    """Forward and gradients on random inputs against the float64 reference."""
    import torch

    from .ops import ms_deform_attn
    from .reference import ms_deform_attn_pytorch, rel_l2
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
    errors = [rel_l2(out.cpu(), ref)] + [rel_l2(a.cpu(), b) for a, b in zip(grads, ref_grads)]
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
    parser.add_argument("command", nargs="?", default="check", choices=["check", "info", "bench"],
                        help="check (the default), info or bench, as above")
    args = parser.parse_args(argv)
    if importlib.util.find_spec("torch") is None:  # a deployment machine: ONNX Runtime, no torch
        print(f"pymsda library: {_clib.path} (ABI {_clib.lib.msda_abi_version()})\n"
              f"OpenMP runtime: {_clib.lib.msda_openmp_runtime().decode() or 'none (one thread)'}\n"
              "torch:          not installed: the self-check needs it (pip install torch); "
              "without it the library serves ONNX Runtime (pymsda.library_path(), "
              "docs/export.md)")
        return 0 if args.command == "info" else 1
    coverage = info()
    uncovered = {i for i, covered, _ in coverage if not covered}
    if args.command == "info":
        return 0
    results = []
    for device in _devices():
        if device.type == "cuda" and device.index in uncovered:
            print(f"self-check {str(device):7s} FAIL: the library has no code this GPU can run "
                  "(see above)")
            results.append(False)
        else:
            results.append(check(device))
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())

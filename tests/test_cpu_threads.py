"""tests/test_cpu_threads.py: the CPU kernels under every threading situation they meet in PyTorch.

The op runs on torch.get_num_threads() OpenMP threads (pymsda/_op.py, device_args, passes
it) of the runtime torch already loaded: pymsda/_clib.py puts that runtime in the global scope
before it loads the library (a wheel's library names no OpenMP library; a build folder's names
libgomp.so.1, which resolves to the same copy), so torch and pymsda share one OpenMP runtime and
thread pool. Checked here:
- results are bitwise identical for any thread count, in the three work splits of the backward
  (tasks owning whole batches, tasks owning head blocks of a batch, and the split backward for
  fewer (b, h) slices than threads can share), and match the f64 oracle;
- DataLoader workers (num_workers=2, forked after the parent used both runtimes): torch sets one
  thread there and the kernels then start no thread at all (a forked child must not touch the
  parent's OpenMP pool, which fork does not copy); the same in a fresh process at
  torch.set_num_threads(1);
- one OpenMP runtime in the process;
- an output buffer large enough for the huge-page advice path (grad_value > 8 MB).
Calls from several Python threads at once: tests/test_threads.py.
"""
import os
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

import pymsda
from pymsda import _op, _clib
from factories import (GRAD_NAMES, make_inputs, oracle_backward, oracle_forward,
                       random_grad_output, rel_l2)

needs_linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                 reason="reads /proc/self (Linux)")


class num_threads:
    """torch.set_num_threads(n) inside a with block."""

    def __init__(self, n):
        self.n = n

    def __enter__(self):
        self.saved = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.saved)


# Big enough that the kernels really go parallel (they stay on one thread below 2048 points).
# FUSED: tasks own whole batches at 1 and 2 threads; HEAD_BLOCKS: one batch, so at 2 threads tasks
# own blocks of heads (C = 37: a channel tail after the vectors); both split at 3 and 7 threads.
FUSED = dict(batch=2, queries=70, heads=4, channels=40, shapes=[(9, 11), (5, 6)], points=4)
HEAD_BLOCKS = dict(batch=1, queries=70, heads=8, channels=37, shapes=[(9, 11), (5, 6)], points=4)
SPLIT = dict(batch=1, queries=300, heads=1, channels=40, shapes=[(9, 11), (5, 6)], points=4)


def forward_and_grads(inputs, grad_output):
    leaves = {k: inputs[k].detach().clone().requires_grad_() for k in GRAD_NAMES}
    out = pymsda.ms_deform_attn(leaves["value"], inputs["spatial_shapes"],
                                inputs["level_start_index"], leaves["sampling_locations"],
                                leaves["attention_weights"])
    out.backward(grad_output)
    return [out.detach()] + [leaves[k].grad for k in GRAD_NAMES]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16],
                         ids=["f32", "f64", "bf16"])
@pytest.mark.parametrize("case", [FUSED, HEAD_BLOCKS, SPLIT], ids=["fused", "head_blocks", "split"])
def test_results_are_identical_for_any_thread_count(generator, dtype, case):
    inputs = make_inputs(generator, **case, dtype=dtype)
    B, Q, H = inputs["attention_weights"].shape[:3]
    grad_output = random_grad_output(generator, torch.empty(B, Q, H * case["channels"], dtype=dtype))
    results = {}
    for threads in (1, 2, 3, 7):
        with num_threads(threads):
            results[threads] = forward_and_grads(inputs, grad_output)
    for threads in (2, 3, 7):
        for name, a, b in zip(("output",) + GRAD_NAMES, results[1], results[threads]):
            assert torch.equal(a, b), f"{name} with {threads} threads differs from 1 thread"


@pytest.mark.parametrize("case", [FUSED, HEAD_BLOCKS, SPLIT], ids=["fused", "head_blocks", "split"])
def test_threaded_results_match_f64_oracle(generator, case):
    inputs = make_inputs(generator, **case, dtype=torch.float64)
    B, Q, H = inputs["attention_weights"].shape[:3]
    grad_output = random_grad_output(generator,
                                     torch.empty(B, Q, H * case["channels"], dtype=torch.float64))
    with num_threads(2):
        out, *grads = forward_and_grads(inputs, grad_output)
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12
    for name, grad, expected in zip(GRAD_NAMES, grads, oracle_backward(inputs, grad_output)):
        assert rel_l2(grad, expected) < 1e-11, name


def _native_threads(expected=None):
    """The process's threads that Python did not start (OpenMP's would be among them): the
    multiprocessing queue of a DataLoader worker starts Python threads of its own at any time,
    and one that is just starting has no native_id registered yet, so when threads beyond
    `expected` show up, ask again for a while before answering."""
    for _ in range(40):
        tasks = {int(t) for t in os.listdir("/proc/self/task")}
        native = tasks - {t.native_id for t in threading.enumerate()}
        if expected is None or native <= expected:
            break
        time.sleep(0.05)
    return native


class _OpDataset(torch.utils.data.Dataset):
    """Each item runs the op's forward and backward inside the worker, and reports the worker's
    torch thread count and its native threads before and after the C kernels run there (the
    kernels alone, called the way pymsda.ops calls them, so no torch machinery starts one)."""

    def __init__(self, inputs, grad_output):
        self.inputs, self.grad_output = inputs, grad_output

    def __len__(self):
        return 4

    def __getitem__(self, index):
        # The kernels through the C ABI, not autograd: a forked worker cannot run autograd's
        # backward once the parent has used its device threads (as on a machine with a GPU).
        before = _native_threads()
        results = _run_kernels(self.inputs, self.grad_output)
        return torch.get_num_threads(), (before, _native_threads(expected=before)), results


def _run_kernels(inputs, grad_output):
    """msda_forward and msda_backward through the C ABI, with the thread count pymsda.ops
    chooses (_op.device_args), and nothing else around them."""
    value, loc, attn = (inputs[k].contiguous() for k in GRAD_NAMES)
    B, S, H, C = value.shape
    _, Q, _, L, P, _ = loc.shape
    shapes = inputs["spatial_shapes"].to(torch.int64).contiguous()
    starts = inputs["level_start_index"].to(torch.int64).contiguous()
    device, stream, threads = _op.device_args(value)
    code = {torch.float32: _clib.DTYPE_F32, torch.float64: _clib.DTYPE_F64}[value.dtype]
    out = torch.empty(B, Q, H * C, dtype=value.dtype)
    grads = [torch.empty_like(value), torch.empty_like(loc), torch.empty_like(attn)]
    common = dict(B=B, S=S, H=H, C=C, L=L, Q=Q, P=P, dtype=code, index_dtype=_clib.INDEX_I64,
                  device=device, num_threads=threads, value=value.data_ptr(),
                  spatial_shapes=shapes.data_ptr(), level_start_index=starts.data_ptr(),
                  sampling_locations=loc.data_ptr(), attention_weights=attn.data_ptr(),
                  stream=stream)
    assert _clib.lib.msda_forward(_clib.pack_args(**common, output=out.data_ptr())) == _clib.OK
    assert _clib.lib.msda_backward(_clib.pack_args(
        **common, grad_output=grad_output.contiguous().data_ptr(),
        **{f"grad_{name}": g.data_ptr() for name, g in zip(GRAD_NAMES, grads)})) == _clib.OK
    return [out] + grads


@needs_linux
def test_dataloader_workers_run_single_threaded_and_match(generator):
    inputs = make_inputs(generator, **FUSED, dtype=torch.float32)
    B, Q, H = inputs["attention_weights"].shape[:3]
    grad_output = random_grad_output(generator, torch.empty(B, Q, H * FUSED["channels"]))
    with num_threads(2):
        expected = forward_and_grads(inputs, grad_output)  # the parent's pool is warm now
        (torch.randn(512, 512) @ torch.randn(512, 512)).sum()  # and torch's own ops ran
        loader = torch.utils.data.DataLoader(_OpDataset(inputs, grad_output), batch_size=None,
                                             num_workers=2, timeout=120)
        items = list(loader)
    assert len(items) == 4
    for worker_threads, (before, after), results in items:
        assert worker_threads == 1
        assert after <= before, f"native threads before the kernels {before}, after {after}"
        for a, b in zip(expected, results):
            assert torch.equal(a, b)


@needs_linux
def test_one_thread_starts_no_thread(generator):
    # A fresh process (no OpenMP pool yet) at torch.set_num_threads(1): the kernels must not
    # start one, which is also what keeps them fork-safe.
    inputs = make_inputs(generator, **FUSED, dtype=torch.float32)
    B, Q, H = inputs["attention_weights"].shape[:3]
    grad_output = random_grad_output(generator, torch.empty(B, Q, H * FUSED["channels"]))
    code = (
        "import os, sys, torch\n"
        f"sys.path[:0] = {sys.path!r}\n"
        "torch.set_num_threads(1)\n"
        "from test_cpu_threads import _run_kernels\n"
        "inputs, grad_output = torch.load(sys.argv[1])\n"
        "before = len(os.listdir('/proc/self/task'))\n"
        "_run_kernels(inputs, grad_output)\n"
        "print(len(os.listdir('/proc/self/task')) - before)\n")
    with tempfile.NamedTemporaryFile(suffix=".pt") as f:
        torch.save((inputs, grad_output), f.name)
        done = subprocess.run([sys.executable, "-c", code, f.name], capture_output=True,
                              text=True, timeout=300, cwd=os.path.dirname(__file__))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "0", f"new threads: {done.stdout} {done.stderr}"


@needs_linux
def test_torch_and_pymsda_share_one_openmp_runtime():
    mapped = set()
    with open("/proc/self/maps") as maps:
        for line in maps:
            path = line.split()[-1] if len(line.split()) >= 6 else ""
            name = os.path.basename(path)
            if name.startswith(("libgomp", "libiomp", "libomp")):
                mapped.add(os.path.realpath(path))
    gomp = {p for p in mapped if os.path.basename(p).startswith("libgomp")}
    if not gomp:
        pytest.skip("no libgomp mapped (a build without OpenMP)")
    # pymsda binds to the runtime torch loaded (pymsda/_clib.py), never a second one.
    assert len(gomp) == 1, f"two GNU OpenMP runtimes loaded: {sorted(gomp)}"


def test_large_grad_value_is_exact(generator):
    # grad_value of 1 x 70000 x 1 x 40 f32 (11 MB): the huge-page advice path, with most rows
    # never sampled (they must still come back zero, not as the buffer's old contents).
    shapes = [(250, 280)]
    inputs = make_inputs(generator, batch=1, queries=64, heads=1, channels=40, shapes=shapes,
                         points=4, dtype=torch.float32, kink_free=True)
    grad_output = random_grad_output(generator, torch.empty(1, 64, 40))
    for _ in range(2):  # the second time into memory the allocator may hand back dirty
        with num_threads(2):
            _, grad_value, grad_loc, grad_attn = forward_and_grads(inputs, grad_output)
    expected = oracle_backward(inputs, grad_output)
    for name, grad, e in zip(GRAD_NAMES, (grad_value, grad_loc, grad_attn), expected):
        assert rel_l2(grad, e) < 1e-5, name

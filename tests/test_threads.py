"""tests/test_threads.py: the op is safe to call from several Python threads at once.

ctypes releases the GIL during a library call, so the threads really do run the kernels
concurrently. Each thread's results must equal the serial ones (bit for bit on the CPU, whose
kernels are deterministic, under torch.set_num_threads(1) and (2); on CUDA, where grad_value is
summed with atomics, to rounding), every call must return, and the C library's last-error text
must be per thread: a failure in one thread neither replaces nor clears the text another thread
is about to read.
"""
import threading

import pytest
import torch

from pymsda import _clib
from conftest import requires_cuda
from factories import GRAD_NAMES, make_inputs, random_grad_output, run_msda

ROUNDS = 20


def forward_and_grads(inputs, grad_output):
    leaves = {k: inputs[k].detach().clone().requires_grad_(True) for k in GRAD_NAMES}
    out = run_msda(inputs, **leaves)
    out.backward(grad_output)
    return [out.detach()] + [leaves[k].grad for k in GRAD_NAMES]


def run_in_threads(*bodies, timeout=120):
    """Runs each body in its own thread, all released at once; re-raises the first failure.
    A thread still running after timeout seconds fails the test (a call did not return)."""
    barrier = threading.Barrier(len(bodies))
    errors = []

    def wrap(body):
        try:
            barrier.wait()
            body()
        except BaseException as e:  # noqa: BLE001 - handed back to the test thread
            errors.append(e)

    threads = [threading.Thread(target=wrap, args=(body,)) for body in bodies]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a call did not return"
    if errors:
        raise errors[0]


def two_problems(generator, device, dtype=torch.float32):
    """Two different problems (sizes, dtypes, index dtypes), each with its grad_output."""
    problems = []
    for shapes, batch, queries, channels, index_dtype in (
            ([(9, 7), (4, 5), (2, 3)], 2, 40, 16, torch.int64),
            ([(6, 11), (3, 3)], 3, 25, 5, torch.int32)):
        inputs = make_inputs(generator, batch, queries, 4, channels, shapes, 3, dtype=dtype,
                             device=device, index_dtype=index_dtype)
        problems.append((inputs, random_grad_output(generator, run_msda(inputs))))
    return problems


@pytest.mark.parametrize("torch_threads", [1, 2], ids=["one_torch_thread", "two_torch_threads"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_four_threads_give_the_serial_results_cpu(generator, dtype, torch_threads):
    # Two threads on each problem; each sets torch's thread count too (it is per process), so
    # the kernels of all four share one OpenMP pool of that size.
    problems = two_problems(generator, "cpu", dtype)
    serial = [forward_and_grads(*p) for p in problems]

    def body(problem, expected):
        def run():
            torch.set_num_threads(torch_threads)
            for _ in range(ROUNDS):
                for got, want in zip(forward_and_grads(*problem), expected):
                    assert torch.equal(got, want)
        return run

    saved = torch.get_num_threads()
    torch.set_num_threads(torch_threads)
    try:
        run_in_threads(*(body(p, e) for p, e in zip(problems, serial) for _ in range(2)))
    finally:
        torch.set_num_threads(saved)


def _fail(lib, channels, dtype_code):
    buffer = torch.zeros(16, dtype=torch.float64)
    p = buffer.data_ptr()
    return lib.msda_forward(_clib.pack_args(
        B=1, S=4, H=1, C=channels, L=1, Q=1, P=1, dtype=dtype_code, index_dtype=_clib.INDEX_I64,
        device=-1, num_threads=1, value=p, spatial_shapes=p, level_start_index=p,
        sampling_locations=p, attention_weights=p, output=p))


def test_last_error_text_is_per_thread():
    # Thread A fails with C = 0, thread B with dtype code 7; both fail before either reads its
    # text, so a shared buffer would show one of them the other's message.
    lib = _clib.lib
    fail_both = threading.Barrier(2)
    texts = {"A": [], "B": []}

    def body(name, channels, dtype_code):
        def run():
            for _ in range(200):
                status = _fail(lib, channels, dtype_code)
                fail_both.wait()
                texts[name].append((status, lib.msda_last_error().decode()))
                fail_both.wait()
        return run

    run_in_threads(body("A", 0, _clib.DTYPE_F32), body("B", 1, 7))
    assert all(s == _clib.ERR_INVALID_ARGUMENT and "size C" in t for s, t in texts["A"])
    assert all(s == _clib.ERR_INVALID_ARGUMENT and "dtype code 7" in t for s, t in texts["B"])


def test_success_in_one_thread_does_not_clear_another_threads_error(generator):
    lib = _clib.lib
    inputs = make_inputs(generator, 1, 4, 2, 3, [(3, 3)], 2)
    failed, succeeded = threading.Event(), threading.Event()
    seen = []

    def failing():
        _fail(lib, 0, _clib.DTYPE_F32)
        failed.set()
        succeeded.wait(10)
        seen.append(lib.msda_last_error().decode())

    def succeeding():
        failed.wait(10)
        run_msda(inputs)  # a successful call clears this thread's text only
        assert lib.msda_last_error().decode() == ""
        succeeded.set()

    run_in_threads(failing, succeeding)
    assert "size C" in seen[0]


def test_refused_calls_in_one_thread_leave_another_threads_results_alone(generator):
    (inputs, grad_output), _ = two_problems(generator, "cpu")
    expected = forward_and_grads(inputs, grad_output)
    bad = inputs["sampling_locations"][..., :1]

    def refuse():
        for _ in range(ROUNDS * 5):
            with pytest.raises(ValueError, match="sampling_locations"):
                run_msda(inputs, sampling_locations=bad)
            status = _fail(_clib.lib, 1, 9)
            assert status == _clib.ERR_INVALID_ARGUMENT
            assert "dtype code 9" in _clib.lib.msda_last_error().decode()

    def compute():
        for _ in range(ROUNDS):
            for got, want in zip(forward_and_grads(inputs, grad_output), expected):
                assert torch.equal(got, want)

    run_in_threads(refuse, compute)


# ---- CUDA: two threads, each on its own stream ------------------------------------------------

@requires_cuda
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_two_threads_on_two_streams_give_the_serial_results_cuda(generator, dtype):
    problems = two_problems(generator, "cuda", dtype)
    serial = [forward_and_grads(*p) for p in problems]
    torch.cuda.synchronize()
    tolerance = 1e-5 if dtype == torch.float32 else 1e-12

    def body(problem, expected):
        def run():
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.default_stream())
            with torch.cuda.stream(stream):
                for _ in range(ROUNDS):
                    got = forward_and_grads(*problem)
                    stream.synchronize()
                    # forward and the per-point gradients are deterministic; grad_value is
                    # summed with atomics (order, hence last bits, vary)
                    out, grad_value, grad_loc, grad_attn = got
                    assert torch.equal(out, expected[0])
                    assert torch.equal(grad_loc, expected[2])
                    assert torch.equal(grad_attn, expected[3])
                    torch.testing.assert_close(grad_value, expected[1], rtol=tolerance,
                                               atol=tolerance)
        return run

    run_in_threads(*(body(p, e) for p, e in zip(problems, serial)))

"""tests/test_cpu_buffers.py: the pool of reused CPU gradient buffers (pymsda/_buffers.py).

The property that matters: a pooled storage is handed out again only when nothing else uses it
(no tensor, view, numpy array, saved tensor of an autograd graph or parameter .grad), so a
gradient the caller still holds is never overwritten by a later backward. Also: released buffers
are reused, the pool stays within its slots and bytes, it degrades to torch.empty without the
private use-count function, threads never get one live buffer twice, and gradients computed
through it match the f64 oracle while earlier gradients stay intact.
"""
import threading

import numpy as np
import pytest
import torch

import pymsda
from pymsda import _buffers
from factories import GRAD_NAMES, make_inputs, oracle_backward, random_grad_output, rel_l2

MB = 1 << 20
needs_use_count = pytest.mark.skipif(_buffers._checked_idle_test()[0] is None,
                                     reason="this torch lacks torch._C._storage_Use_Count")


def small_pool(**options):
    kwargs = dict(max_bytes=64 * MB, idle_test=_buffers._checked_idle_test(), slots=4,
                  min_bytes=1024)
    kwargs.update(options)
    return _buffers.CpuBufferPool(**kwargs)


def storage_of(tensor):
    return tensor.untyped_storage().data_ptr()


@needs_use_count
def test_pool_reuses_a_released_buffer():
    pool = small_pool()
    first = pool.empty((64, 64), torch.float32)
    address = storage_of(first)
    del first
    again = pool.empty((64, 64), torch.float32)
    assert storage_of(again) == address
    assert again.shape == (64, 64) and again.dtype == torch.float32 and again.is_contiguous()
    # another dtype of the same byte size reuses it too
    del again
    assert storage_of(pool.empty((64, 32), torch.float64)) == address


@needs_use_count
@pytest.mark.parametrize("holder", ["tensor", "view", "numpy", "storage", "saved_by_autograd",
                                    "grad_of_leaf"])
def test_pooled_buffer_is_never_handed_out_while_referenced(holder):
    pool = small_pool()
    buffer = pool.empty((32, 32), torch.float32)
    buffer.fill_(7.0)
    keep = []
    if holder == "tensor":
        keep.append(buffer)
    elif holder == "view":
        keep.append(buffer[3:5].t())
    elif holder == "numpy":
        keep.append(buffer.numpy())
    elif holder == "storage":
        keep.append(buffer.untyped_storage())
    elif holder == "saved_by_autograd":
        leaf = torch.ones(32, 32, requires_grad=True)
        keep.append(leaf * buffer)  # mul saves `buffer` for its backward
    elif holder == "grad_of_leaf":
        leaf = torch.ones(32, 32, requires_grad=True)
        leaf.grad = buffer
        keep.append(leaf)
    address = storage_of(buffer)
    del buffer
    for _ in range(6):  # more than the pool's slots: every one is fresh
        other = pool.empty((32, 32), torch.float32)
        assert storage_of(other) != address
        other.fill_(-1.0)
        keep.append(other)


@needs_use_count
def test_referenced_buffer_keeps_its_contents():
    pool = small_pool()
    held = pool.empty((256,), torch.float64)
    held.fill_(3.0)
    for _ in range(10):
        pool.empty((256,), torch.float64).fill_(-1.0)
    assert torch.equal(held, torch.full((256,), 3.0, dtype=torch.float64))


@needs_use_count
def test_pool_stays_within_its_slots_and_bytes():
    pool = small_pool(slots=3, max_bytes=10 * MB)
    held = [pool.empty((MB,), torch.uint8) for _ in range(5)]
    assert len(pool._storages) == 3
    assert sum(s.nbytes() for s in pool._storages) <= 10 * MB
    held += [pool.empty((4 * MB,), torch.uint8) for _ in range(3)]
    assert sum(s.nbytes() for s in pool._storages) <= 10 * MB
    # too large or too small for the pool: plain tensors, never pooled
    assert pool.empty((11 * MB,), torch.uint8).numel() == 11 * MB
    assert pool.empty((100,), torch.uint8).numel() == 100
    assert all(s.nbytes() <= 4 * MB for s in pool._storages)
    del held
    assert pool.idle_bytes() == sum(s.nbytes() for s in pool._storages)
    pool.clear()
    assert pool.idle_bytes() == 0


def test_pool_without_use_count_hands_out_plain_tensors():
    pool = small_pool(idle_test=(None, 0))
    first = pool.empty((64, 64), torch.float32)
    assert first.shape == (64, 64) and not pool._storages


def test_pool_turned_off_by_zero_bytes():
    pool = small_pool(max_bytes=0)
    pool.empty((64, 64), torch.float32)
    assert not pool._storages


@needs_use_count
def test_threads_never_get_one_live_buffer_twice():
    pool = small_pool(slots=4)
    errors, live, lock = [], {}, threading.Lock()

    def worker(tag):
        for i in range(300):
            buffer = pool.empty((512,), torch.float32)
            address = storage_of(buffer)
            with lock:
                if address in live:
                    errors.append((tag, i, live[address]))
                live[address] = tag
            buffer.fill_(tag)
            if not torch.all(buffer == tag):
                errors.append((tag, i, "overwritten"))
            with lock:
                del live[address]
            del buffer

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors


@needs_use_count
def test_gradients_through_the_pool_match_the_oracle_and_stay_intact(monkeypatch):
    # every CPU gradient of this small shape goes through the pool
    monkeypatch.setattr(_buffers.pool, "min_bytes", 1)
    generator = torch.Generator().manual_seed(28)
    inputs = make_inputs(generator, batch=2, queries=40, heads=4, channels=8,
                         shapes=[(9, 11), (5, 6)], points=3)
    grad_output = random_grad_output(generator, torch.empty(2, 40, 32, dtype=torch.float64))
    expected = oracle_backward(inputs, grad_output)
    leaves = {k: inputs[k].detach().clone().requires_grad_() for k in GRAD_NAMES}

    def out():
        return pymsda.ms_deform_attn(leaves["value"], inputs["spatial_shapes"],
                                     inputs["level_start_index"], leaves["sampling_locations"],
                                     leaves["attention_weights"])

    out().backward(grad_output)  # .grad takes (steals) the pooled buffers
    first = {k: leaves[k].grad.clone() for k in GRAD_NAMES}
    kept = [torch.autograd.grad(out(), list(leaves.values()), grad_output) for _ in range(6)]
    for grads in kept:  # each call's gradients on buffers of their own, all correct
        for name, grad, want in zip(GRAD_NAMES, grads, expected):
            assert rel_l2(grad, want) < 1e-12, name
    for name in GRAD_NAMES:  # the .grad buffers were not handed out again
        assert torch.equal(leaves[name].grad, first[name]), name
    addresses = {storage_of(g) for grads in kept for g in grads}
    addresses |= {storage_of(leaves[k].grad) for k in GRAD_NAMES}
    assert len(addresses) == 3 * 7
    del kept
    out().backward(grad_output)  # accumulates into .grad
    for name, want in zip(GRAD_NAMES, expected):
        assert rel_l2(leaves[name].grad, 2 * np.asarray(want)) < 1e-12, name


@needs_use_count
def test_empty_cpu_cache_releases_idle_buffers(monkeypatch):
    pool = small_pool()
    monkeypatch.setattr(_buffers, "pool", pool)
    held = pool.empty((4096,), torch.float32)
    pool.empty((8192,), torch.float32)
    assert pool.idle_bytes() == 8192 * 4
    pymsda.empty_cpu_cache()
    assert pool.idle_bytes() == 0 and not pool._storages
    held.fill_(1.0)  # still the caller's

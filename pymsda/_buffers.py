"""Reused CPU gradient buffers: the pages of a large gradient stay mapped from one backward to the next.

Why: torch's CPU allocator caches nothing; it calls malloc and free. glibc serves a buffer above
its mmap threshold (dynamic, 32 MB at most) with a fresh mmap and unmaps it on free, and it trims
the top of its heap when enough is free there, so a large gradient that Python allocates on every
backward is page-faulted in on every call (ddetr_dec's 40 MB grad_value: 10,000 faults, 7-8 ms of
system time a call on the development VM, and 50-76 ms for a process's first calls where the
pages were advised to be huge), and a mid-sized one (dec300's 11 MB) whenever the heap was trimmed
and grows again. Numbers: kernels/TUNING.md, "CPU allocation".

What: a pool of at most SLOTS storages of at least MIN_BYTES, together at most max_bytes (the
PYMSDA_CPU_POOL_MB environment variable at import, default 256; 0 turns the pool off). empty()
hands out a pooled storage of the asked size only when the pool holds the only reference to it:
torch's storage use count (pymsda/_torch_private.py) counts the tensors on the storage (views,
the autograd graph's saved tensors and a parameter's .grad included), and the Python references
to the storage's object
count a caller that holds it (tensor.untyped_storage() returns the pool's own object), so a
buffer that anything still uses is never handed out again. That function is private; both counts
are checked at import against a storage in each state, and where the function is missing or
counts otherwise empty() is plain torch.empty. Thread-safe (one lock around the
pool). The kernels write every element of the buffers they are given (grad_value is zeroed in C),
so stale contents never show. Idle pooled memory is given back by pymsda.empty_cpu_cache().
"""
import math
import os
import sys
import threading

import torch

from ._torch_private import storage_use_count

MIN_BYTES = 256 << 10
SLOTS = 8


def _environment_bytes():
    text = os.environ.get("PYMSDA_CPU_POOL_MB", "256")
    try:
        return max(0, int(text)) << 20
    except ValueError:
        raise ValueError(f"PYMSDA_CPU_POOL_MB must be a whole number of megabytes, got {text!r}")


def _references(storage):
    """Python references to a storage object, as the pool calls it (with an item of its list):
    a caller holding the object tensor.untyped_storage() returns (the pool's own object: storage
    objects are unique per storage) adds one, and so does every tensor on it."""
    return sys.getrefcount(storage)


def _checked_idle_test():
    """(use_count, references) that say a pooled storage is idle: storage_use_count
    and the Python references _references counts for a storage held only by the pool's list;
    (None, 0) where that private function is missing or does not count what the pool relies on
    (then the pool hands out plain torch.empty tensors)."""
    use_count = storage_use_count
    try:
        if use_count(torch.UntypedStorage(64)) is None:
            return None, 0
        held = [torch.UntypedStorage(64)]
        alone = use_count(held[0]), _references(held[0])
        view = torch.empty(0, dtype=torch.uint8).set_(held[0], 0, (64,))
        viewed = use_count(held[0])
        storage_object = view.untyped_storage()
        del view
        object_held = use_count(held[0]), _references(held[0])
        del storage_object
        released = use_count(held[0]), _references(held[0])
    except Exception:  # a torch whose private API changed: no pool
        return None, 0
    works = (alone[0] == 1 and viewed == 2 and object_held[0] == 1 and object_held[1] > alone[1]
             and released == alone)
    return (use_count, alone[1]) if works else (None, 0)


_ITEMSIZES = {}


def _itemsize(dtype):
    """Bytes an element of dtype (dtype.itemsize, which torch has from 2.1 on)."""
    size = _ITEMSIZES.get(dtype)
    if size is None:
        size = _ITEMSIZES[dtype] = torch.empty((), dtype=dtype).element_size()
    return size


class CpuBufferPool:
    """Storages reused for CPU gradients; least recently handed out first in `_storages`."""

    def __init__(self, max_bytes, idle_test, slots=SLOTS, min_bytes=MIN_BYTES):
        self.max_bytes, self.slots, self.min_bytes = max_bytes, slots, min_bytes
        self._use_count, self._idle_references = idle_test
        self._storages = []
        self._lock = threading.Lock()

    def empty(self, shape, dtype):
        """An uninitialised contiguous CPU tensor, on a pooled storage where one fits."""
        if self._use_count is None:
            return torch.empty(shape, dtype=dtype)
        nbytes = math.prod(shape) * _itemsize(dtype)
        if not self.min_bytes <= nbytes <= self.max_bytes:
            return torch.empty(shape, dtype=dtype)
        with self._lock:
            storages = self._storages
            for i in range(len(storages)):
                if storages[i].nbytes() == nbytes and self._idle(i):
                    storage = storages.pop(i)
                    break
            else:
                storage = torch.UntypedStorage(nbytes)
                # make room: the least recently handed out go first (one still in use stays
                # alive with its users and is merely forgotten here)
                held = sum(s.nbytes() for s in storages)
                while storages and (len(storages) >= self.slots or held + nbytes > self.max_bytes):
                    held -= storages.pop(0).nbytes()
            storages.append(storage)
            # set_ builds the tensor on the storage; the pool's reference stays the oldest
            return torch.empty(0, dtype=dtype).set_(storage, 0, shape)

    def _idle(self, i):
        """Whether nothing but the pool uses its storage i: no tensor or view on it (they count
        in the storage's use count) and no caller holding its Python object."""
        storages = self._storages
        return (self._use_count(storages[i]) == 1
                and _references(storages[i]) <= self._idle_references)

    def idle_bytes(self):
        """Bytes of pooled storages nothing else uses (what empty_cpu_cache() gives back)."""
        with self._lock:
            return sum(self._storages[i].nbytes() for i in range(len(self._storages))
                       if self._idle(i))

    def clear(self):
        with self._lock:
            self._storages.clear()


pool = CpuBufferPool(_environment_bytes(), _checked_idle_test())

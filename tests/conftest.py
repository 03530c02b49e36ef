"""tests/conftest.py: shared markers and fixtures.

CUDA tests carry `requires_cuda`: they skip (never fail) where torch sees no GPU or the library
was built without CUDA kernels, and run unchanged on a GPU machine. Every test draws its random
inputs from `generator`, seeded from the test's node id: reproducible, yet different for every
test and every parametrised case.
"""
import pytest
import torch

import pymsda
from factories import seed_of


def cuda_usable():
    return torch.cuda.is_available() and pymsda.has_cuda()


requires_cuda = pytest.mark.skipif(
    not cuda_usable(),
    reason="needs a CUDA GPU and a libpymsda built with CUDA kernels (pymsda.has_cuda())")

requires_two_gpus = pytest.mark.skipif(
    not (cuda_usable() and torch.cuda.device_count() >= 2), reason="needs at least 2 CUDA GPUs")

# Parametrise a test over these to run it on the CPU always and on CUDA where there is a GPU.
DEVICES = ["cpu", pytest.param("cuda", marks=requires_cuda)]

FLOAT_DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture
def generator(request):
    return torch.Generator().manual_seed(seed_of(request.node.nodeid))

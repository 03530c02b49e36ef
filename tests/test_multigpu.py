"""tests/test_multigpu.py: two GPUs (the GPU tests skip with fewer).

- The op on one GPU while the current device is the other (cuda:1 from cuda:0 and the reverse)
  or the same runs on the tensors' device and on that device's current stream: its inputs are
  written on a side stream of their device that a sleep kernel holds back, so work put on any
  other stream (the current device's, or the legacy default stream) would read them too early
  and be wrong. In float64 on the second GPU, forward and gradients match the oracle to 1e-12
  and 1e-11, and the caller's current device is left as it was.
- A 2-process DistributedDataParallel training step (NCCL, NVLink multicast off:
  NCCL_NVLS_ENABLE=0), each process on half the batch, gives the gradients and the updated
  parameters of one process on the whole batch. The same step also runs on the CPU (gloo),
  so the test's own logic runs everywhere.
"""
import datetime
import os
import sys
import socket

import pytest
import torch

import pymsda
from conftest import requires_two_gpus
from factories import (GRAD_NAMES, forward_and_grads, make_inputs, oracle_backward,
                       oracle_forward, random_grad_output, random_level_shapes, rel_l2, run_msda)


def sleep_on_current_stream():
    # Hold the current stream for a few tens of milliseconds.
    if not hasattr(torch.cuda, "_sleep"):
        pytest.skip(f"torch {torch.__version__} has no torch.cuda._sleep")
    torch.cuda._sleep(100_000_000)


@requires_two_gpus
@pytest.mark.parametrize("tensor_device,current_device", [(1, 0), (0, 1), (1, 1)],
                         ids=["cuda1_from_cuda0", "cuda0_from_cuda1", "cuda1_from_cuda1"])
def test_op_runs_on_the_tensors_device_and_its_current_stream(generator, tensor_device,
                                                             current_device):
    device = torch.device("cuda", tensor_device)
    shapes = random_level_shapes(generator, 3, max_side=9, min_side=2)
    inputs = make_inputs(generator, 2, 30, 2, 8, shapes, 3, dtype=torch.float32,
                         device=device, kink_free=True)
    new_value = torch.randn(inputs["value"].shape, generator=generator).to(device)
    grad_output = random_grad_output(generator, torch.empty(2, 30, 16, device=device))
    leaves = {k: inputs[k].clone().requires_grad_(True)
              for k in ("sampling_locations", "attention_weights")}
    with torch.cuda.device(tensor_device):
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            sleep_on_current_stream()
            value = inputs["value"].clone()
            value.copy_(new_value)  # ordered after the sleep, on `stream` only
            value.requires_grad_(True)
            with torch.cuda.device(current_device):
                assert torch.cuda.current_device() == current_device
                out = pymsda.ms_deform_attn(value, inputs["spatial_shapes"],
                                            inputs["level_start_index"],
                                            leaves["sampling_locations"],
                                            leaves["attention_weights"])
                out.backward(grad_output)  # the backward runs on the forward's stream
                assert torch.cuda.current_device() == current_device
        torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize(device)
    assert out.device == device
    expected_inputs = dict(inputs, value=new_value)
    assert rel_l2(out, oracle_forward(expected_inputs)) < 1e-6
    grads = [value.grad, leaves["sampling_locations"].grad, leaves["attention_weights"].grad]
    for name, grad, expected in zip(GRAD_NAMES, grads,
                                    oracle_backward(expected_inputs, grad_output)):
        assert grad.device == device, name
        assert rel_l2(grad, expected) < 1e-5, name


@requires_two_gpus
def test_second_gpu_forward_and_backward_f64_cuda(generator):
    torch.cuda.set_device(0)
    shapes = random_level_shapes(generator, 3, max_side=10, min_side=2)
    inputs = make_inputs(generator, 2, 11, 3, 9, shapes, 3, device="cuda:1", kink_free=True)
    grad_output = random_grad_output(generator, run_msda(inputs))
    out, grads = forward_and_grads(inputs, grad_output)
    assert out.device == torch.device("cuda:1")
    assert torch.cuda.current_device() == 0  # the caller's device is restored
    assert rel_l2(out, oracle_forward(inputs)) < 1e-12
    for name, g, e in zip(GRAD_NAMES, grads, oracle_backward(inputs, grad_output)):
        assert g.device == torch.device("cuda:1"), name
        assert rel_l2(g, e) < 1e-11, name


@requires_two_gpus
@pytest.mark.parametrize("shape_tables", ["list", "cpu_tensors"])
def test_list_and_cpu_shape_tables_are_cached_per_device(generator, shape_tables):
    # The same host-side shapes used on both GPUs in turn: each device gets its own copy.
    shapes = [(5, 7), (3, 2)]
    for device in ("cuda:0", "cuda:1", "cuda:0"):
        inputs = make_inputs(generator, 1, 9, 2, 4, shapes, 2, device=device)
        tables = (shapes, None) if shape_tables == "list" else (
            inputs["spatial_shapes"].cpu(), inputs["level_start_index"].cpu())
        with torch.cuda.device(1 if device == "cuda:0" else 0):
            out = pymsda.ms_deform_attn(inputs["value"], tables[0], tables[1],
                                        inputs["sampling_locations"],
                                        inputs["attention_weights"])
        assert out.device == torch.device(device)
        assert rel_l2(out, oracle_forward(inputs)) < 1e-12


# ---- DistributedDataParallel -------------------------------------------------------------------

WORLD_SIZE = 2
BATCH = 4  # split 2 + 2 across the processes
SHAPES = [(8, 6), (4, 3)]


def build_model_and_batch(device):
    """The same model and batch in every process (seeded), in float64 on device."""
    torch.manual_seed(0)
    model = pymsda.MSDeformAttn(d_model=32, n_levels=2, n_heads=4, n_points=2)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off its init, so that every parameter gets a real gradient
        for parameter in model.parameters():
            parameter.add_(0.05 * torch.randn(parameter.shape, generator=generator))
    model = model.double().to(device)
    S = sum(h * w for h, w in SHAPES)
    draw = dict(generator=generator, dtype=torch.float64)
    batch = dict(query=torch.randn(BATCH, 12, 32, **draw),
                 reference_points=torch.rand(BATCH, 12, 2, 2, **draw),
                 input_flatten=torch.randn(BATCH, S, 32, **draw))
    batch = {k: v.to(device) for k, v in batch.items()}
    batch["input_spatial_shapes"] = torch.tensor(SHAPES, device=device)
    batch["input_level_start_index"] = torch.tensor([0, 48], device=device)
    return model, batch


def loss_of(model, batch):
    out = model(batch["query"], batch["reference_points"], batch["input_flatten"],
                batch["input_spatial_shapes"], batch["input_level_start_index"])
    return out.square().mean()


def train_step(model, batch):
    """One SGD step; returns the gradients and the updated parameters, on the CPU."""
    loss_of(model, batch).backward()
    grads = {name: p.grad.detach().cpu().clone() for name, p in model.named_parameters()}
    torch.optim.SGD(model.parameters(), lr=0.5).step()
    params = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    return grads, params


def _ddp_worker(rank, device_type, port, result_path):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if device_type == "cuda":
        torch.cuda.set_device(rank)
        device, backend, device_ids = torch.device("cuda", rank), "nccl", [rank]
    else:
        torch.set_num_threads(1)
        device, backend, device_ids = torch.device("cpu"), "gloo", None
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=WORLD_SIZE, timeout=datetime.timedelta(seconds=120))
    try:
        model, batch = build_model_and_batch(device)
        share = BATCH // WORLD_SIZE
        local = {k: (v[rank * share:(rank + 1) * share] if k in PER_SAMPLE else v)
                 for k, v in batch.items()}
        grads, params = train_step(DistributedDataParallel(model, device_ids=device_ids), local)
        if rank == 0:
            torch.save(dict(grads=without_module_prefix(grads),
                            params=without_module_prefix(params)), result_path)
        # Neither rank tears its process group down while the other may still use it (gloo on
        # torch 2.14.1 aborted a rank now and then without this).
        dist.barrier()
    finally:
        dist.destroy_process_group()
    # Leave without the interpreter's and C++ runtime's exit-time teardown: with gloo on torch
    # 2.14.1 a rank still aborted there now and then ("terminate called without an active
    # exception", a joinable std::thread destroyed at exit) after its work was done and checked
    # in. An exception above still propagates to the parent as a failure.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


PER_SAMPLE = ("query", "reference_points", "input_flatten")


def without_module_prefix(named):
    """DDP names its parameters "module.<name>"."""
    return {name[len("module."):] if name.startswith("module.") else name: value
            for name, value in named.items()}


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("device_type", [
    pytest.param("cpu", id="cpu_gloo"),
    pytest.param("cuda", id="cuda_nccl", marks=requires_two_gpus),
])
def test_ddp_two_processes_match_one_process_on_the_whole_batch(tmp_path, monkeypatch,
                                                               device_type):
    import torch.distributed as dist
    backend_available = {"cpu": dist.is_available() and dist.is_gloo_available(),
                         "cuda": dist.is_available() and dist.is_nccl_available()}[device_type]
    if not backend_available:
        pytest.skip(f"torch {torch.__version__} has no "
                    f"{'gloo' if device_type == 'cpu' else 'NCCL'} backend")
    monkeypatch.setenv("NCCL_NVLS_ENABLE", "0")  # inherited by the spawned processes
    result_path = str(tmp_path / "rank0.pt")
    torch.multiprocessing.spawn(_ddp_worker, args=(device_type, free_port(), result_path),
                                nprocs=WORLD_SIZE, join=True)
    result = torch.load(result_path)

    model, batch = build_model_and_batch(torch.device(device_type, 0) if device_type == "cuda"
                                         else torch.device("cpu"))
    initial = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
    grads, params = train_step(model, batch)
    assert set(result["grads"]) == set(grads)
    for name in grads:
        assert grads[name].abs().max() > 0, name  # a real gradient
        assert rel_l2(result["grads"][name], grads[name]) < 1e-10, name
        assert not torch.equal(params[name], initial[name]), name  # the step moved it
        assert rel_l2(result["params"][name], params[name]) < 1e-12, name

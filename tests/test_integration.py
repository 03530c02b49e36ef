"""tests/test_integration.py: small detection-transformer layers built from pymsda.compat train
the same on pymsda's kernels as on the pure-PyTorch (grid_sample) path.

Two layers, each trained a few SGD steps twice from identical initial weights and data, once
with pymsda and once with the MSDA swapped for pymsda.reference.ms_deform_attn_pytorch:
  - a Deformable-DETR encoder layer (MSDeformAttn self-attention over the flattened levels, FFN)
  - an RT-DETRv2-style decoder layer (self-attention, MSDeformableAttention cross-attention with
    per-level point counts, "default" or "discrete" sampling, FFN) with a box head
The loss trajectories and the final parameters must agree (f32: rtol 1e-4), and training must
have changed both.
"""
import copy

import pytest
import torch
from torch import nn

import pymsda.modules
from pymsda.compat import deformable_detr, rtdetr
from pymsda.reference import ms_deform_attn_pytorch
from conftest import DEVICES
from factories import level_start_index_of

SHAPES = [(8, 8), (4, 4), (2, 2)]
D_MODEL, HEADS = 32, 4
STEPS = 5


class EncoderLayer(nn.Module):
    """Deformable DETR's encoder layer: deformable self-attention over all levels, then FFN."""

    def __init__(self):
        super().__init__()
        self.self_attn = deformable_detr.MSDeformAttn(D_MODEL, len(SHAPES), HEADS, 2)
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.ffn = nn.Sequential(nn.Linear(D_MODEL, 64), nn.ReLU(), nn.Linear(64, D_MODEL))
        self.norm2 = nn.LayerNorm(D_MODEL)

    def forward(self, src, pos, reference_points, spatial_shapes, level_start_index):
        attended = self.self_attn(src + pos, reference_points, src, spatial_shapes,
                                  level_start_index)
        src = self.norm1(src + attended)
        return self.norm2(src + self.ffn(src))


def encoder_reference_points(device):
    """The centre of every pixel of every level, normalised, repeated for each level."""
    points = []
    for h, w in SHAPES:
        y, x = torch.meshgrid(torch.arange(h, dtype=torch.float32) + 0.5,
                              torch.arange(w, dtype=torch.float32) + 0.5, indexing="ij")
        points.append(torch.stack([x.flatten() / w, y.flatten() / h], -1))
    ref = torch.cat(points)  # (S, 2)
    return ref[None, :, None, :].expand(1, -1, len(SHAPES), 2).to(device)


class DecoderLayer(nn.Module):
    """RT-DETRv2's decoder layer with a box head: self-attention, deformable cross-attention to
    the encoder memory, FFN."""

    def __init__(self, method):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(D_MODEL, HEADS, batch_first=True)
        self.norm1 = nn.LayerNorm(D_MODEL)
        self.cross_attn = rtdetr.MSDeformableAttention(D_MODEL, HEADS, len(SHAPES), [3, 2, 1],
                                                       method=method)
        self.norm2 = nn.LayerNorm(D_MODEL)
        self.ffn = nn.Sequential(nn.Linear(D_MODEL, 64), nn.ReLU(), nn.Linear(64, D_MODEL))
        self.norm3 = nn.LayerNorm(D_MODEL)
        self.box_head = nn.Linear(D_MODEL, 4)

    def forward(self, target, query_pos, reference_boxes, memory):
        q = target + query_pos
        target = self.norm1(target + self.self_attn(q, q, target, need_weights=False)[0])
        attended = self.cross_attn(target + query_pos, reference_boxes[:, :, None], memory,
                                   SHAPES)
        target = self.norm2(target + attended)
        target = self.norm3(target + self.ffn(target))
        return torch.sigmoid(self.box_head(target))


def train(model, step_loss, steps=STEPS, lr=0.05):
    """SGD steps; returns the losses."""
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr,
                                momentum=0.9)
    losses = []
    for step in range(steps):
        optimizer.zero_grad()
        loss = step_loss(model, step)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def assert_same_training(model_a, losses_a, model_b, losses_b, initial):
    torch.testing.assert_close(torch.tensor(losses_a), torch.tensor(losses_b), rtol=1e-4,
                               atol=1e-6)
    assert losses_a[-1] < losses_a[0], f"training did not reduce the loss: {losses_a}"
    params_b = dict(model_b.named_parameters())
    changed = 0
    for name, p in model_a.named_parameters():
        torch.testing.assert_close(p, params_b[name], rtol=1e-4, atol=1e-5, msg=name)
        changed += not torch.equal(p, initial[name])
    assert changed > len(initial) // 2, "training left most parameters unchanged"


@pytest.mark.parametrize("device", DEVICES)
def test_deformable_detr_encoder_layer_trains_like_pure_pytorch(device, monkeypatch):
    torch.manual_seed(0)
    model = EncoderLayer().to(device)
    with torch.no_grad():  # sampling offsets away from the symmetric init, so they get gradients
        model.self_attn.sampling_offsets.weight.normal_(0, 0.05)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    pure = copy.deepcopy(model)
    S = sum(h * w for h, w in SHAPES)
    batches = [(torch.randn(2, S, D_MODEL, device=device), torch.randn(2, S, D_MODEL,
                                                                       device=device))
               for _ in range(STEPS)]
    pos = 0.1 * torch.randn(1, S, D_MODEL, device=device)
    ref = encoder_reference_points(device).expand(2, -1, -1, -1)
    shapes = torch.tensor(SHAPES, device=device)
    starts = torch.tensor(level_start_index_of(SHAPES), device=device)

    def step_loss(layer, step):
        src, target = batches[step]
        return (layer(src, pos, ref, shapes, starts) - target).square().mean()

    losses = train(model, step_loss)

    calls = []

    def pure_msda(value, spatial_shapes, level_start_index, sampling_locations,
                  attention_weights, im2col_step=None):
        calls.append(1)
        return ms_deform_attn_pytorch(value, spatial_shapes, sampling_locations,
                                      attention_weights)

    monkeypatch.setattr(pymsda.modules, "ms_deform_attn", pure_msda)
    pure_losses = train(pure, step_loss)
    assert len(calls) == STEPS  # the pure run really went through grid_sample
    assert_same_training(model, losses, pure, pure_losses, initial)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("method", ["default", "discrete"])
def test_rtdetr_decoder_layer_trains_like_pure_pytorch(device, method):
    torch.manual_seed(0)
    model = DecoderLayer(method).to(device)
    if method == "default":
        with torch.no_grad():
            model.cross_attn.sampling_offsets.weight.normal_(0, 0.05)
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    pure = copy.deepcopy(model)
    sampling = "nearest" if method == "discrete" else "bilinear"
    pure.cross_attn.ms_deformable_attn_core = (
        lambda value, shapes, loc, attn, counts: ms_deform_attn_pytorch(
            value, shapes, loc, attn, num_points_list=counts, sampling=sampling))
    S = sum(h * w for h, w in SHAPES)
    memory = torch.randn(2, S, D_MODEL, device=device)
    query_pos = 0.1 * torch.randn(2, 10, D_MODEL, device=device)
    boxes = torch.cat([torch.rand(2, 10, 2), 0.1 + 0.3 * torch.rand(2, 10, 2)], -1).to(device)
    data = [(torch.randn(2, 10, D_MODEL, device=device), torch.rand(2, 10, 4, device=device))
            for _ in range(STEPS)]

    def step_loss(layer, step):
        target, truth = data[step]
        return (layer(target, query_pos, boxes, memory) - truth).abs().mean()

    losses = train(model, step_loss)
    pure_losses = train(pure, step_loss)
    assert_same_training(model, losses, pure, pure_losses, initial)

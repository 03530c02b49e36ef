"""tests/test_clients_mmcv.py: pymsda's mmcv module in mmengine, as installed from PyPI (mmcv-lite
and mmengine, pinned in tests/requirements-clients.txt): against mmcv's own module (same
initial weights, same training step), and built from a config through mmengine's MODELS
registry.
"""
import copy
import importlib

import torch

from pymsda.compat import mmcv as compat  # registers pymsda's module (before any stub below)
from clients import (DTYPES, assert_same_step, client, library_calls,  # noqa: F401
                     square_mean, train_step)


def mmcv_own_module_class(monkeypatch):
    """mmcv's own MultiScaleDeformableAttention, from the installed mmcv's source. mmcv-lite
    cannot import it (no compiled ops: mmcv._ext), so its loader is stubbed; off CUDA the module
    never calls the compiled op (it runs multi_scale_deformable_attn_pytorch), and its
    registration in mmengine's MODELS is left out (pymsda's holds the name)."""
    client("mmcv")
    registry = client("mmengine.registry")
    from mmcv.utils import ext_loader
    monkeypatch.setattr(ext_loader, "load_ext", lambda name, funcs: None)
    monkeypatch.setattr(registry.MODELS, "register_module",
                        lambda *args, **kwargs: (lambda cls: cls))
    path = importlib.util.find_spec("mmcv").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("mmcv.ops.multi_scale_deform_attn",
                                                  path + "/ops/multi_scale_deform_attn.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.MultiScaleDeformableAttention


def mmcv_loss(attention):
    generator = torch.Generator().manual_seed(6)
    dtype = attention.value_proj.weight.dtype
    shapes = torch.tensor([[6, 5], [3, 3]])

    def rand(*size):
        return torch.rand(*size, generator=generator, dtype=torch.float64).to(dtype)
    query, value = rand(9, 2, 32), rand(39, 2, 32)
    out = attention(query, value=value, query_pos=rand(9, 2, 32),
                    reference_points=rand(2, 9, 2, 2), spatial_shapes=shapes,
                    level_start_index=torch.tensor([0, 30]),
                    key_padding_mask=torch.arange(39).expand(2, 39) > 36)
    return out, square_mean(out)


@DTYPES
def test_mmcv_module_trains_like_mmcvs_own(monkeypatch, library_calls, dtype):
    """pymsda.compat.mmcv.MultiScaleDeformableAttention against mmcv's own class (off CUDA:
    its pure-PyTorch path): same state_dict keys and initial weights, same training step."""
    own_class = mmcv_own_module_class(monkeypatch)
    options = dict(embed_dims=32, num_heads=4, num_levels=2, num_points=2, dropout=0.0)
    torch.manual_seed(0)
    own = own_class(**options)
    torch.manual_seed(0)
    ours = compat.MultiScaleDeformableAttention(**options)
    assert list(ours.state_dict()) == list(own.state_dict())
    for name, tensor in own.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
    truth = train_step(copy.deepcopy(own).double(), mmcv_loss)
    own_step = train_step(own.to(dtype), mmcv_loss)
    assert library_calls["forward"] == 0
    our_step = train_step(ours.to(dtype), mmcv_loss)
    assert library_calls["forward"] == 1 and library_calls["backward"] == 1
    assert_same_step(our_step, own_step, truth, dtype)


def test_mmcv_module_builds_from_an_mmengine_config(library_calls):
    """With mmcv-lite (no compiled ops) a config naming mmcv's module builds pymsda's."""
    client("mmcv")
    registry = client("mmengine.registry")
    assert compat.REGISTERED
    attention = registry.MODELS.build(dict(type="MultiScaleDeformableAttention", embed_dims=32,
                                           num_heads=4, num_levels=2, num_points=2,
                                           batch_first=False))
    assert type(attention) is compat.MultiScaleDeformableAttention
    out, loss = mmcv_loss(attention.double())
    assert out.shape == (9, 2, 32) and library_calls["forward"] == 1

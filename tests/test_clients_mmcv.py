"""tests/test_clients_mmcv.py: pymsda's mmcv module in mmengine, as installed from PyPI (mmcv-lite
and mmengine, pinned in tests/requirements-clients.txt): against mmcv's own module (same
initial weights, same training step), built from a config through mmengine's MODELS registry
(also where a top-level module of the same name is importable, as Deformable DETR's compiled
extension is), left alone by a parent BaseModule's init_weights() as mmcv's is, and the
registry entry's install() / uninstall().
"""
import copy
import importlib
import os
import subprocess
import sys

import pytest
import torch

import pymsda
from pymsda.compat import mmcv as compat  # registers pymsda's module (before any stub below)
from clients import library_calls  # noqa: F401  (a fixture)
from clients import DTYPES, assert_same_step, client, square_mean, train_step
from conftest import expects_torchscript_deprecation

# mmengine imports torch.distributed.optim, whose functions torch scripts when imported (60-odd
# deprecation warnings)
pytestmark = expects_torchscript_deprecation

NAME = "MultiScaleDeformableAttention"
ENTRY = "mmengine.registry.MODELS." + NAME
OPTIONS = dict(embed_dims=32, num_heads=4, num_levels=2, num_points=2, dropout=0.0)


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


@pytest.fixture
def registry():
    """mmengine's MODELS, with pymsda's entry put back after the test."""
    registry = client("mmengine.registry")
    yield registry.MODELS
    compat.install()


def mmdet_style_parent(build_attention, init_cfg=None):
    """A parent as mmdet writes them, built under seed 0: a BaseModule whose constructor builds
    the attention module, then a plain layer."""
    model = client("mmengine.model")

    class Parent(model.BaseModule):
        def __init__(self):
            super().__init__(init_cfg)
            self.attn = build_attention()
            self.proj = torch.nn.Linear(32, 32)
    torch.manual_seed(0)
    return Parent()


@pytest.mark.parametrize("init_cfgs", [(None, None),
                                       (dict(type="Xavier", layer="Linear"),
                                        dict(type="Constant", layer="Linear", val=0.5))],
                         ids=["no_init_cfg", "init_cfgs"])
def test_parent_init_weights_leaves_the_module_as_mmcvs_own(monkeypatch, registry, init_cfgs):
    """A seeded mmdet-style build has the same weights with pymsda's module (from the registry)
    as with mmcv's own, before and after the parent's init_weights(): the attention module's
    own init_cfg is never applied (is_init is true once built), the parent's applies to both
    alike, and without one the attention modules stay as built."""
    parent_cfg, attention_cfg = init_cfgs
    ours = mmdet_style_parent(lambda: registry.build(dict(type=NAME, init_cfg=attention_cfg,
                                                          **OPTIONS)), parent_cfg)
    own_class = mmcv_own_module_class(monkeypatch)
    own = mmdet_style_parent(lambda: own_class(init_cfg=attention_cfg, **OPTIONS), parent_cfg)
    assert type(ours.attn) is compat.MultiScaleDeformableAttention and ours.attn.is_init
    built = copy.deepcopy(ours.state_dict())
    for parent in (ours, own):
        torch.manual_seed(1)  # what the parent's init_cfg draws
        parent.init_weights()
    assert list(ours.state_dict()) == list(own.state_dict())
    for name, tensor in own.state_dict().items():
        assert torch.equal(ours.state_dict()[name], tensor), name
        if parent_cfg is None:
            assert torch.equal(built[name], tensor), name


def test_config_builds_pymsdas_module_beside_a_top_level_namesake(tmp_path, monkeypatch,
                                                                  registry):
    """For a name it does not hold, mmengine's Registry.get imports a top-level module of that
    name and returns it: here a stand-in for Deformable DETR's compiled extension. pymsda's
    entry is made all the same, so the config builds pymsda's module."""
    (tmp_path / (NAME + ".py")).write_text("STAND_IN = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(sys.modules, NAME, None)  # (so that the test's end restores the entry)
    monkeypatch.delitem(sys.modules, NAME)
    assert compat.uninstall() == [ENTRY] and not compat.REGISTERED
    assert getattr(registry.get(NAME), "STAND_IN", False)  # the module, not a class
    assert compat.install() == [ENTRY] and compat.REGISTERED
    assert type(registry.build(dict(type=NAME, **OPTIONS))) is compat.MultiScaleDeformableAttention


def test_import_registers_beside_a_top_level_namesake(tmp_path):
    """The same at import time, in a fresh interpreter: `import pymsda.compat.mmcv` with a
    module named MultiScaleDeformableAttention importable."""
    client("mmengine.registry")
    (tmp_path / (NAME + ".py")).write_text("STAND_IN = True\n")
    code = ("import pymsda.compat.mmcv as compat\n"
            "from mmengine.registry import MODELS\n"
            "attention = MODELS.build(dict(type=%r, embed_dims=8, num_heads=2))\n"
            "print(compat.REGISTERED, type(attention).__module__)\n" % NAME)
    path = [str(tmp_path), os.path.dirname(os.path.dirname(pymsda.__file__))]
    environment = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    done = subprocess.run([sys.executable, "-c", code], env=environment, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True", "pymsda.compat.mmcv"]


def test_uninstall_frees_the_name_and_install_registers_it_again(registry):
    assert compat.install() == [ENTRY] == compat.install()  # once registered, still registered
    assert compat.uninstall() == [ENTRY] and compat.uninstall() == []
    assert NAME not in registry.module_dict and not compat.REGISTERED
    assert compat.install() == [ENTRY]
    assert registry.module_dict[NAME] is compat.MultiScaleDeformableAttention


def test_install_leaves_another_class_under_the_name_and_says_so(monkeypatch, registry):

    class Elsewhere(torch.nn.Module):
        pass
    monkeypatch.setitem(registry.module_dict, NAME, Elsewhere)
    with pytest.warns(UserWarning, match="registered to .*Elsewhere.*force=True"):
        assert compat.install() == []
    assert compat.uninstall() == [] and registry.module_dict[NAME] is Elsewhere

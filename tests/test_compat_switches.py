"""tests/test_compat_switches.py: pymsda.compat's switches (every install()) and their undos,
against stand-ins that reproduce each mechanism: a project whose own import raises something
other than ImportError (as PyPI's torchvision does beside a CPU torch build: RuntimeError:
operator torchvision::nms does not exist), a transformers modeling module's kernel layer, and
Deformable DETR's compiled extension with the code that imports it. The real projects:
tests/test_clients*.py.
"""
import copy
import importlib
import sys
import types

import pytest
import torch

import pymsda.compat
from pymsda.compat import _switch, groundingdino, mmcv, rfdetr, transformers, ultralytics

BROKEN_IMPORT = 'raise RuntimeError("operator torchvision::nms does not exist")\n'


def stand_in_package(tmp_path, monkeypatch, name, init_code):
    """Puts a top-level package `name` whose __init__ runs init_code first on sys.path, for this
    test only: the modules of any package of that name already imported are set aside."""
    folder = tmp_path / name
    folder.mkdir()
    (folder / "__init__.py").write_text(init_code)
    for key in [k for k in sys.modules if k == name or k.startswith(name + ".")]:
        monkeypatch.delitem(sys.modules, key)
    monkeypatch.syspath_prepend(str(tmp_path))


# (the compat module, the package its install() imports)
INSTALLS = [(ultralytics, "ultralytics"), (rfdetr, "rfdetr"), (transformers, "transformers"),
            (groundingdino, "groundingdino"), (mmcv, "mmengine")]


@pytest.mark.parametrize("compat, package", INSTALLS, ids=[p for _, p in INSTALLS])
def test_install_warns_naming_the_projects_import_failure(tmp_path, monkeypatch, compat,
                                                          package):
    """The project's import raises RuntimeError: install() warns with that error and returns
    [], as when the project is not installed; uninstall() then has nothing to do."""
    if compat is mmcv and mmcv._mmcv_has_compiled_ops():
        pytest.skip("mmcv's compiled ops are installed: mmcv.install() leaves mmcv's own module")
    stand_in_package(tmp_path, monkeypatch, package, BROKEN_IMPORT)
    with pytest.raises(RuntimeError):
        importlib.import_module(package)  # the stand-in reproduces the failure
    with pytest.warns(UserWarning, match=r"RuntimeError: operator torchvision::nms does not "
                                         r"exist") as warned:
        assert compat.install() == []
    assert any(package in str(w.message) for w in warned)
    if compat is not mmcv:  # (mmcv's entry, registered at import, stays in the real MODELS)
        assert compat.uninstall() == []


def test_install_switches_what_imports_and_names_what_fails(tmp_path, monkeypatch):
    """One module of a project imports and holds the function, another's import raises
    RuntimeError: the first is switched and the warning names the second; uninstall() restores
    the first."""
    stand_in_package(tmp_path, monkeypatch, "msda_stand_in_client", "")
    (tmp_path / "msda_stand_in_client" / "works.py").write_text(
        "def attention(value):\n    return 'own'\n")
    (tmp_path / "msda_stand_in_client" / "broken.py").write_text(BROKEN_IMPORT)
    (tmp_path / "msda_stand_in_client" / "absent_model.py").write_text(
        "import msda_no_such_dependency\n")
    targets = [("msda_stand_in_client.works", "attention"),
               ("msda_stand_in_client.broken", "attention"),
               ("msda_stand_in_client.absent_model", "attention")]

    def make(original, module):
        return lambda value: "pymsda"
    try:
        with pytest.warns(UserWarning) as warned:
            assert _switch.switch(targets, make, "stand-in") == [
                "msda_stand_in_client.works.attention"]
        works = importlib.import_module("msda_stand_in_client.works")
        assert works.attention(None) == "pymsda"
        message = " ".join(str(w.message) for w in warned)
        assert "msda_stand_in_client.broken: RuntimeError: operator torchvision::nms" in message
        assert "absent_model" not in message  # an ImportError: a model this version lacks
    finally:
        assert _switch.restore(targets) == ["msda_stand_in_client.works.attention"]
        for key in [k for k in sys.modules if k.startswith("msda_stand_in_client")]:
            del sys.modules[key]
    assert works.attention(None) == "own"



# ---- transformers' kernel layer ---------------------------------------------------------------

def _own_forward(self, value, value_spatial_shapes, value_spatial_shapes_list,
                 level_start_index, sampling_locations, attention_weights, im2col_step):
    return "transformers' own"


def kernel_layer_module():
    """A stand-in for a transformers modeling module: its MultiScaleDeformableAttention kernel
    layer (no weights; the kernel layer's forward)."""
    module = types.ModuleType("msda_stand_in_modeling")
    module.MultiScaleDeformableAttention = type(
        "MultiScaleDeformableAttention", (torch.nn.Module,), {"forward": _own_forward})
    return module


def test_transformers_uninstall_turns_layers_built_while_installed_back(monkeypatch):
    module = kernel_layer_module()
    own_class = module.MultiScaleDeformableAttention
    monkeypatch.setattr(transformers, "_TARGETS", [(module, "MultiScaleDeformableAttention")])
    assert transformers.install() == ["msda_stand_in_modeling.MultiScaleDeformableAttention"]
    try:
        model = torch.nn.Sequential(module.MultiScaleDeformableAttention()).eval()
        copied = copy.deepcopy(model)
        layers = [model[0], copied[0]]
        assert all(isinstance(m, transformers.MultiScaleDeformableAttention) for m in layers)
    finally:
        assert transformers.uninstall() == [
            "msda_stand_in_modeling.MultiScaleDeformableAttention"]
    assert module.MultiScaleDeformableAttention is own_class
    assert all(type(m) is own_class and not m.training for m in layers)
    assert model[0](*[None] * 7) == "transformers' own"


def test_transformers_uninstall_gives_layers_that_copied_the_function_its_original_back(
        monkeypatch):
    """A stand-in for D-FINE's modeling module: its attention layer copies the module-level
    multi_scale_deformable_attention_v2 into itself when built."""
    module = types.ModuleType("msda_stand_in_modeling_v2")

    def multi_scale_deformable_attention_v2(*args):
        return "transformers' own"
    module.multi_scale_deformable_attention_v2 = own = multi_scale_deformable_attention_v2

    class Attention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ms_deformable_attn_core = module.multi_scale_deformable_attention_v2
    name = "msda_stand_in_modeling_v2.multi_scale_deformable_attention_v2"
    monkeypatch.setattr(transformers, "_TARGETS", [(module, own.__name__)])
    assert transformers.install() == [name]
    try:
        layers = [Attention()]
        layers.append(copy.deepcopy(layers[0]))
        assert all(m.ms_deformable_attn_core is not own for m in layers)
    finally:
        assert transformers.uninstall() == [name]
    assert all(m.ms_deformable_attn_core is own for m in layers)
    assert module.multi_scale_deformable_attention_v2 is own


def test_restore_kernel_layers_puts_back_the_layers_replaced():
    module = kernel_layer_module()
    model = torch.nn.ModuleDict({"a": module.MultiScaleDeformableAttention(),
                                 "b": torch.nn.Sequential(module.MultiScaleDeformableAttention(),
                                                          torch.nn.Linear(2, 2))})
    own = [model["a"], model["b"][0]]
    assert transformers.replace_kernel_layers(model) == 2
    assert isinstance(model["a"], transformers.MultiScaleDeformableAttention)
    model.eval()
    assert transformers.restore_kernel_layers(model) == 2
    assert model["a"] is own[0] and model["b"][0] is own[1]
    assert not any(m.training for m in own)
    assert transformers.restore_kernel_layers(model) == 0


# ---- Deformable DETR's compiled extension (pymsda.compat.install) ----------------------------

EXTENSION = "MultiScaleDeformableAttention"
SYS_MODULES_ENTRY = "sys.modules['MultiScaleDeformableAttention']"


@pytest.fixture
def no_extension(monkeypatch):
    """No module named MultiScaleDeformableAttention in sys.modules; the test's end puts back
    what was there (or nothing), whatever the test leaves."""
    monkeypatch.setitem(sys.modules, EXTENSION, None)
    monkeypatch.delitem(sys.modules, EXTENSION)


def importing_client(monkeypatch):
    """A stand-in for Deformable DETR's ms_deform_attn_func.py, which imports the extension as
    MSDA at its top."""
    client = types.ModuleType("msda_stand_in_ms_deform_attn_func")
    monkeypatch.setitem(sys.modules, client.__name__, client)
    exec("import MultiScaleDeformableAttention as MSDA", client.__dict__)
    return client


def test_uninstall_puts_back_the_extension_imported_before(monkeypatch, no_extension):
    compiled = types.ModuleType(EXTENSION)  # the compiled extension, imported before install()
    sys.modules[EXTENSION] = compiled
    user = types.ModuleType("msda_stand_in_user")  # code that imports pymsda's module by name
    user.extension = pymsda.compat.extension
    monkeypatch.setitem(sys.modules, user.__name__, user)
    assert pymsda.compat.install() == [SYS_MODULES_ENTRY] == pymsda.compat.install()  # (again)
    installed = sys.modules[EXTENSION]
    assert installed.ms_deform_attn_forward is pymsda.compat.extension.ms_deform_attn_forward
    client = importing_client(monkeypatch)
    assert client.MSDA is installed
    assert pymsda.compat.uninstall() == [SYS_MODULES_ENTRY,
                                         "msda_stand_in_ms_deform_attn_func.MSDA"]
    assert sys.modules[EXTENSION] is compiled and client.MSDA is compiled
    assert user.extension is pymsda.compat.extension
    assert pymsda.compat.uninstall() == []


def test_uninstall_imports_the_extension_installed_but_not_imported(tmp_path, monkeypatch,
                                                                    no_extension):
    (tmp_path / (EXTENSION + ".py")).write_text("COMPILED_STAND_IN = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    pymsda.compat.install()
    client = importing_client(monkeypatch)
    assert pymsda.compat.uninstall() == [SYS_MODULES_ENTRY,
                                         "msda_stand_in_ms_deform_attn_func.MSDA"]
    assert client.MSDA.COMPILED_STAND_IN and sys.modules[EXTENSION] is client.MSDA


def test_uninstall_says_which_names_keep_pymsda_where_no_extension_imports(monkeypatch,
                                                                           no_extension):
    pymsda.compat.install()
    client = importing_client(monkeypatch)
    with pytest.warns(UserWarning, match=r"msda_stand_in_ms_deform_attn_func\.MSDA keep "
                                         r"pymsda's module.*ModuleNotFoundError"):
        assert pymsda.compat.uninstall() == [SYS_MODULES_ENTRY]
    assert EXTENSION not in sys.modules
    assert client.MSDA.ms_deform_attn_backward is pymsda.compat.extension.ms_deform_attn_backward

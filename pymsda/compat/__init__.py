"""Drop-in replacements for the MSDA entry points of other projects, on pymsda's kernels.

Switching is a one-line change of an import (see docs/compat.md): each module
keeps the names, argument names and order, output shapes and dtypes of the project it mirrors,
and modules keep their parameter names, so checkpoints load unchanged.

    deformable_detr  Deformable DETR: MSDeformAttnFunction, ms_deform_attn_core_pytorch,
                     MSDeformAttn; install() / uninstall() (here) for
                     `import MultiScaleDeformableAttention as MSDA`
    mmcv             MultiScaleDeformableAttnFunction, multi_scale_deformable_attn_pytorch,
                     and mmcv's MultiScaleDeformableAttention module (registered in mmengine's
                     MODELS where mmcv has no compiled ops, e.g. mmcv-lite, when this module is
                     imported and by install(); uninstall() removes the entry)
    transformers     the MultiScaleDeformableAttention kernel layer of HF transformers,
                     replace_kernel_layers(model) to put it into a built transformers model,
                     and install() / uninstall() (the kernel layer of models built afterwards,
                     RT-DETRv2's, D-FINE's, Mask2Former's and OneFormer's functions)
    ultralytics      install() / uninstall(): Ultralytics RT-DETR's MSDeformAttn
    rfdetr           install() / uninstall(): RF-DETR's MSDeformAttn (and LW-DETR's, given its
                     module), value in their (batch, heads, head_dim, S) layout
    groundingdino    install() / uninstall(): rf-groundingdino's module-level
                     multi_scale_deformable_attn_pytorch
    rtdetr           RT-DETR's deformable_attention_core_func, RT-DETRv2's
                     deformable_attention_core_func_v2 and its MSDeformableAttention module
    paddle           ms_deformable_attn, the Paddle RT-DETR ext_op's call shape, on torch
                     tensors (and deformable_attention_core_func, its fallback's name)

The *_pytorch functions of deformable_detr and mmcv run the pure-PyTorch reference (grid_sample),
as their originals do; everything else runs pymsda's C/CUDA kernels (the *_pytorch functions of
ultralytics, rfdetr and groundingdino included: install() puts them in the originals' place).

Each drop-in is imported when it is first named (`import pymsda.compat.mmcv`, `from pymsda.compat
import transformers`, `pymsda.compat.rtdetr`), not by `import pymsda.compat`: importing one costs
its own imports and may change another library (pymsda.compat.mmcv registers its module in
mmengine's MODELS), which only the code that names it asked for.
"""
import functools
import importlib
import sys
import types
import warnings

from . import _switch

# the drop-ins, each imported by __getattr__ below when first named (extension: what install()
# serves under the extension's name)
_DROP_INS = ("deformable_detr", "mmcv", "transformers", "rtdetr", "paddle", "ultralytics",
             "rfdetr", "groundingdino", "extension")

__all__ = [name for name in _DROP_INS if name != "extension"] + ["install", "uninstall"]

EXTENSION_NAME = "MultiScaleDeformableAttention"
_ENTRY = "sys.modules[%r]" % EXTENSION_NAME  # the name install() switches


def __getattr__(name):
    if name in _DROP_INS:  # (the import binds it here, so this runs once per drop-in)
        return importlib.import_module("." + name, __name__)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))


def __dir__():
    return sorted(set(globals()) | set(_DROP_INS))


class _ExtensionAlias(types.ModuleType):
    """pymsda.compat.extension under the extension's name: every attribute read or written is
    the extension module's. A distinct object, so that uninstall() finds the names bound by
    `import MultiScaleDeformableAttention` while installed, and no other."""

    def __init__(self, extension):
        super().__init__(EXTENSION_NAME, extension.__doc__)
        types.ModuleType.__setattr__(self, "_extension", extension)  # (its one own attribute)

    def __getattr__(self, name):
        return getattr(self._extension, name)

    def __setattr__(self, name, value):
        setattr(self._extension, name, value)

    def __dir__(self):
        return dir(self._extension)


@functools.lru_cache(maxsize=None)
def _alias():
    """The one _ExtensionAlias, made by the first install() (which imports the extension's
    drop-in)."""
    return _ExtensionAlias(importlib.import_module(".extension", __name__))


# while installed: [what sys.modules held under EXTENSION_NAME before install(), or None]
_held_before = []


def install():
    """Makes `import MultiScaleDeformableAttention as MSDA` give pymsda's implementation of
    Deformable DETR's compiled extension (MSDA.ms_deform_attn_forward and
    MSDA.ms_deform_attn_backward), so unmodified code that imports it runs on pymsda.

    Call it before the code that imports the extension is imported; it replaces any module of
    that name already in sys.modules (uninstall() puts it back). Returns the names switched, as
    every install() of pymsda.compat does: ["sys.modules['MultiScaleDeformableAttention']"]
    (the module: sys.modules["MultiScaleDeformableAttention"], what the import gives)."""
    if sys.modules.get(EXTENSION_NAME) is not _alias():
        _held_before[:] = [sys.modules.get(EXTENSION_NAME)]
        sys.modules[EXTENSION_NAME] = _alias()
    return [_ENTRY]


def _names_of_installed():
    """(module's name, module, attribute) for every module-level name that holds the module
    install() put under the extension's name (the `MSDA` of code that imported it while
    installed)."""
    names, alias = [], _alias()
    for name, module in list(sys.modules.items()):
        namespace = getattr(module, "__dict__", None)
        if name.split(".")[0] != "pymsda" and isinstance(namespace, dict):  # (users' code only)
            names += [(name, module, key) for key, value in list(namespace.items())
                      if value is alias]
    return names


def uninstall():
    """Undoes install(): sys.modules holds again what it held under MultiScaleDeformableAttention
    before (or nothing), so a later import finds Deformable DETR's compiled extension where it
    is installed, and the module-level names bound to pymsda's module by an import while
    installed (Deformable DETR's `MSDA`) are bound to that extension. Where the extension cannot
    be imported, those names keep pymsda's module (a warning names them). Returns the names
    restored."""
    if not _held_before:
        return []
    held_before = _held_before.pop()
    if sys.modules.get(EXTENSION_NAME) is _alias():
        if held_before is None:
            del sys.modules[EXTENSION_NAME]
        else:
            sys.modules[EXTENSION_NAME] = held_before
    restored = [_ENTRY]
    original, failures = held_before, []
    if original is None:
        original = _switch._module(EXTENSION_NAME, failures)
    bound = _names_of_installed()
    names = ["%s.%s" % (name, attribute) for name, _, attribute in bound]
    if original is not None:
        for _, module, attribute in bound:
            setattr(module, attribute, original)
        return restored + names
    if names:
        warnings.warn("pymsda.compat.uninstall(): %s keep pymsda's module: Deformable DETR's "
                      "extension does not import here (%s); re-import that code once it does"
                      % (", ".join(names), _switch.failure_text(*failures[0])), stacklevel=2)
    return restored

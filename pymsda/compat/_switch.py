"""Switching another project's MSDA to pymsda where that project looks it up: the install() and
uninstall() of pymsda.compat.ultralytics, .rfdetr and .transformers.

A switch replaces one module attribute (a function the project calls by its module-level name,
or the class it builds a layer from) and remembers the original, so uninstall() restores exactly
what was there. Switching twice changes nothing; a function replaced here hands the call back to
the original while a tracer or exporter runs (see exporting()), so the project's export path
records the project's own code.
"""
import functools
import importlib
import warnings

import torch

from .._torch_private import script_unsupported_because as _script_unsupported

# (module name, attribute) -> (the project's original, what replaced it)
_SWITCHED = {}


def exporting():
    """Whether a tracer or exporter is recording the call: torch.jit.trace (which
    torch.onnx.export's TorchScript exporter and coremltools use), an ONNX export, or
    torch.export (which the dynamo ONNX exporter uses). torch.compile is not an export: pymsda's
    registered op traces under it."""
    if torch.jit.is_tracing():
        return True
    onnx_export = getattr(getattr(torch, "onnx", None), "is_in_onnx_export", None)
    if onnx_export is not None and onnx_export():
        return True
    is_exporting = getattr(getattr(torch, "compiler", None), "is_exporting", None)
    return bool(is_exporting is not None and is_exporting())


def routed(original, replacement):
    """A function with original's name, signature and docstring that runs replacement, or the
    original while exporting()."""
    @functools.wraps(original)
    def function(*args, **kwargs):
        if exporting():
            return original(*args, **kwargs)
        return replacement(*args, **kwargs)
    return _script_unsupported(function, "switched to pymsda by install(); uninstall() restores "
                               "the project's own")


def _module(module_or_name):
    if not isinstance(module_or_name, str):
        return module_or_name
    try:
        return importlib.import_module(module_or_name)
    except ImportError:  # the project (or this model of it) is not installed
        return None


def switch(targets, make, project):
    """Replaces each (module or module name, attribute) in targets that exists with
    make(original, module) (None from make: leave it). Returns the qualified names of the
    attributes now switched, the ones switched before included; warns when there is none."""
    switched = []
    for module_or_name, attribute in targets:
        module = _module(module_or_name)
        if module is None or not hasattr(module, attribute):
            continue
        key = (module.__name__, attribute)
        current = getattr(module, attribute)
        if key in _SWITCHED and _SWITCHED[key][1] is current:
            switched.append("%s.%s" % key)
            continue
        replacement = make(current, module)
        if replacement is None:
            continue
        _SWITCHED[key] = (current, replacement)
        setattr(module, attribute, replacement)
        switched.append("%s.%s" % key)
    if not switched:
        warnings.warn("pymsda.compat: found no MSDA of %s to switch (is it installed, and is "
                      "this version's MSDA where pymsda looks: %s?)"
                      % (project, ", ".join("%s.%s" % (getattr(m, "__name__", m), a)
                                            for m, a in targets)), stacklevel=3)
    return switched


def restore(targets):
    """Puts the originals back where switch() replaced them (and the replacement is still
    there). Returns the qualified names restored."""
    restored = []
    for module_or_name, attribute in targets:
        name = module_or_name if isinstance(module_or_name, str) else module_or_name.__name__
        key = (name, attribute)
        if key not in _SWITCHED:
            continue
        original, replacement = _SWITCHED.pop(key)
        module = _module(module_or_name)
        if module is not None and getattr(module, attribute, None) is replacement:
            setattr(module, attribute, original)
            restored.append("%s.%s" % key)
    return restored


def original_of(module_name, attribute):
    """The project's own object that a switch replaced, or None."""
    entry = _SWITCHED.get((module_name, attribute))
    return entry[0] if entry else None

"""Switching another project's MSDA to pymsda where that project looks it up: the install() and
uninstall() of pymsda.compat.ultralytics, .rfdetr, .transformers and .groundingdino.

A switch replaces one module attribute (a function the project calls by its module-level name,
or the class it builds a layer from) and remembers the original, so uninstall() restores exactly
what was there. Switching twice changes nothing; a function replaced here hands the call back to
the original while a tracer or exporter runs (see exporting()), so the project's export path
records the project's own code. A project whose import fails here, with ImportError or anything
else, is reported by a warning and left as it is: install() never raises for it.
"""
import functools
import importlib
import warnings

from .._torch_private import EXPORT, JIT_TRACE, ONNX, recording
from .._torch_private import script_unsupported_because as _script_unsupported
from .._trace import options as _onnx_options

# (module name, attribute) -> (the project's original, what replaced it)
_SWITCHED = {}


def exporting():
    """Whether a tracer or exporter is recording the call: torch.jit.trace (which
    torch.onnx.export's TorchScript exporter and coremltools use), an ONNX export, or
    torch.export (which the dynamo ONNX exporter uses). torch.compile is not an export: pymsda's
    registered op traces under it. Nor is an ONNX export inside
    pymsda.export.onnx_options(onnxruntime=True): the node of pymsda's ONNX Runtime op, which
    only pymsda's code records, is what was asked for."""
    recorder = recording()
    if recorder & ONNX and _onnx_options.onnxruntime:
        return False
    return bool(recorder & (JIT_TRACE | ONNX | EXPORT))


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


def _module(module_or_name, failures=None):
    """The module (imported if named), or None when its import fails: an ImportError (the
    project, or this model of it, is not installed) or anything else the project's own import
    raises here (e.g. RuntimeError from a torchvision built for another torch). Each failure is
    appended to failures as (name, error)."""
    if not isinstance(module_or_name, str):
        return module_or_name
    try:
        return importlib.import_module(module_or_name)
    except Exception as error:  # the project's failure, reported by switch(), never raised
        if failures is not None:
            failures.append((module_or_name, error))
        return None


def failure_text(name, error):
    """'name: ErrorType: first line of the message' (for a warning)."""
    first_line = (str(error).splitlines() or [""])[0][:200]
    return "%s: %s: %s" % (name, type(error).__name__, first_line)


def switch(targets, make, project):
    """Replaces each (module or module name, attribute) in targets that exists with
    make(original, module) (None from make: leave it). Returns the qualified names of the
    attributes now switched, the ones switched before included. Never raises for the project's
    own import: warns when nothing is switched (naming the first import failure), and names the
    modules whose import raised something other than ImportError when others were switched."""
    switched, failures = [], []
    for module_or_name, attribute in targets:
        module = _module(module_or_name, failures)
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
        cause = "; importing %s" % failure_text(*failures[0]) if failures else ""
        warnings.warn("pymsda.compat: found no MSDA of %s to switch%s (is it installed, and "
                      "is this version's MSDA where pymsda looks: %s?)"
                      % (project, cause, ", ".join("%s.%s" % (getattr(m, "__name__", m), a)
                                                   for m, a in targets)), stacklevel=3)
        return switched
    broken = [failure_text(*f) for f in failures if not isinstance(f[1], ImportError)]
    if broken:
        warnings.warn("pymsda.compat: switched %s's MSDA in %d place(s), but these modules "
                      "failed to import and keep their own: %s"
                      % (project, len(switched), "; ".join(broken)), stacklevel=3)
    return switched


def restore(targets, undo=None):
    """Puts the originals back where switch() replaced them (and the replacement is still
    there), calling undo(original, replacement) for each. Returns the qualified names
    restored."""
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
            if undo is not None:
                undo(original, replacement)
    return restored


def routed_switch(targets, replacement, project):
    """install() and uninstall() for a project that calls its MSDA by the module-level names in
    targets: install switches each to a routed(original, replacement) (the project's own code
    while a tracer records), uninstall puts the originals back."""
    def install():
        return switch(targets, lambda original, module: routed(original, replacement), project)

    def uninstall():
        return restore(targets)

    install.__doc__ = (f"Switches the MSDA of {project} to pymsda; returns the names switched "
                       f"(a warning when {project} cannot be imported or has no such name).")
    uninstall.__doc__ = f"Restores the own MSDA of {project}; returns the names restored."
    return install, uninstall

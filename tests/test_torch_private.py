"""The private torch API pymsda uses (pymsda/_torch_private.py): the running torch still has
each attribute it is checked from, and nothing else in the package reads a private torch name.

A failure here names the attribute a torch release removed: pymsda still runs (each use has its
fallback, asserted below), but slower or with less, until _torch_private.py follows the change.
"""
import ast
import os

import pytest
import torch

import pymsda
from pymsda import _torch_private
from conftest import expects_torchscript_deprecation

PACKAGE = os.path.dirname(os.path.abspath(pymsda.__file__))


@pytest.mark.parametrize("path", list(_torch_private.CHECKED))
def test_running_torch_has_each_private_attribute_pymsda_uses(path):
    since, needs = _torch_private.CHECKED[path]
    if torch.__version__ < since:
        pytest.skip(f"checked from torch {'.'.join(map(str, since))}; this is {torch.__version__}")
    if needs == "cuda" and torch.version.cuda is None:
        pytest.skip(f"{path} is in CUDA builds of torch only")
    assert _torch_private.lookup(path) is not None, (
        f"torch {torch.__version__} has no {path}, which pymsda/_torch_private.py uses: "
        "update it to this release")


def test_private_accessors_answer_with_or_without_the_private_api(monkeypatch):
    # the fallbacks: what each accessor gives where its attribute is missing
    assert _torch_private._public_tracing_state() is None  # not tracing here
    assert _torch_private.jit_tracing_state() is None
    assert _torch_private.dispatch_mode_depth() == 0
    assert _torch_private.recording() == 0  # nothing records here
    monkeypatch.setattr(_torch_private, "functorch_active", None)
    assert _torch_private.direct_apply(torch.autograd.Function) is None
    monkeypatch.setattr(_torch_private, "_storage_use_count", None)
    assert _torch_private.storage_use_count(torch.UntypedStorage(8)) is None
    monkeypatch.setattr(_torch_private, "_register_builtin", None)
    assert _torch_private.register_script_builtin(len, "pymsda::none") is False


@expects_torchscript_deprecation
def test_script_unsupported_reaches_torch_jit_script():
    def helper(x):
        return x
    _torch_private.script_unsupported_because(helper, "a test helper")
    with pytest.raises(RuntimeError, match="a test helper"):
        torch.jit.script(helper)


def _private_torch_names(path):
    """(line, dotted name) of every torch.<...>._private attribute read in a source file."""
    tree = ast.parse(open(path).read())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            parts, inner = [node.attr], node.value
            while isinstance(inner, ast.Attribute):
                parts.append(inner.attr)
                inner = inner.value
            if isinstance(inner, ast.Name) and inner.id == "torch":
                dotted = ["torch"] + parts[::-1]
                if any(p.startswith("_") and not p.startswith("__") for p in dotted[1:]):
                    found.append((node.lineno, ".".join(dotted)))
        elif isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr":
            target = node.args[0] if node.args else None
            name = node.args[1] if len(node.args) > 1 else None
            if (isinstance(name, ast.Constant) and isinstance(name.value, str)
                    and name.value.startswith("_") and isinstance(target, ast.Attribute)
                    and isinstance(target.value, ast.Name) and target.value.id == "torch"):
                found.append((node.lineno, f"torch.{target.attr}.{name.value}"))
    return found


def test_no_module_but_torch_private_reads_private_torch_names():
    offenders = []
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            path = os.path.join(root, name)
            if not name.endswith(".py") or path == _torch_private.__file__:
                continue
            offenders += [f"{os.path.relpath(path, PACKAGE)}:{line}: {dotted}"
                          for line, dotted in _private_torch_names(path)]
    assert not offenders, "private torch API outside pymsda/_torch_private.py:\n" + "\n".join(
        offenders)

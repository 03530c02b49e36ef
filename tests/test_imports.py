"""tests/test_imports.py: how the modules of the package import each other.

What a module offers its neighbours is a plain name (`_args.prepare`, not `_plan._prepare`): an
underscore still means "used in this file only", so a name imported from another pymsda module
never starts with one. And the imports run one way, from the public op down to the ctypes table
(pymsda/_clib.py): no module imports, at its top level, one that imports it back.
"""
import ast
import os

import pymsda

PACKAGE = os.path.dirname(os.path.abspath(pymsda.__file__))


def _modules():
    """{dotted name: parsed source} of every module of the package."""
    modules = {}
    for root, _, files in os.walk(PACKAGE):
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(root, name)
                parts = os.path.relpath(path, os.path.dirname(PACKAGE))[:-3].split(os.sep)
                if parts[-1] == "__init__":
                    parts.pop()
                with open(path) as f:
                    modules[".".join(parts)] = (path, ast.parse(f.read()))
    return modules


def _imported_from(module, node, modules):
    """The pymsda module a `from ... import` statement of module reads from, or None."""
    if node.level == 0:
        return node.module if node.module and node.module.split(".")[0] == "pymsda" else None
    is_package = os.path.basename(modules[module][0]) == "__init__.py"
    base = module.split(".")[:len(module.split(".")) + (1 if is_package else 0) - node.level]
    return ".".join(base + ([node.module] if node.module else []))


def test_no_module_imports_an_underscore_name_of_another():
    modules = _modules()
    offenders = []
    for module, (path, tree) in modules.items():
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            source = _imported_from(module, node, modules)
            if source is None or source == module:
                continue
            for alias in node.names:
                private = alias.name.startswith("_") and not alias.name.startswith("__")
                if private and f"{source}.{alias.name}" not in modules:  # (a module is no name)
                    offenders.append(f"{os.path.relpath(path, PACKAGE)}:{node.lineno}: "
                                     f"from {source} import {alias.name}")
    assert not offenders, ("underscore names imported from another pymsda module (make what a "
                           "module offers its neighbours a plain name):\n" + "\n".join(offenders))


def _top_level_imports(module, tree, modules):
    """The pymsda modules `module` imports when it is imported (not inside its functions)."""
    found = set()
    statements = list(tree.body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.If, ast.Try)):
            statements += node.body + node.orelse + getattr(node, "finalbody", [])
            for handler in getattr(node, "handlers", []):
                statements += handler.body
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name in modules}
        elif isinstance(node, ast.ImportFrom):
            source = _imported_from(module, node, modules)
            if source is None:
                continue
            submodules = {f"{source}.{alias.name}" for alias in node.names}
            found |= (submodules & modules.keys()) or ({source} & modules.keys())
    return found - {module}


def test_imports_run_one_way():
    modules = _modules()
    imports = {module: _top_level_imports(module, tree, modules)
               for module, (_, tree) in modules.items()}
    done, on_path = set(), []

    def visit(module):
        if module in on_path:
            circle = on_path[on_path.index(module):] + [module]
            raise AssertionError("pymsda modules import each other: " + " -> ".join(circle))
        if module in done:
            return
        on_path.append(module)
        for imported in sorted(imports[module]):
            visit(imported)
        on_path.pop()
        done.add(module)

    for module in sorted(modules):
        visit(module)
    assert imports["pymsda._clib"] == set(), "the ctypes table imports nothing of pymsda"

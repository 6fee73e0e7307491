"""The import rule for plugins: draftflow is used only through its public modules.

A plugin may import ``draftflow.plugin`` (the plugin API), ``draftflow.layers`` (model
building blocks) and modules of its own package. Every other ``draftflow.*`` module
(``draftflow.core.node``, another plugin's ``model``) is private: it may change under the
plugin without notice, and a built-in plugin reaching into another one is how the hidden
contracts of issue 17 grew. A name with a leading underscore, imported from draftflow or
from another module of the plugin's own package, is private too. Other libraries' imports
(``torch._inductor``) are not this rule's business.

``import_violations`` reads one module's source with ``ast`` (nothing is imported);
tests/test_plugin_imports.py applies it to every file of the built-in plugins and the
examples, and ``plugin_import_check`` applies it at ``draftflow check`` time to the modules
that registered each node of a graph, and the modules of their own package those import.
"""

from __future__ import annotations

import ast
import importlib.util
import os
import sys
from functools import lru_cache

import attrs

from draftflow.core.problems import Problem

PUBLIC = ("draftflow.plugin", "draftflow.layers")
# Listed at most this many per problem line; the rest are counted.
SHOWN = 3


@attrs.frozen
class Violation:
    """One import a plugin may not make: ``module`` itself, or private ``name`` from it."""

    line: int
    module: str
    name: str = ""

    def render(self) -> str:
        return f"private name {self.name!r} from {self.module}" if self.name else self.module


def own_package(module: str) -> str:
    """The package a module belongs to: ``draftflow.plugins.<x>`` for a built-in plugin, else its top level."""
    parts = module.split(".")
    return ".".join(parts[:3]) if parts[:2] == ["draftflow", "plugins"] else parts[0]


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_allowed(module: str, own: str) -> bool:
    if module != "draftflow" and not module.startswith("draftflow."):
        return True  # not draftflow's: not this rule's business
    if any(_is_private(part) for part in module.split(".")):
        return False
    return module == "draftflow" or any(module == p or module.startswith(p + ".") for p in (*PUBLIC, own))


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str | None:
    """The absolute module of ``from X import ...`` (relative levels resolved), None if it leaves the top level."""
    if not node.level:
        return node.module
    parts = module.split(".") if is_package else module.split(".")[:-1]
    if node.level - 1 > len(parts) - 1:
        return None
    base = parts[: len(parts) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def scan(source: str, module: str, is_package: bool = False) -> tuple[list[Violation], list[str]]:
    """(violations, modules of the same package it imports) for ``module``'s source."""
    own = own_package(module)
    bad: list[Violation] = []
    local: list[str] = []

    def visit(imported: str, line: int) -> None:
        if not _module_allowed(imported, own):
            bad.append(Violation(line, imported))
        elif imported == own or imported.startswith(own + "."):
            local.append(imported)

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                visit(alias.name, node.lineno)
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(node, module, is_package)
            if base is None:
                continue
            ours = base == "draftflow" or base.startswith("draftflow.") or base == own or base.startswith(own + ".")
            for alias in node.names:
                if base in ("draftflow", "draftflow.plugins") or (base == own and not _is_private(alias.name)):
                    # `from draftflow import core`, `from . import model`: the names may be modules
                    if not (alias.name.startswith("__") or alias.name == "*"):
                        visit(f"{base}.{alias.name}", node.lineno)
                    continue
                visit(base, node.lineno)
                if ours and base != module and _is_private(alias.name):
                    bad.append(Violation(node.lineno, base, alias.name))
    unique = list(dict.fromkeys(bad))
    return sorted(unique, key=lambda v: (v.line, v.module, v.name)), list(dict.fromkeys(local))


def import_violations(source: str, module: str, is_package: bool = False) -> list[Violation]:
    """The imports of ``module`` (given as source text) that break the rule, in line order."""
    return scan(source, module, is_package)[0]


@lru_cache(maxsize=512)
def _scan_file(path: str, module: str, mtime_ns: int) -> tuple[tuple[Violation, ...], tuple[str, ...]]:
    try:
        with open(path, encoding="utf-8") as f:
            source = f.read()
        bad, local = scan(source, module, os.path.basename(path) == "__init__.py")
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError):
        return (), ()  # not readable as Python source: the import itself already worked, nothing to judge
    return tuple(bad), tuple(local)


def _source_path(module: str) -> str | None:
    loaded = sys.modules.get(module)
    path = getattr(loaded, "__file__", None) if loaded is not None else None
    if path is None and loaded is None:
        try:
            spec = importlib.util.find_spec(module)
        except (ImportError, ValueError, AttributeError):
            return None
        path = spec.origin if spec is not None else None
    return path if isinstance(path, str) and path.endswith(".py") and os.path.isfile(path) else None


def module_violations(start: tuple[str, ...]) -> list[tuple[str, str, Violation]]:
    """(module, file, violation) for ``start`` and every module of their own packages they import."""
    found, todo, seen = [], list(start), set()
    while todo:
        module = todo.pop(0)
        if module in seen:
            continue
        seen.add(module)
        path = _source_path(module)
        if path is None:
            continue
        bad, local = _scan_file(path, module, os.stat(path).st_mtime_ns)
        found.extend((module, path, v) for v in bad)
        todo.extend(local)
    return found


def _modules_of(node_type, entry_modules: dict[str, str]) -> tuple[str, ...]:
    """The modules a node type came from: its plugin's entry module and where its functions are defined."""
    names = [entry_modules.get(node_type.plugin, "")]
    for fn in (node_type.factory, node_type.manifest, node_type.target_info):
        names.append(getattr(fn, "__module__", None) or "")
    return tuple(dict.fromkeys(n for n in names if n and n != "builtins"))


def plugin_import_check(registry):
    """A check: one ``plugin-import`` problem per node whose plugin imports a private draftflow module or name."""
    entry_modules = {info.name: info.module.partition(":")[0] for info in registry.plugins}

    def check(plan):
        nodes = [(n, r.node_type) for n, r in plan.nodes.items()] + [(n, u.node_type) for n, u in plan.unresolved.items()]
        for name, node_type in nodes:
            found = module_violations(_modules_of(node_type, entry_modules))
            if not found:
                continue
            shown = [f"{v.render()} ({os.path.basename(path)}:{v.line})" for _, path, v in found[:SHOWN]]
            more = f" and {len(found) - SHOWN} more" if len(found) > SHOWN else ""
            spec = plan.spec.node(name)
            yield Problem(name, "plugin-import",
                          f"plugin {node_type.plugin!r} imports {', '.join(shown)}{more}, private to draftflow "
                          f"(it may change without notice)",
                          "import what a plugin needs from draftflow.plugin (model building blocks from draftflow.layers) "
                          "and ask the plugin's author to do the same",
                          node_type.name, spec.where if spec else "")

    return check

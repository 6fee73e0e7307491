"""Plugins use draftflow only through draftflow.plugin and draftflow.layers; core never pokes at nodes.

The rule (core/plugin_rules.py): a plugin file may import ``draftflow.plugin``,
``draftflow.layers[.x]`` and its own package (``draftflow.plugins.<its folder>``), and no
name with a leading underscore from another module. Every plugin file is its own test, so a
failure names the file; ``draftflow check`` applies the same rule to third-party plugins.
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest

from draftflow.core.plugin_rules import import_violations

ROOT = Path(__file__).resolve().parents[1]
SKIP_DIRS = {"build", "__pycache__"}


def _module_name(path: Path) -> str:
    """The name the file is imported under: draftflow.plugins.X.Y, or its name below the example's project folder."""
    rel = path.relative_to(ROOT)
    if rel.parts[0] == "plugins":
        parts = ("draftflow",) + rel.with_suffix("").parts
    elif rel.parts[0] == "docs":  # docs/examples/NAME.py, or docs/examples/PROJECT/PACKAGE/MODULE.py
        parts = rel.with_suffix("").parts[2:] if len(rel.parts) == 3 else rel.with_suffix("").parts[3:]
    else:
        parts = (path.stem,)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _plugin_files() -> list[Path]:
    found = [ROOT / "tests" / "toy_plugins.py"]
    for top in (ROOT / "plugins", ROOT / "docs" / "examples"):
        found += [p for p in sorted(top.rglob("*.py"))
                  if not SKIP_DIRS & set(p.relative_to(top).parts) and not any(s.endswith(".egg-info") for s in p.parts)]
    return found


FILES = _plugin_files()


def test_every_plugin_folder_is_scanned():
    """The scan sees every built-in plugin folder and the examples (a moved folder cannot drop out silently)."""
    folders = {p.relative_to(ROOT).parts[1] for p in FILES if p.relative_to(ROOT).parts[0] == "plugins" and len(p.relative_to(ROOT).parts) > 2}
    assert {"target", "verifier", "lookup", "mixer", "oracle", "mtp", "dflash"} <= folders, folders
    assert any("docs" in p.parts for p in FILES)


@pytest.mark.parametrize("path", FILES, ids=[str(p.relative_to(ROOT)) for p in FILES])
def test_plugin_imports_only_public_draftflow(path):
    """A plugin file imports draftflow.plugin, draftflow.layers and its own package only, and no private names."""
    module = _module_name(path)
    bad = import_violations(path.read_text(), module, path.name == "__init__.py")
    lines = [f"{path.relative_to(ROOT)}:{v.line}: imports {v.render()}" for v in bad]
    assert not lines, (f"{len(lines)} import(s) of private draftflow code (module {module}); import from draftflow.plugin "
                       "or draftflow.layers instead:\n" + "\n".join(lines))


@pytest.mark.parametrize("source, module, expected", [
    ("from draftflow.core.node import Node", "draftflow.plugins.mixer.plugin", ["draftflow.core.node"]),
    ("import draftflow.core.manifest as m", "acme.plugin", ["draftflow.core.manifest"]),
    ("from draftflow.plugins.target.model import TargetModel", "draftflow.plugins.dflash.plugin", ["draftflow.plugins.target.model"]),
    ("from ..target import model", "draftflow.plugins.dflash.plugin", ["draftflow.plugins.target"]),
    ("from draftflow import core", "acme.plugin", ["draftflow.core"]),
    ("from draftflow.plugins import target", "acme.plugin", ["draftflow.plugins.target"]),
    ("from draftflow.verify import sample", "acme.plugin", ["draftflow.verify"]),
    ("from draftflow.layers.rope import _rotate", "draftflow.plugins.dflash.model", ["private name '_rotate' from draftflow.layers.rope"]),
    ("from draftflow.plugin import _x", "acme", ["private name '_x' from draftflow.plugin"]),
    ("from .config import _Getter", "draftflow.plugins.dflash.loader", ["private name '_Getter' from draftflow.plugins.dflash.config"]),
    ("def f():\n    from draftflow.core.errors import SpecError", "acme", ["draftflow.core.errors"]),
    ("from draftflow.plugin import Node, hookimpl\nimport draftflow.plugin as api", "acme.plugin", []),
    ("from draftflow.layers.rope import rotate as _rotate\nimport draftflow.layers.norm", "draftflow.plugins.mtp.model", []),
    ("from draftflow.plugins.dflash.config import kv_shape\nfrom . import model\nfrom .loader import read_config",
     "draftflow.plugins.dflash.plugin", []),
    ("from draftflow import __version__, plugin, layers", "acme", []),
    ("import torch._inductor.config\nfrom torch.nn import functional as F", "draftflow.plugins.target.graphs", []),
])
def test_rule_on_examples(source, module, expected):
    """The rule flags each kind of private import (module, other plugin, relative, private name) and passes public ones."""
    assert [v.render() for v in import_violations(source, module)] == expected


# --- core reads nodes through declared interfaces, never with getattr ----------------------------------
NODE_NAME = re.compile(r"(^|_)(node|nodes|target|targets|drafter|verifier|selector)$")


def _names_a_node(expr: ast.expr) -> bool:
    """``node``, ``target``, ``self.target_node``, ``self.nodes[name]``, ``plan.nodes.get(n)``, ``nodes[n].obj``..."""
    if isinstance(expr, ast.Name):
        return bool(NODE_NAME.search(expr.id))
    if isinstance(expr, ast.Attribute):
        return bool(NODE_NAME.search(expr.attr)) or _names_a_node(expr.value)
    if isinstance(expr, ast.Subscript):
        return _names_a_node(expr.value)
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) and expr.func.attr == "get":
        return _names_a_node(expr.func.value)
    return False


def node_getattrs(source: str) -> list[int]:
    """Lines of ``getattr``/``hasattr`` calls whose object is a node."""
    return [n.lineno for n in ast.walk(ast.parse(source))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id in ("getattr", "hasattr")
            and n.args and _names_a_node(n.args[0])]


def test_core_never_getattrs_a_node():
    """core/*.py reads the target through TargetHandle and nodes through Node methods, not getattr/hasattr."""
    found = [f"core/{p.name}:{line}: {p.read_text().splitlines()[line - 1].strip()}"
             for p in sorted((ROOT / "core").glob("*.py")) for line in node_getattrs(p.read_text())]
    assert not found, "getattr on a node in core (use the TargetHandle or a Node method):\n" + "\n".join(found)


@pytest.mark.parametrize("source, hit", [
    ("getattr(self.nodes[t], 'tokenizer', None)", True),
    ("getattr(target, 'eos_ids', ())", True),
    ("hasattr(node, 'model')", True),
    ("getattr(self.nodes.get(name), 'vocab_size')", True),
    ("getattr(self.target_node, 'tokenizer')", True),
    ("getattr(args, 'target', None)", False),
    ("getattr(plugin, hook_name, None)", False),
    ("getattr(r, c)", False),
])
def test_node_getattr_detector(source, hit):
    """The core scan recognises getattr on node expressions and leaves other getattr alone."""
    assert bool(node_getattrs(source)) == hit


# --- the same rule at check time, for a third-party plugin ------------------------------------------------
LEAKY = '''"""A third-party drafter that imports a private draftflow module."""
import torch
from draftflow.core.node import Node
from draftflow.plugin import Manifest, NodeType, Port, Proposal, hookimpl


class Leaky(Node):
    def step(self, batch, inputs):
        return {"proposal": Proposal(torch.zeros(batch.size, batch.num_draft, dtype=torch.long))}


def manifest(params, env):
    return Manifest(role="drafter", outputs=(Port("proposal", "proposal"),))


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(name="leaky", role="drafter", manifest=manifest, factory=Leaky))
'''
GRAPH = "nodes:\n  target: {plugin: toy-target}\n  d: {plugin: %s}\n  verify: {plugin: verifier}\n"


def _check(tmp_path, plugin, toy_env):
    (tmp_path / "g.yaml").write_text(GRAPH % plugin)
    env = dict(toy_env, DRAFTFLOW_PLUGINS=f"toy_plugins,{plugin}_plugin")
    return subprocess.run([sys.executable, "-m", "draftflow", "check", "g.yaml"], capture_output=True, text=True, cwd=tmp_path,
                          env=env, timeout=120)


def test_check_names_a_plugin_importing_a_private_module(tmp_path, toy_env):
    """`draftflow check` gives one [plugin-import] line: the node, the private module with file:line, and the fix."""
    (tmp_path / "leaky_plugin.py").write_text(LEAKY)
    r = _check(tmp_path, "leaky", toy_env)
    assert r.returncode == 1, r.stderr
    lines = r.stderr.splitlines()
    assert len(lines) == 2 and "Traceback" not in r.stderr, r.stderr  # the report heading and one problem
    assert re.search(r"node 'd' \(leaky\) \[plugin-import\]: plugin 'leaky_plugin' imports draftflow\.core\.node "
                     r"\(leaky_plugin\.py:3\), private to draftflow .*; fix: import what a plugin needs from draftflow\.plugin",
                     lines[1]), lines[1]


def test_check_passes_the_same_plugin_importing_from_draftflow_plugin(tmp_path, toy_env):
    """The fix the message gives works: importing Node from draftflow.plugin passes check."""
    fixed = LEAKY.replace("from draftflow.core.node import Node\nfrom draftflow.plugin import Manifest,",
                          "from draftflow.plugin import Manifest, Node,")
    (tmp_path / "tidy_plugin.py").write_text(fixed.replace('name="leaky"', 'name="tidy"'))
    r = _check(tmp_path, "tidy", toy_env)
    assert r.returncode == 0, r.stderr

"""Docs stay true: the PLUGINS.md example runs, shipped graphs pass `check`, documented rules exist."""

from __future__ import annotations

import re
import types

import toy_plugins
from helpers import ROOT

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import graph_from_text, load_graph


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_plugins_md_example_registers_and_runs():
    """The node-type example in docs/PLUGINS.md registers through the hook and drafts in a graph."""
    module = types.ModuleType("doc_example")
    exec(python_blocks(ROOT / "docs" / "PLUGINS.md")[0], module.__dict__)
    registry = load_registry(autoload=False, extra_plugins=(("doc_example", module), ("toy", toy_plugins)))
    spec = graph_from_text("num_draft: 3\nnodes: {target: {plugin: toy-target}, d: {plugin: repeat-anchor}, verify: {plugin: verifier}}")
    plan = build_plan(spec, registry)
    assert plan.problems == []
    result = Executor(plan).generate([1, 2], SamplingParams(max_new_tokens=6))
    assert list(result.token_ids) == toy_plugins.reference([1, 2], 6, 32) and result.stats["drafted"] > 0


def test_shipped_graphs_pass_check():
    """Every graph in graphs/ whose model files exist passes all static checks."""
    registry = load_registry()
    checked = 0
    for path in sorted((ROOT / "graphs").glob("*.yaml")):
        spec = load_graph(path)
        paths = [n.params.get("path") for n in spec.nodes if isinstance(n.params.get("path"), str)]
        if any(not (path.parent / p).exists() for p in paths):
            continue  # an example pointing at a model the user supplies
        plan = build_plan(spec, registry)
        assert plan.problems == [], f"{path.name}: " + "; ".join(p.render() for p in plan.problems)
        checked += 1
    assert checked >= 1


def test_every_check_rule_is_documented():
    """Each rule name the engine can report appears in docs/GRAPHS.md's table."""
    doc = (ROOT / "docs" / "GRAPHS.md").read_text()
    source = "".join((ROOT / "core" / f).read_text() for f in ("plan.py", "builtin_checks.py", "plugin_rules.py"))
    rules = set(re.findall(r'"(?:rule|)([a-z]+(?:-[a-z]+)*)"', "")) | set(re.findall(r'problem\([^,]+, "([a-z-]+)"', source)) \
        | set(re.findall(r'Problem\([^,]+, "([a-z-]+)"', source)) | set(re.findall(r'_p\(plan, \w+, "([a-z-]+)"', source))
    rules |= {"vram"}
    assert len(rules) >= 12
    missing = [r for r in rules if f"`{r}`" not in doc]
    assert not missing, f"rules not documented in docs/GRAPHS.md: {missing}"

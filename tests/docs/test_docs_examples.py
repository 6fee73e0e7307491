"""Docs stay true: the PLUGINS.md example runs, shipped graphs pass `check`, documented rules exist."""

from __future__ import annotations

import re
import types

from helpers import ROOT, SMALL_PAIR

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import graph_from_text, load_graph


def python_blocks(path):
    return re.findall(r"```python\n(.*?)```", path.read_text(), flags=re.S)


def test_plugins_md_cpu_warm_up_example_builds_every_step_width(monkeypatch):
    """The CPU warm-up of docs/PLUGINS.md, as a node's method: one forward, then the kernels of rows 1..K+1."""
    import pytest
    import torch

    from draftflow.layers import cpu_linear

    if not cpu_linear.HAS_PACKING:
        pytest.skip("this torch build cannot pack oneDNN weights")
    block = next(b for b in python_blocks(ROOT / "docs" / "PLUGINS.md") if "build_kernels" in b)
    namespace = {}
    exec(block, namespace)
    calls = []
    real = cpu_linear._onednn
    monkeypatch.setattr(cpu_linear, "_onednn", lambda rows, w, b: calls.append((w.size(0), rows.shape[0])) or real(rows, w, b))
    node = types.SimpleNamespace(model=cpu_linear.Linear(48, 40, bias=False).requires_grad_(False), width=48,
                                 ctx=types.SimpleNamespace(num_draft=3))
    namespace["warmup"](node)
    assert calls == [(40, 1), (40, 2), (40, 3), (40, 4)]  # the forward's one row, then the widths it had not run


def test_plugins_md_example_registers_and_runs():
    """The complete drafter in docs/PLUGINS.md registers through the hook and drafts losslessly in a graph."""
    module = types.ModuleType("doc_example")
    exec(python_blocks(ROOT / "docs" / "PLUGINS.md")[0], module.__dict__)
    registry = load_registry(autoload=False, extra_plugins=(("doc_example", module),))
    target = SMALL_PAIR / "target"
    graphs = {k: f"num_draft: 3\nnodes: {{target: {{plugin: target, params: {{path: {target}}}}}, {d}verify: {{plugin: verifier}}}}"
              for k, d in (("ngram", "d: {plugin: ngram}, "), ("alone", ""))}
    results = {}
    for name, text in graphs.items():
        plan = build_plan(graph_from_text(text), registry)
        assert plan.problems == [], [p.render() for p in plan.problems]
        results[name] = Executor(plan).generate([5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(max_new_tokens=24))
    assert results["ngram"].token_ids == results["alone"].token_ids and results["ngram"].stats["accepted"] > 0


def test_plugin_api_table_lists_every_public_name():
    """The grouped table of draftflow.plugin in PLUGINS.md names exactly its __all__."""
    import draftflow.plugin

    doc = (ROOT / "docs" / "PLUGINS.md").read_text()
    section = doc.split("## `draftflow.plugin`", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[2] for line in section.splitlines() if line.startswith("| ") and not line.startswith("| group")]
    listed = [name for row in rows for name in re.findall(r"`([A-Za-z_]+)`", row)]
    assert sorted(listed) == sorted(draftflow.plugin.__all__), set(listed) ^ set(draftflow.plugin.__all__)


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

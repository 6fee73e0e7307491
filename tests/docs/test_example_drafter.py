"""The one-file drafter of docs/PLUGINS.md (docs/examples/ngram_drafter.py) runs end to end through YAML and the CLI.

It is loaded exactly as a user would while writing it: its folder on PYTHONPATH and its module
named in DRAFTFLOW_PLUGINS, then `draftflow check` / `draftflow generate --graph`.
"""

from __future__ import annotations

import ast
import json
import os
import re

from helpers import ROOT, run_cli, SMALL_PAIR

from draftflow.core.registry import DISABLE_AUTOLOAD_ENV, PLUGINS_ENV

EXAMPLE = ROOT / "docs" / "examples" / "ngram_drafter.py"
DEMO = SMALL_PAIR / "target"
# The demo target's greedy continuation of this prompt repeats itself, so n-grams seen earlier are drafted again.
PROMPT = ["--prompt-ids", "5,6,7,5,6,7,5,6", "--max-new-tokens", "48", "--json"]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k not in (DISABLE_AUTOLOAD_ENV, PLUGINS_ENV, "PYTHONPATH")}
    return {**env, "PYTHONPATH": str(EXAMPLE.parent), PLUGINS_ENV: EXAMPLE.stem}


def _graph(tmp_path, params: str = "{order: 2}"):
    graph = tmp_path / "ngram.yaml"
    graph.write_text(f"num_draft: 4\nnodes:\n  target: {{plugin: target, params: {{path: {DEMO}}}}}\n"
                     f"  d: {{plugin: ngram, params: {params}}}\n  verify: {{plugin: verifier}}\n")
    return graph


def test_example_is_the_plugins_md_copy_and_short():
    """PLUGINS.md shows the file itself, under 100 lines, importing draftflow only from draftflow.plugin."""
    source = EXAMPLE.read_text()
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "PLUGINS.md").read_text(), flags=re.S)
    assert source in blocks, "docs/PLUGINS.md's drafter differs from docs/examples/ngram_drafter.py: paste the file in"
    assert len(source.splitlines()) < 100
    modules = {n.module for n in ast.walk(ast.parse(source)) if isinstance(n, ast.ImportFrom)}
    modules |= {a.name for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Import) for a in n.names}
    assert {m for m in modules if m.startswith("draftflow")} == {"draftflow.plugin"}, modules


def test_example_drafts_and_keeps_the_target_greedy_output(tmp_path):
    """Through `draftflow generate --graph`, the n-gram drafter gets drafts accepted and the tokens equal target-only decoding."""
    drafted = run_cli(["generate", "--graph", _graph(tmp_path), *PROMPT], env=_env(), cwd=tmp_path)
    assert drafted.returncode == 0, drafted.stderr
    alone = run_cli(["generate", "--target", DEMO, *PROMPT], env=_env(), cwd=tmp_path)
    assert alone.returncode == 0, alone.stderr
    with_drafter, reference = json.loads(drafted.stdout), json.loads(alone.stdout)
    assert with_drafter["token_ids"] == reference["token_ids"]
    assert with_drafter["stats"]["accepted"] > 0 and reference["stats"]["drafted"] == 0, with_drafter["stats"]


def test_example_passes_check_and_its_param_minimum_is_checked(tmp_path):
    """`draftflow check` passes the example graph (no [plugin-import] problem) and names order: 0 with its fix."""
    ok = run_cli(["check", _graph(tmp_path)], env=_env(), cwd=tmp_path)
    assert ok.returncode == 0, ok.stderr
    bad = run_cli(["check", _graph(tmp_path, "{order: 0}")], env=_env(), cwd=tmp_path)
    assert bad.returncode == 1
    assert re.search(r"node 'd' \(ngram\) \[param\]: parameter 'order': 0 is below the minimum 1; fix: set order to 1 or more",
                     bad.stderr), bad.stderr


def test_example_is_listed_by_draftflow_plugins(tmp_path):
    """`draftflow plugins` lists the ngram node type as a drafter loaded through DRAFTFLOW_PLUGINS."""
    r = run_cli(["plugins"], env=_env(), cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^ngram\s+drafter\s+ngram_drafter\s", r.stdout, flags=re.M), r.stdout

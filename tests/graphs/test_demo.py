"""The shipped demo pair: files within limits, lossless with real acceptance, the README command runs."""

from __future__ import annotations

import json

import pytest
from helpers import ROOT, run_cli
from tokenizers import Tokenizer

from draftflow.testing import greedy_gate

DEMO = ROOT / "graphs" / "models" / "demo"
PROMPTS = ["def fibonacci(n):", "import os\n\n\ndef main(", "class Stack:\n    def __init__(self):\n"]


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))
    return [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]


def test_shipped_files_are_small_and_complete():
    """The demo files total at most 64 MB (issue 22), none near GitHub's 50 MB warning; weights are safetensors (bf16)
    and the tokenizer is tokenizer.json."""
    files = [p for p in DEMO.rglob("*") if p.is_file()]
    assert sum(p.stat().st_size for p in files) <= 64_000_000, [(p.name, p.stat().st_size) for p in files]
    assert all(p.stat().st_size <= 40_000_000 for p in files), [(p.name, p.stat().st_size) for p in files]
    names = {str(p.relative_to(DEMO)) for p in files}
    assert {"target/model.safetensors", "target/tokenizer.json", "target/config.json", "dflash/model.safetensors",
            "dflash/config.json", "mtp/mtp.safetensors", "mtp/config.json", "dflash2/model.safetensors",
            "dflash2/config.json", "MODEL_CARD.md"} <= names, names
    assert not [n for n in names if n.endswith((".pt", ".bin", ".pkl"))]


def test_demo_graph_passes_the_greedy_gate_with_acceptance(prompts):
    """graphs/demo.yaml (prompt lookup, else DFlash2, K 15) emits the target-only tokens and accepts drafts."""
    report = greedy_gate(ROOT / "graphs" / "demo.yaml", prompts=prompts, max_new_tokens=32)
    assert report.accepted > 0


def test_demo_dflash_graph_passes_the_greedy_gate_with_acceptance(prompts):
    """graphs/demo-dflash.yaml (the shipped block-16 DFlash drafter under adaptive_k) is lossless and accepts drafts."""
    report = greedy_gate(ROOT / "graphs" / "demo-dflash.yaml", prompts=prompts, max_new_tokens=32)
    assert report.accepted > 0


def test_demo_mtp_head_passes_the_greedy_gate_with_acceptance(prompts, tmp_path):
    """The shipped MTP head on the demo target is lossless and accepts drafts."""
    spec = {"name": "demo-mtp", "device": "cpu", "dtype": "float32", "num_draft": 3, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(DEMO / "target"), "tap_layers": [8]}},  # its last layer
        "mtp": {"plugin": "mtp", "params": {"path": str(DEMO / "mtp")}}, "verify": {"plugin": "verifier"}}}
    (tmp_path / "g.yaml").write_text(json.dumps(spec))
    report = greedy_gate(tmp_path / "g.yaml", prompts=prompts[:2], max_new_tokens=32)
    assert report.accepted > 0


def test_demo_dflash2_cut_by_its_confidence_is_lossless_and_drafts_fewer(prompts, tmp_path):
    """The dflash2 node's `min_path_prob` (a YAML param): output unchanged, fewer drafts than whole blocks."""
    spec = {"name": "demo-dflash2-cut", "device": "cpu", "dtype": "float32", "num_draft": 15, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(DEMO / "target"), "kv_mode": "static",
                                                  "tap_layers": [1, 4, 7]}},
        "drafter": {"plugin": "dflash2", "params": {"path": str(DEMO / "dflash2")}},
        "selector": {"plugin": "dflash2-selector"}, "verify": {"plugin": "verifier"}}}
    (tmp_path / "g.yaml").write_text(json.dumps(spec))
    cut = greedy_gate(tmp_path / "g.yaml", prompts=prompts[:2], max_new_tokens=48,
                      overrides=["nodes.drafter.min_path_prob=0.01"])
    cycles = sum(r.stats["cycles"] for r in cut.speculative)
    # the gate proved the tokens equal to target-only's; whole blocks would draft 15 a cycle (the last maybe fewer)
    assert cut.accepted > 0 and cut.drafted < 15 * cycles - 15, (cut.drafted, cycles)


def test_demo_dflash_cut_by_its_confidence_is_lossless_and_drafts_fewer(prompts, tmp_path):
    """The dflash node's `min_path_prob` (a YAML param): output unchanged, fewer drafts than whole blocks."""
    spec = {"name": "demo-dflash-cut", "device": "cpu", "dtype": "float32", "num_draft": 15, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(DEMO / "target"), "kv_mode": "static",
                                                  "tap_layers": [1, 4, 7]}},
        "drafter": {"plugin": "dflash", "params": {"path": str(DEMO / "dflash")}}, "verify": {"plugin": "verifier"}}}
    (tmp_path / "g.yaml").write_text(json.dumps(spec))
    cut = greedy_gate(tmp_path / "g.yaml", prompts=prompts[:2], max_new_tokens=48,
                      overrides=["nodes.drafter.min_path_prob=0.01"])
    cycles = sum(r.stats["cycles"] for r in cut.speculative)
    assert cut.accepted > 0 and cut.drafted < 15 * cycles - 15, (cut.drafted, cycles)


@pytest.mark.parametrize(("graph", "name", "plugin"), [([], "dflash2", "dflash2"),
                                                       (["--graph", str(ROOT / "graphs" / "demo-dflash.yaml")], "drafter", "dflash")])
def test_a_negative_min_path_prob_is_reported_before_anything_runs(tmp_path, graph, name, plugin):
    """`--set nodes.N.min_path_prob=-1` on the default graph (dflash2) and the DFlash demo graph (dflash): the graph
    check's report naming the node, the param and the fix; exit 1, no traceback, nothing written."""
    r = run_cli(["generate", "--prompt", "def f(x):", *graph, "--set", f"nodes.{name}.min_path_prob=-1"], cwd=tmp_path)
    assert r.returncode == 1 and "Traceback" not in r.stderr and not r.stdout.strip(), r.stderr
    assert (f"node '{name}' ({plugin}) [param]: parameter 'min_path_prob': -1.0 is below the minimum 0.0; fix: set "
            "min_path_prob to 0.0 or more") in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []


def test_readme_main_command_prints_code_and_summary(tmp_path):
    """`draftflow generate "def fibonacci(n):"` runs the demo graph from anywhere: code on stdout, a summary line."""
    r = run_cli(["generate", "def fibonacci(n):"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip()
    summary = r.stderr.strip().splitlines()[-1]
    assert "tau" in summary and "acceptance" in summary and "tok/s" in summary, r.stderr
    tau = float(summary.split("tau ")[1].split(",")[0])
    assert tau > 1.0, summary


def test_demo_dflash2_with_selector_passes_the_greedy_gate(prompts):
    """graphs/demo-dflash2.yaml (the shipped DFlash2 drafter and its learned selector) is lossless and accepts drafts."""
    report = greedy_gate(ROOT / "graphs" / "demo-dflash2.yaml", prompts=prompts[:2], max_new_tokens=32)
    assert report.accepted > 0


def test_demo_mtp_head_is_charged_its_own_bytes_not_the_targets_embedding():
    """The MTP node reads the target's tied embedding/head (12.6 MB here); the VRAM check charges it to the target once."""
    from draftflow.core.executor import Executor
    from draftflow.core.plan import build_plan
    from draftflow.core.registry import load_registry
    from draftflow.core.spec import GraphSpec

    spec = GraphSpec.from_dict({"name": "demo-mtp", "num_draft": 3, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(DEMO / "target"), "tap_layers": [8]}},
        "mtp": {"plugin": "mtp", "params": {"path": str(DEMO / "mtp")}}, "verify": {"plugin": "verifier"}}})
    ex = Executor(build_plan(spec, load_registry()))
    declared = {r.node: r.total for r in ex.plan.vram.rows}
    embed = 8192 * 384 * 4
    assert ex.measured["mtp"] <= declared["mtp"] and ex.measured["target"] > embed

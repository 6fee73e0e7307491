"""The block drafters' own `dtype`: a bfloat16 drafter of a float32 target, through YAML and the CLI.

The drafter computes in its dtype with its own copies of the target's embedding and head; the
target, and so the output, stay float32 and equal to target-only decoding.
"""

from __future__ import annotations

import json

import pytest
import torch
from dflash_testlib import agreeing_pair, write_graph
from helpers import SMALL_PAIR, run_cli

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import load_graph
from draftflow.plugins.dflash.config import head_copy_bytes

PROMPT = [3, 4, 5, 6]


def _run(graph, *overrides, device="cpu"):
    plan = build_plan(load_graph(graph, [f"device={device}", *overrides]), load_registry())
    ex = Executor(plan)
    out = ex.generate(PROMPT, SamplingParams(max_new_tokens=24, ignore_eos=True))
    return ex, plan, out


def test_a_bfloat16_drafter_of_a_float32_target_drafts_in_bfloat16_and_changes_no_token(tmp_path):
    """`dtype: bfloat16` on the dflash node: its weights, K/V and embedding/head copies are bfloat16, the target's
    tensors stay float32, the drafts are still accepted, and the output equals the float32 drafter's."""
    graph = write_graph(tmp_path / "g.yaml", *agreeing_pair(tmp_path))
    ex32, plan32, want = _run(graph)
    ex16, plan16, got = _run(graph, "nodes.drafter.dtype=bfloat16")
    node, target = ex16.nodes["drafter"], ex16.nodes["target"]
    assert {p.dtype for p in node.model.parameters()} == {torch.bfloat16}
    assert node.slots.dtype == node.embed.dtype == node.head.dtype == torch.bfloat16
    assert all(p.dtype == torch.float32 for p in target.tensors())
    assert got.token_ids == want.token_ids
    assert got.stats["accepted"] > 0.5 * want.stats["accepted"]
    # The plan counts the copies: weights grow by the bfloat16 embedding and head, the K/V buffer halves.
    w32, w16 = plan32.nodes["drafter"].manifest.vram.weights, plan16.nodes["drafter"].manifest.vram.weights
    vocab, hidden = node.embed.shape
    assert head_copy_bytes(vocab, hidden, "bfloat16", "float32") == 2 * vocab * hidden * 2 > 0
    assert w16 == w32 // 2 + 2 * vocab * hidden * 2
    assert head_copy_bytes(vocab, hidden, "float32", "float32") == 0


def test_the_cli_with_a_bfloat16_drafter_prints_the_target_only_tokens(tmp_path):
    """Through `draftflow generate --graph ... --set nodes.drafter.dtype=bfloat16 --compare --json`: same tokens."""
    graph = write_graph(tmp_path / "g.yaml", *agreeing_pair(tmp_path))
    r = run_cli(["generate", "--graph", str(graph), "--prompt-ids", "3,4,5,6", "--max-new-tokens", "20", "--json",
                 "--ignore-eos", "--set", "nodes.drafter.dtype=bfloat16", "--compare"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["compare"]["identical"] is True and out["stats"]["accepted"] > 0


def test_an_unknown_drafter_dtype_is_one_line_naming_the_node_and_field(tmp_path):
    graph = write_graph(tmp_path / "g.yaml", *agreeing_pair(tmp_path))
    r = run_cli(["check", str(graph), "--set", "nodes.drafter.dtype=int8"], cwd=tmp_path)
    assert r.returncode != 0 and "Traceback" not in r.stderr
    line = [ln for ln in r.stderr.splitlines() if "parameter 'dtype'" in ln]
    assert len(line) == 1 and "node 'drafter'" in line[0] and "use one of: graph, float32, bfloat16" in line[0], r.stderr


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_bfloat16_drafter_under_cuda_graphs_changes_no_token(tmp_path):
    """On CUDA (captured proposal graphs), a bfloat16 drafter of a float32 target: the float32 drafter's output."""
    graph = write_graph(tmp_path / "g.yaml", *agreeing_pair(tmp_path))
    _, _, want = _run(graph, device="cuda")
    ex, _, got = _run(graph, "nodes.drafter.dtype=bfloat16", device="cuda")
    assert ex.nodes["drafter"].runner is not None
    assert got.token_ids == want.token_ids and got.stats["accepted"] > 0


def test_a_bfloat16_dflash2_drafter_and_selector_change_no_token(tmp_path):
    """DFlash2 (convolutions, candidates, the selector's walk) in bfloat16 on the float32 small demo target:
    the same tokens as target-only, with drafts accepted."""
    graph = SMALL_PAIR / "demo-dflash2.yaml"
    r = run_cli(["generate", "--graph", str(graph), "--prompt", "def fibonacci(n):", "--max-new-tokens", "24",
                 "--json", "--ignore-eos", "--set", "nodes.drafter.dtype=bfloat16", "--compare"], cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["compare"]["identical"] is True and out["stats"]["accepted"] > 0

"""The static-shape DFlash proposal (CUDA-graph path) drafts what the eager node drafts.

On the CPU the runner's step runs without capture (the same ops a graph replays); the
`gpu` test captures real graphs. Logits are compared per cycle, so a wrong mask, a stale
context row that is read, or a wrong block position fails here.
"""

from __future__ import annotations

import pytest
import torch
from dflash_testlib import BLOCK, DRAFT_KW, agreeing_pair, write_graph
from numerics import assert_close_to_scale, tiny_model_bound

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import load_graph
from draftflow.plugins.dflash.graphs import DraftRunner
from draftflow.plugins.dflash.plugin import slot_width

PROMPTS = [[3, 4, 5, 6], [10, 11], [7] * 9 + [8, 9, 12, 13, 14, 15, 16, 17, 18]]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return agreeing_pair(tmp_path_factory.mktemp("pair"))


def _drafts(graph, device: str, runner: bool, num_draft: int = BLOCK - 1, capture: bool = False,
            triton: bool | None = None, prompts=PROMPTS, max_new_tokens: int = 20):
    """Per-cycle (position, logits) of the drafter and the emitted tokens, eager or through the runner; `triton`
    True / False: the block path of `DFlashModel.use_triton` on / off whatever the node chose."""
    overrides = [f"device={device}"] if device != "cpu" else []
    if triton is False:
        overrides.append("nodes.drafter.params.triton=false")
    ex = Executor(build_plan(load_graph(graph, overrides=overrides), load_registry()))
    node = ex.nodes["drafter"]
    if triton:
        assert node.model.use_triton()
    assert (node.model.kernels.split_attention is not None) == bool(triton or (triton is None and device != "cpu"))
    used = []
    if runner:
        def make():
            if node.runner is None:
                width = slot_width(node.config, node.ctx.num_draft)  # the node's own runner width
                node.runner = DraftRunner(node.model, node.cache, node.embed, node.head, width, capture=capture,
                                          min_bucket=16)
                call = node.runner.__call__
                node.runner = type("Spy", (), {"__call__": lambda self, *a: used.append(a[3]) or call(*a)})()

            return node.runner
        node._runner = make
    else:
        node._runner = lambda: None
    seen = []
    original = node.draft_block

    def spy(batch, inputs):
        out = original(batch, inputs)
        if out is not None:
            seen.append((batch.rows[0].position, out[1].clone()))
        return out

    node.draft_block = spy
    emitted = [ex.generate(p, SamplingParams(max_new_tokens=max_new_tokens)).token_ids for p in prompts]
    return seen, emitted, used


def test_runner_drafts_equal_eager_drafts(pair, tmp_path):
    """Every cycle's draft logits through the static step equal the eager forward's (float32), outputs identical."""
    graph = write_graph(tmp_path / "g.yaml", *pair)
    want, want_out, _ = _drafts(graph, "cpu", runner=False)
    got, got_out, used = _drafts(graph, "cpu", runner=True)
    # every proposal drafts the whole trained block, also where fewer drafts fit before max_new_tokens (then only
    # its first rows are offered, and the logits compared below are those rows')
    assert set(used) == {BLOCK}, f"runner widths used: {sorted(set(used))}"
    assert got_out == want_out
    assert [p for p, _ in got] == [p for p, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert_close_to_scale(g, w, tiny_model_bound(DRAFT_KW["num_hidden_layers"]), "draft logits")


def test_a_small_num_draft_still_drafts_the_whole_block(pair, tmp_path):
    """num_draft below block_size - 1: every proposal still drafts the trained block (runner and eager alike) and
    offers its first K rows, which are the full-K graph's first rows; outputs stay equal."""
    graph = write_graph(tmp_path / "g.yaml", *pair, num_draft=2)
    want, want_out, _ = _drafts(graph, "cpu", runner=False)
    got, got_out, used = _drafts(graph, "cpu", runner=True)
    assert set(used) == {BLOCK} and got_out == want_out
    assert all(logits.shape[1] <= 2 for _, logits in got)
    for (_, g), (_, w) in zip(got, want):
        assert_close_to_scale(g, w, tiny_model_bound(DRAFT_KW["num_hidden_layers"]), "draft logits")
    full, _, _ = _drafts(write_graph(tmp_path / "full.yaml", *pair), "cpu", runner=False)
    # the first cycle: same context, the same block (equal but for the LM head's summation order at 2 rows or 15)
    assert_close_to_scale(full[0][1][:, :2], want[0][1], 1e-5, "first cycle")


@pytest.mark.parametrize("runner", [False, True])
def test_triton_block_path_drafts_what_the_plain_path_drafts(pair, tmp_path, runner):
    """`use_triton`'s block path (one q/k/v product, the q/k-norm + RoPE + K/V-write kernel skipping stale padded
    context rows, non-causal split-KV attention without a mask), eager and through the runner's static step
    uncaptured (rows past C stale), on the CPU through Triton's interpreter (compiled on CUDA): every cycle's draft
    logits equal the plain eager forward's (float32), outputs identical."""
    graph = write_graph(tmp_path / "g.yaml", *pair)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(prompts=PROMPTS[2:], max_new_tokens=8)  # the interpreter runs each kernel program in Python: few cycles
    want, want_out, _ = _drafts(graph, device, runner=False, triton=False, **kw)
    got, got_out, _ = _drafts(graph, device, runner=runner, triton=True, **kw)
    assert len(got) >= 3 and got_out == want_out and [p for p, _ in got] == [p for p, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert_close_to_scale(g, w, tiny_model_bound(DRAFT_KW["num_hidden_layers"]), "draft logits")


def test_triton_block_path_honours_sliding_windows(pair, tmp_path):
    """A drafter whose layers are sliding (window = the block size, so a block row sees only the last few context
    cells of an 18-token prompt) and non-causal: `use_triton` takes it, and its drafts equal the plain path's
    (which masks the window), eager, float32 (CPU: Triton's interpreter)."""
    import json
    import shutil

    drafter = tmp_path / "sliding"
    shutil.copytree(pair[1], drafter)
    config = json.loads((drafter / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(layer_types=["sliding_attention"] * layers, sliding_window=BLOCK, is_causal=False)
    (drafter / "config.json").write_text(json.dumps(config))
    graph = write_graph(tmp_path / "g.yaml", pair[0], drafter)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    kw = dict(prompts=PROMPTS[2:], max_new_tokens=8)
    want, want_out, _ = _drafts(graph, device, runner=False, triton=False, **kw)
    got, got_out, _ = _drafts(graph, device, runner=False, triton=True, **kw)
    full, _, _ = _drafts(write_graph(tmp_path / "full.yaml", *pair), device, runner=False, triton=False, **kw)
    assert len(got) >= 3 and got_out == want_out and [p for p, _ in got] == [p for p, _ in want]
    for (_, g), (_, w) in zip(got, want):
        assert_close_to_scale(g, w, tiny_model_bound(DRAFT_KW["num_hidden_layers"]), "draft logits")
    assert not torch.allclose(full[0][1], want[0][1])  # the window changed what the drafter saw


def test_runner_rejects_more_rows_than_its_width(pair, tmp_path):
    """Ingesting more rows than the block width is refused (the node splits long prompts first)."""
    graph = write_graph(tmp_path / "g.yaml", *pair)
    ex = Executor(build_plan(load_graph(graph), load_registry()))
    node = ex.nodes["drafter"]
    ex.generate([3, 4, 5], SamplingParams(max_new_tokens=2))
    runner = DraftRunner(node.model, node.cache, node.embed, node.head, 3, capture=False)
    with pytest.raises(ValueError, match="1..3 rows"):
        runner(torch.zeros(1, 4, node.model.fc.in_features), 0, 5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_graphs_draft_what_eager_drafts_on_cuda(pair, tmp_path):
    """On CUDA the captured graphs give the eager node's drafts and outputs (float32)."""
    graph = write_graph(tmp_path / "g.yaml", *pair)
    want, want_out, _ = _drafts(graph, "cuda", runner=False, triton=False)
    for triton in (False, True):  # the plain ops and the Triton block path (the default on CUDA)
        got, got_out, used = _drafts(graph, "cuda", runner=True, capture=True, triton=triton)
        assert used and got_out == want_out
        for (_, g), (_, w) in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_warmup_captures_the_full_width_graphs_a_request_uses(pair, tmp_path):
    """After Executor.warmup (DFlash.warmup) a request replays full-width proposals without capturing any."""
    graph = write_graph(tmp_path / "g.yaml", *pair)
    ex = Executor(build_plan(load_graph(graph, overrides=["device=cuda"]), load_registry()))
    ex.warmup()
    runner = ex.nodes["drafter"].runner
    before = set(runner.graphs)
    assert before and all(b == 1 and w == BLOCK for b, w, _ in before), before
    ex.generate(PROMPTS[2], SamplingParams(max_new_tokens=20))
    assert all(w < BLOCK for _, w, _ in set(runner.graphs) - before), set(runner.graphs) - before  # only the short tail


def test_warmup_buckets_reach_the_targets_warmup_tokens():
    """The proposal graphs warm-up captures: every KV bucket a block can attend up to WARMUP_TOKENS cells (as the target
    node captures its windows' up to 2048 tokens), at least the first, never past the cache's capacity."""
    from draftflow.plugins.dflash.graphs import WARMUP_TOKENS, warmup_buckets

    assert WARMUP_TOKENS == 2048
    assert warmup_buckets(16, 40_000, 256) == [256, 512, 1024, 2048]
    assert warmup_buckets(16, 1040, 256) == [256, 512, 1024, 1040]  # the demo drafter's cache: its last is capped
    assert warmup_buckets(16, 300, 256) == [256, 300]
    assert warmup_buckets(16, 100, 256) == [100]
    assert warmup_buckets(16, 40_000, 16, limit=64) == [16, 32, 64]

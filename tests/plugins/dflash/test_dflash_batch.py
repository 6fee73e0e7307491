"""The dflash node batched: one block pass over many request slots drafts what each request drafts alone.

float32 on the CPU with the tiny agreeing pair. Rows differ in context, prompt length (one is
caught up alone first) and budget (rows near their end draft fewer than K in a K-wide pass);
the static-shape runner's batched step (what CUDA graphs replay) runs uncaptured here.
"""

from __future__ import annotations

import pytest
import torch
from dflash_batchlib import BUDGETS, PROMPTS, executor, record, record_proposals, run_alone, run_together
from dflash_testlib import BLOCK, VOCAB, agreeing_pair, write_graph

from draftflow.core.node import SamplingParams
from draftflow.plugins.dflash.graphs import DraftRunner


@pytest.fixture(scope="module")
def graph(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    return write_graph(root / "g.yaml", *agreeing_pair(root))


def static_runner(node):
    """The CUDA-graph proposal path without capture, batch buckets from 2 slots up."""
    if node.runner is None:
        node.runner = DraftRunner(node.model, node.cache, node.embed, node.head, BLOCK, capture=False, min_bucket=16,
                                  slots=node.slots)
    return node.runner


def greedy_work(n: int = 4):
    return [(PROMPTS[i], SamplingParams(max_new_tokens=BUDGETS[i], ignore_eos=True)) for i in range(n)]


def assert_rows_equal(got: dict, want: dict) -> int:
    """Every draft pass of `want` (alone) has the same rows in `got` (batched): allclose, same argmax."""
    for key, (w, _) in want.items():
        g = got[key][0]
        assert g.shape == w.shape, key
        torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-5)
        assert torch.equal(g.argmax(-1), w.argmax(-1)), key
    return sum(1 for _, size in got.values() if size > 1)


@pytest.mark.parametrize("runner", [None, static_runner], ids=["eager", "static"])
def test_batched_block_pass_equals_each_row_alone(graph, runner):
    """Four requests stepped together: each row's draft logits equal its batch-1 pass (1e-5), tokens identical."""
    alone_ex, together_ex = executor(graph, 1), executor(graph, 4, runner)
    want_rows, got_rows = record(alone_ex), record(together_ex)
    want = run_alone(alone_ex, greedy_work())
    got = run_together(together_ex, greedy_work())
    assert got == want
    assert set(got_rows) == set(want_rows)
    batched = assert_rows_equal(got_rows, want_rows)
    ragged = [key for key, (rows, size) in got_rows.items() if size > 1 and 0 < rows.shape[0] < BLOCK - 1]
    assert batched >= 8 and ragged, (batched, ragged)


def test_one_request_drafts_as_before_in_a_batched_executor(graph):
    """A lone request in slot 0 of a 4-slot executor takes the batch-1 path: the same logits and tokens, bit for bit."""
    work = greedy_work(1)
    one, four = executor(graph, 1), executor(graph, 4)
    want_rows, got_rows = record(one), record(four)
    assert run_alone(four, work) == run_alone(one, work)
    for key, (w, _) in want_rows.items():
        assert torch.equal(got_rows[key][0], w), key


@pytest.mark.parametrize("runner", [None, static_runner], ids=["eager", "static"])
def test_pad_rows_leave_other_slots_unchanged(graph, runner):
    """Stepping slots 0 and 2 leaves slot 1's committed context cells and length as they were; all stay exact."""
    work = greedy_work(3)
    work = [(p, SamplingParams(max_new_tokens=30, ignore_eos=True)) for p, _ in work]
    want = run_alone(executor(graph, 1), work)
    ex = executor(graph, 4, runner)
    node = ex.nodes["drafter"]
    live = {str(i): ex.start(p, s, str(i)) for i, (p, s) in enumerate(work)}
    ex.step(list(live.values()))  # slot 1 now holds its prompt's context
    for _ in range(3):
        length = node.caches[1].length
        cells = node.slots[:, :, 1, :length].clone()
        ex.step([live["0"], live["2"]])
        assert length > 0 and node.caches[1].length == length
        assert torch.equal(node.slots[:, :, 1, :length], cells)
    got = {}
    while live:
        for r in ex.step(list(live.values())):
            if r.finish is not None:
                got[r.request_id] = list(ex.finish(live.pop(r.request_id)).token_ids)
    assert got == want


def sampled_work():
    """A seeded sampled request (row 1) among a greedy one, another seed and one with penalties."""
    return [(PROMPTS[0], SamplingParams(max_new_tokens=16, ignore_eos=True)),
            (PROMPTS[1], SamplingParams(max_new_tokens=18, temperature=0.8, top_k=50, seed=5, ignore_eos=True)),
            (PROMPTS[2], SamplingParams(max_new_tokens=12, temperature=1.0, seed=9, ignore_eos=True)),
            (PROMPTS[3], SamplingParams(max_new_tokens=15, presence_penalty=1.5, ignore_eos=True))]


@pytest.mark.parametrize("runner", [None, static_runner], ids=["eager", "static"])
def test_seeded_sampled_drafts_do_not_depend_on_the_batch(graph, runner):
    """Each row's drafts and q are the ones it draws alone (its own generator, K and processors); greedy rows of a
    batch with sampled rows carry a one-hot q."""
    alone_ex, together_ex = executor(graph, 1), executor(graph, 4, runner)
    want_props, got_props = record_proposals(alone_ex, "drafter"), record_proposals(together_ex, "drafter")
    work = sampled_work()
    assert run_together(together_ex, work) == run_alone(alone_ex, work)
    for key, (drafts, q) in want_props.items():
        got_drafts, got_q = got_props[key]
        assert got_drafts == drafts, key
        if q is not None:
            torch.testing.assert_close(got_q, q, atol=1e-5, rtol=1e-5)
        elif got_q is not None:  # a greedy row in a batch that sampled
            assert torch.equal(got_q, torch.nn.functional.one_hot(torch.tensor(drafts, dtype=torch.long), VOCAB).float()), key
    assert any(q is not None for _, q in got_props.values())


def test_cache_has_a_row_per_slot_and_block_slack(graph):
    """The drafter's context cache is planned per request slot with room for a block past the context."""
    ex = executor(graph, 4)
    node = ex.nodes["drafter"]
    assert node.slots.shape[2] == 4 and node.slots.shape[3] == ex.kv_tokens + BLOCK
    assert len(node.caches) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_batched_graphs_draft_what_eager_drafts_on_cuda(graph):
    """On CUDA the batch-bucket graphs (captured at first use) give the eager batched pass's rows and tokens."""
    eager_ex, graph_ex = executor(graph, 4, lambda node: None, device="cuda"), executor(graph, 4, device="cuda")
    want_rows, got_rows = record(eager_ex), record(graph_ex)
    work = greedy_work()
    assert run_together(graph_ex, work) == run_together(eager_ex, work)
    for key, (w, _) in want_rows.items():
        torch.testing.assert_close(got_rows[key][0], w, atol=1e-4, rtol=1e-4)
    keys = set(graph_ex.nodes["drafter"].runner.graphs)
    assert any(b > 1 for b, _, _ in keys), keys

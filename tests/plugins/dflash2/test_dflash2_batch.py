"""dflash2 and its selectors batched: every row's candidates and drafts are the ones it gets alone.

float32 on the CPU with the tiny agreeing DFlash2 pair: the block pass runs the dynamic
convolutions over each row's own block (ragged rows included), and the selectors walk or
sample each row with its own generator and K.
"""

from __future__ import annotations

import pytest
import torch
from dflash2_testlib import BLOCK, agreeing_pair2, write_graph
from dflash_batchlib import BUDGETS, PROMPTS, executor, record, record_proposals, run_alone, run_together

from draftflow.core.node import SamplingParams
from draftflow.plugins.dflash.graphs import DraftRunner


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return agreeing_pair2(tmp_path_factory.mktemp("pair"))


def static_runner(node):
    if node.runner is None:
        node.runner = DraftRunner(node.model, node.cache, node.embed, node.head, BLOCK, capture=False, min_bucket=16,
                                  slots=node.slots)
    return node.runner


@pytest.mark.parametrize("runner", [None, static_runner], ids=["eager", "static"])
def test_batched_candidates_equal_each_row_alone(pair, tmp_path, runner):
    """Four greedy requests together: each row's draft logits equal its batch-1 pass (1e-5), tokens identical."""
    graph = write_graph(tmp_path / "g.yaml", *pair)
    work = [(PROMPTS[i], SamplingParams(max_new_tokens=BUDGETS[i], ignore_eos=True)) for i in range(4)]
    alone_ex, together_ex = executor(graph, 1), executor(graph, 4, runner)
    want_rows, got_rows = record(alone_ex), record(together_ex)
    assert run_together(together_ex, work) == run_alone(alone_ex, work)
    assert set(got_rows) == set(want_rows)
    for key, (w, _) in want_rows.items():
        torch.testing.assert_close(got_rows[key][0], w, atol=1e-5, rtol=1e-5)
        assert torch.equal(got_rows[key][0].argmax(-1), w.argmax(-1)), key
    assert sum(1 for _, size in got_rows.values() if size > 1) >= 8


@pytest.mark.parametrize("selector", ["dflash2-selector", "top1-selector"])
def test_seeded_sampled_picks_do_not_depend_on_the_batch(pair, tmp_path, selector):
    """A selector draws each sampled row as alone (drafts equal, q over candidates allclose); greedy rows of a
    batch that sampled carry a one-hot q over their candidates."""
    graph = write_graph(tmp_path / "g.yaml", *pair, selector=selector)
    work = [(PROMPTS[0], SamplingParams(max_new_tokens=16, ignore_eos=True)),
            (PROMPTS[1], SamplingParams(max_new_tokens=18, temperature=0.8, seed=5, ignore_eos=True)),
            (PROMPTS[2], SamplingParams(max_new_tokens=11, temperature=1.0, seed=9, ignore_eos=True)),
            (PROMPTS[3], SamplingParams(max_new_tokens=15, repetition_penalty=1.3, ignore_eos=True))]
    alone_ex, together_ex = executor(graph, 1), executor(graph, 4)
    want, got = record_proposals(alone_ex, "selector"), record_proposals(together_ex, "selector")
    assert run_together(together_ex, work) == run_alone(alone_ex, work)
    for key, (drafts, q) in want.items():
        got_drafts, got_q = got[key]
        assert got_drafts == drafts, key
        if q is not None:
            torch.testing.assert_close(got_q, q, atol=1e-5, rtol=1e-5)
        elif got_q is not None:
            assert torch.equal(got_q.sum(-1), torch.ones(len(drafts))) and set(got_q.unique().tolist()) <= {0.0, 1.0}
    assert any(q is not None for _, q in got.values())

"""Prompt lookup at batch > 1: each row drafts from its own slot's history, exactly as that request alone."""

from __future__ import annotations

import torch
from test_lookup_graph import GRAPH, REPETITIVE

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import Env, build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import load_graph
from draftflow.plugin import Batch, CommitInfo, NodeContext, RequestState
from draftflow.plugins.lookup.plugin import PromptLookup, manifest

PROMPTS = {0: REPETITIVE, 1: [40, 41, 42], 3: [1, 2, 3, 1, 2, 3, 1, 2], 4: [9, 9, 9, 9]}


def lookup(max_batch: int) -> PromptLookup:
    params = {"min_ngram": 2, "max_ngram": 3, "occurrence": "latest"}
    ctx = NodeContext("lookup", params, manifest(params, Env("cpu", "float32", 4, None)), torch.device("cpu"), torch.float32, 4, 16, {}, {},
                      max_batch=max_batch)
    return PromptLookup(ctx)


def request(slot: int, num_draft: int) -> RequestState:
    prompt = PROMPTS[slot]
    return RequestState(f"r{slot}", len(prompt), list(prompt), SamplingParams(), torch.Generator(), num_draft, 0, slot)


def test_rows_propose_what_each_request_proposes_alone():
    """Batched rows (ragged matches, a no-match row, a pad row) equal single-row steps; histories stay per slot."""
    node = lookup(5)
    reqs = {slot: request(slot, num_draft=3 if slot == 4 else 4) for slot in PROMPTS}
    for req in reqs.values():
        node.prefill(req)
    for cycle in range(3):
        batch = Batch(tuple(reqs.get(i) for i in range(5)), 4)
        got = node.step(batch, {})["proposal"]
        assert got.tokens.shape[0] == 5 and got.lengths is not None
        for slot, req in reqs.items():
            alone = node.step(Batch(tuple(req if i == slot else None for i in range(slot + 1)), 4), {})["proposal"]
            n = alone.tokens.shape[1] if alone.lengths is None else int(alone.lengths[slot])
            assert int(got.lengths[slot]) == n, (cycle, slot)
            assert got.tokens[slot, :n].tolist() == alone.tokens[slot, :n].tolist(), (cycle, slot)
        assert int(got.lengths[1]) == 0 and int(got.lengths[2]) == 0  # no match; pad row
        assert int(got.lengths[4]) <= 3 < int(got.lengths[0])  # slot 4 wants 3 drafts only
        for slot, req in reqs.items():  # commit the first draft (the history grows past 16: it doubles)
            tok = int(got.tokens[slot, 0]) if int(got.lengths[slot]) else 50 + cycle
            req.tokens.append(tok)
            node.commit(req, CommitInfo(req.position - 1, 0, 0, (tok,)))
    for slot, req in reqs.items():
        assert node.history[slot, :node.lengths[slot]].tolist() == req.tokens


def test_batched_greedy_output_equals_each_request_alone(cyclic_target):
    """Four greedy requests stepped together on the lookup graph give exactly their lone outputs."""
    plan = build_plan(load_graph(GRAPH, [f"nodes.target.path={cyclic_target}", "max_batch=4"]), load_registry())
    ex = Executor(plan)
    prompts = [REPETITIVE, [40, 41, 42], REPETITIVE[3:], [5, 6, 7, 5, 6, 7, 5]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (24, 10, 31, 17)]
    alone = [ex.generate(p, s).token_ids for p, s in zip(prompts, params)]
    states = [ex.start(p, s) for p, s in zip(prompts, params)]
    while any(s.finish_reason is None for s in states):
        ex.step([s for s in states if s.finish_reason is None])
    together = [ex.finish(s) for s in states]
    assert [r.token_ids for r in together] == alone
    assert sum(r.stats["accepted"] for r in together) > 0

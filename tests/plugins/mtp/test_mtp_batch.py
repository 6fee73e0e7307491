"""The mtp node at batch > 1: each slot's head cache and drafts are exactly that request's alone."""

from __future__ import annotations

import pytest
import torch
from test_mtp_graph import PROMPTS, mtp_graph

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.plugin import Batch, Features, RequestState


@pytest.fixture(scope="module")
def registry():
    return load_registry()


def test_batched_rows_draft_what_each_row_drafts_alone(random_dirs, registry):
    """Two cycles over slots 0 and 2 (slot 1 a pad row, ragged features and num_draft): drafts and head K/V equal single-row steps."""
    _, target, mtp_dir, _ = random_dirs("deepseek-v3")
    ex = Executor(build_plan(mtp_graph(target, mtp_dir, taps=(0, 1), max_batch=3), registry))
    node = ex.nodes["mtp"]
    width = node.tap.stop  # the features' row width (every tap)
    gen = torch.Generator().manual_seed(1)

    def request(slot, prompt, num_draft):
        return RequestState(f"r{slot}", len(prompt), list(prompt), SamplingParams(), torch.Generator(), num_draft, 0, slot)

    reqs = {0: request(0, [3, 17, 42, 99, 5, 8, 250], 4), 2: request(2, [7, 11, 13], 2)}
    cycles = []  # per cycle: slot -> Features
    for slot, req in reqs.items():
        req.tokens += [int(t) for t in torch.randint(0, 300, (6,), generator=gen)]
    for length in ((6, 2), (3, 1)):  # pairs each cycle: slot 0 then slot 2
        start = {0: 0, 2: 0} if not cycles else {s: cycles[-1][s].start + cycles[-1][s].hidden.shape[1] for s in reqs}
        cycles.append({s: Features(torch.randn(1, t, width, generator=gen), start[s]) for s, t in zip(reqs, length)})

    def run(slots):
        for s in slots:
            node.prefill(reqs[s])
        out = []
        for feats in cycles:
            rows = tuple(reqs[i] if i in slots else None for i in range(max(slots) + 1))
            proposal = node.step(Batch(rows, 4), {"features": [feats.get(i) if r else None for i, r in enumerate(rows)]})["proposal"]
            lengths = proposal.lengths.tolist() if proposal.lengths is not None else [proposal.tokens.shape[1]] * len(rows)
            # K/V of each slot's committed pairs and of its chained drafts (written just past them)
            kv = {i: node.cache.buffer[:, :, i, :node.cache.lengths[i] + reqs[i].num_draft - 1].clone() for i in slots}
            out.append(({i: proposal.tokens[i, :lengths[i]].tolist() for i in slots}, kv))
        return out

    together = run([0, 2])
    alone = [run([0]), run([2])]
    for c, (got, kv) in enumerate(together):
        assert got[0] == alone[0][c][0][0] and got[2] == alone[1][c][0][2], c
        assert len(got[0]) == 4 and len(got[2]) == 2
        torch.testing.assert_close(kv[0], alone[0][c][1][0])
        torch.testing.assert_close(kv[2], alone[1][c][1][2])
    assert node.cache.lengths == [9, 0, 3]
    node.release(reqs[0])
    assert node.cache.lengths == [0, 0, 3]


def test_batched_greedy_output_equals_each_request_alone(mimic_dirs, registry):
    """Three greedy requests stepped together through target + MTP + verifier give exactly their lone outputs."""
    target, mtp_dir = mimic_dirs("qwen3-next")
    ex = Executor(build_plan(mtp_graph(target, mtp_dir, max_batch=3), registry))
    prompts = PROMPTS + [[42]]
    params = [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in (20, 33, 12)]
    alone = [ex.generate(p, s).token_ids for p, s in zip(prompts, params)]
    states = [ex.start(p, s) for p, s in zip(prompts, params)]
    while any(s.finish_reason is None for s in states):
        ex.step([s for s in states if s.finish_reason is None])
    together = [ex.finish(s) for s in states]
    assert [r.token_ids for r in together] == alone
    assert sum(r.stats["accepted"] for r in together) > 0

"""Helpers for the batched DFlash(2) tests: run requests together or alone, recording each row's drafter output.

A uniquely named module (not conftest): the dflash2 tests import it too.
"""

from __future__ import annotations

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import load_graph

# Different lengths (one past the block width, so the batch catches it up alone) and budgets
# (rows near their end draft fewer than K: ragged blocks in one pass).
PROMPTS = [[3, 4, 5, 6], [10, 11], [7] * 9 + [8, 9, 12, 13, 14, 15, 16, 17, 18], [20, 21, 22, 300, 23, 24, 25]]
BUDGETS = [20, 9, 14, 17]


def executor(graph, max_batch: int, runner=None, device: str = "cpu") -> Executor:
    """An executor of `graph` with `max_batch` slots; `runner(node)` replaces the drafter's proposal path."""
    overrides = [f"max_batch={max_batch}"] + ([f"device={device}"] if device != "cpu" else [])
    ex = Executor(build_plan(load_graph(graph, overrides), load_registry()))
    if runner is not None:
        node = ex.nodes["drafter"]
        node._runner = lambda: runner(node)
    return ex


def record(ex: Executor, name: str = "drafter") -> dict:
    """(request id, anchor position) -> (draft logits rows [k, V], widths, batch size), per row of every block pass."""
    node, seen = ex.nodes[name], {}
    original = node.draft_block

    def spy(batch, inputs):
        out = original(batch, inputs)
        if out is not None:
            _, logits, widths = out
            for i, req in batch.active():
                if widths[i]:  # a row drafting nothing (its last token) has no pass alone
                    seen[req.request_id, req.position] = (logits[i, :widths[i]].clone(), batch.size)
        return out

    node.draft_block = spy
    return seen


def record_proposals(ex: Executor, name: str) -> dict:
    """(request id, anchor position) -> (drafts [k'], q rows or None) of the node's proposal, per row."""
    node, seen = ex.nodes[name], {}
    original = node.step

    def spy(batch, inputs):
        out = original(batch, inputs)
        prop = out["proposal"]
        for i, req in batch.active():
            k = prop.tokens.shape[1] if prop.lengths is None else int(prop.lengths[i])
            k = min(k, req.num_draft)
            q = None if prop.probs is None else prop.probs[i, :k].clone()
            seen[req.request_id, req.position] = (prop.tokens[i, :k].tolist(), q)
        return out

    node.step = spy
    return seen


def run_together(ex: Executor, work: list[tuple[list[int], SamplingParams]], between=None) -> dict[str, list[int]]:
    """Start every request, then step all live ones per cycle until each is done; `between(ex, live)` may step a
    subset first (called before every full cycle). Returns each request's tokens by id."""
    live = {str(i): ex.start(p, s, str(i)) for i, (p, s) in enumerate(work)}
    out = {}
    while live:
        if between is not None:
            between(ex, live)
        for r in ex.step(list(live.values())):
            if r.finish is not None:
                out[r.request_id] = list(ex.finish(live.pop(r.request_id)).token_ids)
    return out


def run_alone(ex: Executor, work: list[tuple[list[int], SamplingParams]]) -> dict[str, list[int]]:
    return {str(i): list(ex.generate(p, s, str(i)).token_ids) for i, (p, s) in enumerate(work)}

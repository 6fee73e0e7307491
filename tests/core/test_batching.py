"""Continuous batching is exact: a request's tokens do not depend on what else is in the batch.

float32 on the CPU with the shipped demo pair (target + DFlash, DFlash2, MTP) and prompt
lookup: 16 requests with different prompts and budgets join a running batch at different
cycles and leave when done; each gets exactly the tokens it gets alone. Seeded sampled
requests too (rows draw only from their own generator).
"""

from __future__ import annotations

import json
import random

import pytest
from helpers import ROOT, SMALL_PAIR

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec, load_graph

GRAPHS = ROOT / "graphs"
DEMO = SMALL_PAIR
PROMPTS = ["def fibonacci(n):", "import os\n\ndef walk(path):", "class Stack:\n    def __init__(self):",
           "for i in range(10):\n    print(", "def add(a, b):\n    return", "# sort a list\ndef sort(xs):",
           "with open('f') as f:", "try:\n    import numpy", "def main():\n    args =", "x = [i * i for i in",
           "def is_prime(n):\n    if n <", "return self.", "if __name__ == '__main__':", "def parse(line):\n    parts =",
           "while True:\n    line =", "def __repr__(self):\n    return"]


LAST_LAYER = json.loads((DEMO / "target" / "config.json").read_text())["num_hidden_layers"] - 1


def demo_lookup(max_batch: int, **target) -> GraphSpec:
    return GraphSpec.from_dict({
        "name": "demo-lookup", "num_draft": 4, "max_batch": max_batch,
        "nodes": {"target": {"plugin": "target", "params": {"path": str(DEMO / "target"), **target}},
                  "lookup": {"plugin": "prompt-lookup"}, "verify": {"plugin": "verifier"}}})


def demo_lookup_grow(max_batch: int) -> GraphSpec:
    """A KV cache grown in 16-token chunks: rows of different lengths attend over freshly grown cells."""
    return demo_lookup(max_batch, kv_mode="grow", grow_chunk=16)


def demo_mtp(max_batch: int) -> GraphSpec:
    return GraphSpec.from_dict({
        "name": "demo-mtp", "num_draft": 3, "max_batch": max_batch,
        "nodes": {"target": {"plugin": "target", "params": {"path": str(DEMO / "target"), "tap_layers": [LAST_LAYER]}},
                  "mtp": {"plugin": "mtp", "params": {"path": str(DEMO / "mtp")}}, "verify": {"plugin": "verifier"}}})


def yaml_graph(name: str):
    return lambda max_batch: load_graph(SMALL_PAIR / name, [f"max_batch={max_batch}"])


GRAPH_KINDS = {"dflash": yaml_graph("demo.yaml"), "dflash2": yaml_graph("demo-dflash2.yaml"), "lookup": demo_lookup,
               "lookup-grow": demo_lookup_grow, "mtp": demo_mtp}


def build(kind: str, max_batch: int) -> Executor:
    return Executor(build_plan(GRAPH_KINDS[kind](max_batch), load_registry()))


def workload(ex: Executor, n: int, seed: int, sampled: bool = False) -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(seed)
    tok = ex.handle.tokenizer
    out = []
    for i in range(n):
        s = SamplingParams(max_new_tokens=rng.randint(4, 40), ignore_eos=rng.random() < 0.5)
        if sampled:
            s = SamplingParams(max_new_tokens=rng.randint(4, 24), temperature=rng.choice([0.6, 1.0]), seed=1000 + i,
                               top_k=rng.choice([0, 20]))
        out.append((tok.encode(PROMPTS[i % len(PROMPTS)]), s))
    return out


def run_batched(ex: Executor, work, joins_per_cycle: int = 3) -> list[list[int]]:
    """A scheduler loop: admit up to `joins_per_cycle` waiting requests between cycles, step every live one."""
    waiting = list(enumerate(work))
    live, results, cycles, widest = {}, {}, 0, 0
    while waiting or live:
        for _ in range(joins_per_cycle):
            if waiting and ex.free_slots:
                i, (prompt, sampling) = waiting.pop(0)
                live[str(i)] = ex.start(prompt, sampling, str(i))
        widest = max(widest, len(live))
        for r in ex.step(list(live.values())):
            if r.finish is not None:
                results[int(r.request_id)] = list(ex.finish(live.pop(r.request_id)).token_ids)
        cycles += 1
    assert widest > 1
    return [results[i] for i in range(len(work))]


@pytest.mark.parametrize("kind", sorted(GRAPH_KINDS))
def test_sixteen_greedy_requests_batched_equal_alone(kind):
    alone = build(kind, 1)
    work = workload(alone, 16, seed=7)
    expected = [list(alone.generate(p, s).token_ids) for p, s in work]
    batched = build(kind, 16)
    assert run_batched(batched, work) == expected
    assert batched.free_slots == 16


@pytest.mark.parametrize("kind", ["dflash", "lookup"])
def test_seeded_sampled_requests_do_not_depend_on_the_batch(kind):
    alone = build(kind, 1)
    work = workload(alone, 6, seed=3, sampled=True)
    expected = [list(alone.generate(p, s).token_ids) for p, s in work]
    assert run_batched(build(kind, 4), work, joins_per_cycle=2) == expected


def test_a_cancelled_request_frees_its_slot_and_leaves_the_others_exact():
    alone = build("dflash", 1)
    work = workload(alone, 3, seed=11)
    expected = [list(alone.generate(p, s).token_ids) for p, s in work]
    ex = build("dflash", 3)
    states = [ex.start(p, s, str(i)) for i, (p, s) in enumerate(work)]
    ex.step(states)
    ex.finish(states[1], "cancelled")
    assert ex.free_slots == 1
    joined = ex.start(*work[1], "again")  # the freed slot, prefilled anew
    live = {"0": states[0], "2": states[2], "again": joined}
    got = {}
    while live:
        for r in ex.step(list(live.values())):
            if r.finish is not None:
                got[r.request_id] = list(ex.finish(live.pop(r.request_id)).token_ids)
    assert [got["0"], got["again"], got["2"]] == expected


@pytest.mark.parametrize("kind", ["dflash", "mtp"])
def test_a_long_prompt_joins_in_chunks_between_cycles(kind):
    """defer_prefill + prefill_step: a joining prompt is prefilled 5 tokens per cycle while others decode; exact."""
    alone = build(kind, 1)
    tok = alone.handle.tokenizer
    long_prompt = tok.encode("\n".join(PROMPTS[:6]))
    short = tok.encode(PROMPTS[6])
    sampling = SamplingParams(max_new_tokens=30, ignore_eos=True)
    longer = SamplingParams(max_new_tokens=160, ignore_eos=True)  # still decoding while the long prompt joins
    expected = [list(alone.generate(short, longer).token_ids), list(alone.generate(long_prompt, sampling).token_ids)]
    ex = build(kind, 2)
    first = ex.start(short, longer, "short")
    ex.step([first])
    joining = ex.start(long_prompt, sampling, "long", defer_prefill=True)
    assert not joining.ready
    with pytest.raises(ValueError, match="still prefilling"):
        ex.step([first, joining])
    chunks = 0
    while not joining.ready:
        assert ex.prefill_step(joining, 5) <= 5
        chunks += 1
        ex.step([first])  # the running request decodes between chunks
    assert chunks >= len(long_prompt) // 5
    live, got = {"short": first, "long": joining}, {}
    while live:
        for r in ex.step(list(live.values())):
            if r.finish is not None:
                got[r.request_id] = list(ex.finish(live.pop(r.request_id)).token_ids)
    assert [got["short"], got["long"]] == expected


def drive(ex: Executor, states: dict) -> dict[str, list[int]]:
    got = {}
    while states:
        for r in ex.step(list(states.values())):
            if r.finish is not None:
                got[r.request_id] = list(ex.finish(states.pop(r.request_id)).token_ids)
    return got


@pytest.mark.parametrize("kind", ["dflash", "mtp", "lookup"])
def test_joining_prompts_prefill_together(kind):
    """prefill_many: six deferred prompts prefilled in one batched forward give each request its tokens alone."""
    alone = build(kind, 1)
    work = workload(alone, 6, seed=5)
    expected = [list(alone.generate(p, s).token_ids) for p, s in work]
    ex = build(kind, 8)
    states = {str(i): ex.start(p, s, str(i), defer_prefill=True) for i, (p, s) in enumerate(work)}
    assert ex.prefill_many(list(states.values())) == sum(len(p) - 1 for p, _ in work)
    assert all(s.ready for s in states.values())
    got = drive(ex, states)
    assert [got[str(i)] for i in range(len(work))] == expected


def test_prefill_many_keeps_to_its_budget():
    """Within a budget: the prompts that fit go together, the next one gets what is left as a chunk, the rest wait."""
    ex = build("dflash", 4)
    tok = ex.handle.tokenizer
    prompts = [tok.encode(PROMPTS[i]) for i in (0, 4, 2, 3)]
    sampling = SamplingParams(max_new_tokens=12, ignore_eos=True)
    states = [ex.start(p, sampling, str(i), defer_prefill=True) for i, p in enumerate(prompts)]
    lefts = [len(p) - 1 for p in prompts]
    budget = lefts[0] + lefts[1] + 2
    assert ex.prefill_many(states, budget) == budget
    assert [s.ready for s in states] == [True, True, False, False] and states[2].prefilled == 2 and not states[3].prefilled
    while not all(s.ready for s in states):
        ex.prefill_many([s for s in states if not s.ready], 3)
    alone = build("dflash", 1)
    got = drive(ex, {s.request_id: s for s in states})
    assert [got[str(i)] for i in range(4)] == [list(alone.generate(p, sampling).token_ids) for p in prompts]

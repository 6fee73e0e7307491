"""Greedy speculative output equals target-only output with the same logit processors, for every drafter.

The shipped demo models (graphs/models/demo) in float32: prompt lookup, MTP, DFlash and
DFlash2 each against the same target run without drafts. Logprobs with speculation equal
target-only logprobs within LOGPROB_TOL.
"""

from __future__ import annotations

import pytest
from helpers import ROOT, SMALL_PAIR
from tokenizers import Tokenizer

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.spec import GraphSpec

DEMO = SMALL_PAIR
PROMPTS = ["def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n\n\ndef",
           "class Stack:\n    def __init__(self):\n"]
TARGET = {"plugin": "target", "params": {"path": str(DEMO / "target"), "kv_mode": "static", "tap_layers": [1, 2, 3]}}
DRAFTERS = {
    "lookup": (4, {"lookup": {"plugin": "prompt-lookup"}}),
    "mtp": (3, {"mtp": {"plugin": "mtp", "params": {"path": str(DEMO / "mtp")}}}),
    "dflash": (3, {"drafter": {"plugin": "dflash", "params": {"path": str(DEMO / "dflash")}}}),
    "dflash2": (7, {"drafter": {"plugin": "dflash2", "params": {"path": str(DEMO / "dflash2")}},
                    "selector": {"plugin": "dflash2-selector"}}),
}
SETTINGS = {
    "repetition": dict(repetition_penalty=1.8),
    "presence+frequency": dict(presence_penalty=1.5, frequency_penalty=1.0),
    "logit_bias": dict(logit_bias={12: 6.0, 263: -100.0, 8: 3.0}),
    "negative (repeats)": dict(repetition_penalty=0.8, frequency_penalty=-0.5),
    "all": dict(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=0.6, logit_bias={12: 3.0}, min_p=0.2),
}
MAX_NEW = 24
# A verify window's logits and a one-token step's come from float32 products of different row counts, which round
# differently (CPU targets fuse gate/up, so both run oneDNN: 1.05e-5 apart once on the 2-core CI CPU); a logprob
# read from the wrong row or distribution is not a rounding-sized difference
LOGPROB_TOL = 5e-5


def executor(registry, nodes: dict, num_draft: int, mtp_taps: bool = False) -> Executor:
    target = {**TARGET, "params": {**TARGET["params"], "tap_layers": [3]}} if mtp_taps else TARGET
    spec = GraphSpec.from_dict({"name": "t", "device": "cpu", "dtype": "float32", "num_draft": num_draft,
                                "nodes": {"target": target, **nodes, "verify": {"plugin": "verifier"}}})
    plan = build_plan(spec, registry)
    plan.raise_if_problems()
    return Executor(plan)


@pytest.fixture(scope="module")
def prompts():
    tok = Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))
    return [tok.encode(p, add_special_tokens=False).ids for p in PROMPTS]


@pytest.fixture(scope="module")
def target_only():
    from draftflow.core.registry import load_registry

    return executor(load_registry(), {}, 0)


@pytest.fixture(scope="module")
def references(target_only, prompts):
    """Target-only outputs per setting (and with no processors), computed once."""
    out = {}
    for name, settings in {"none": {}, **SETTINGS}.items():
        s = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, **settings)
        out[name] = [target_only.generate(p, s).token_ids for p in prompts]
    return out


def test_each_processor_changes_the_target_only_output(references):
    """The settings are strong enough to matter: every one changes what the target alone emits."""
    for name in SETTINGS:
        assert references[name] != references["none"], name


@pytest.mark.parametrize("drafter", list(DRAFTERS))
def test_greedy_speculative_equals_target_only_with_processors(drafter, references, prompts):
    """For each processor and all together, the drafter's greedy output is the target-only output; drafts are accepted."""
    from draftflow.core.registry import load_registry

    num_draft, nodes = DRAFTERS[drafter]
    ex = executor(load_registry(), nodes, num_draft, mtp_taps=drafter == "mtp")
    accepted = {}
    for name, settings in SETTINGS.items():
        s = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, **settings)
        results = [ex.generate(p, s) for p in prompts]
        assert [r.token_ids for r in results] == references[name], f"{drafter} with {name}"
        accepted[name] = sum(r.stats["accepted"] for r in results)
    # Penalties against repeats starve prompt lookup (the target stops repeating the prompt); negative ones feed it.
    assert accepted["negative (repeats)"] > 0 and accepted["logit_bias"] > 0, accepted


@pytest.mark.parametrize("drafter", ["lookup", "dflash"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_logprobs_with_speculation_equal_target_only(drafter, temperature, target_only, prompts):
    """Result.logprobs (chosen and top-3) with drafts equal target-only logprobs within LOGPROB_TOL, same tokens."""
    from draftflow.core.registry import load_registry

    num_draft, nodes = DRAFTERS[drafter]
    ex = executor(load_registry(), nodes, num_draft)
    s = SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True, logprobs=3, repetition_penalty=1.4, top_k=20,
                       temperature=temperature, seed=11)
    for prompt in prompts:
        spec, ref = ex.generate(prompt, s), target_only.generate(prompt, s)
        if temperature == 0:
            assert spec.token_ids == ref.token_ids
        assert len(spec.logprobs) == len(spec.token_ids) and len(ref.logprobs) == len(ref.token_ids)
        # Sampled runs diverge once their random streams do: rows are comparable while the prefixes agree
        # (the top-N at the first differing row too, since it depends only on the tokens before it).
        same = next((i for i, (a, b) in enumerate(zip(spec.token_ids, ref.token_ids)) if a != b), len(ref.token_ids))
        for i, (a, b) in enumerate(zip(spec.logprobs[:same + 1], ref.logprobs[:same + 1])):
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 3
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < LOGPROB_TOL
            if i < same:
                assert a.token == b.token == spec.token_ids[i]
                assert abs(a.logprob - b.logprob) < LOGPROB_TOL
            if temperature == 0:
                assert a.top[0][0] == a.token and a.logprob == a.top[0][1]  # greedy emits the likeliest token

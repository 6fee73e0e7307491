"""Rollback harness: the oracle drafter on a small random-weight target, checked after every cycle."""

from __future__ import annotations

import pytest
import torch

from draftflow.core.executor import Executor
from draftflow.core.hookspecs import hookimpl
from draftflow.core.node import SamplingParams
from draftflow.core.errors import RequestError
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec
from draftflow.layers.kv_cache import KVCache
from draftflow.tools.tiny_model import write_tiny_model

PROMPTS = ([5, 17, 42, 9], [200, 2, 2, 7, 81, 64, 11], [123])
NEW = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return write_tiny_model(tmp_path_factory.mktemp("tiny") / "m", vocab=300, hidden=64, layers=2, context=512, seed=3,
                            corpus=["speculative decoding keeps the output unchanged " * 20])


def graph(model_dir, oracle=None, num_draft=4, max_context=None) -> GraphSpec:
    nodes = {"target": {"plugin": "target", "params": {"path": str(model_dir)}}, "verify": {"plugin": "verifier"}}
    if oracle is not None:
        nodes["oracle"] = {"plugin": "oracle", "params": oracle}
    return GraphSpec.from_dict({"name": "harness", "num_draft": num_draft, "max_context": max_context, "nodes": nodes})


def executor(spec, registry):
    plan = build_plan(spec, registry)
    plan.raise_if_problems()
    return Executor(plan, hook=registry.pm.hook)


class CycleChecker:
    """A trace sink that inspects the target's state after every committed cycle."""

    def __init__(self, ex: Executor, reference: list[int], prompt: list[int]):
        self.ex, self.reference, self.prompt = ex, reference, prompt
        self.cycles, self.rejections, self.max_diff = 0, 0, 0.0
        self.events = []

    @hookimpl
    def draftflow_cycle_event(self, event):
        target = self.ex.nodes["target"]
        tokens = self.prompt + [t for e in self.events for t in e["emitted"]] + event["emitted"]
        self.events.append(event)
        self.cycles += 1
        self.rejections += event["accepted"] < len(event["draft"])
        generated = tokens[len(self.prompt):]
        # No rejected token stays committed: the committed output is a prefix of the reference.
        assert generated == self.reference[:len(generated)], f"cycle {event['cycle']}: committed tokens left the reference"
        # Cache length and positions are consistent with the anchor convention.
        assert target.cache.length == len(tokens) - 1 == event["position"] + len(event["emitted"])
        kv = target.cache.buffer[:, :, :, :target.cache.length]
        assert torch.isfinite(kv).all(), "non-finite values in the committed KV cache"
        # Next-token logits from the rolled-back cache equal a fresh run over the same tokens.
        with torch.inference_mode():
            anchor = torch.tensor([[tokens[-1]]])
            cached, _ = target.model(anchor, len(tokens) - 1, target.cache, logit_rows=1)
            fresh_cache = KVCache.growing(target.config, 1, len(tokens) + 1, torch.float32, "cpu")
            fresh, _ = target.model(torch.tensor([tokens]), 0, fresh_cache, logit_rows=1)
        assert torch.isfinite(cached).all()
        diff = (cached - fresh).abs().max().item() / fresh.abs().max().item()
        self.max_diff = max(self.max_diff, diff)
        assert diff < 1e-5, f"cycle {event['cycle']}: logits after rollback differ from a fresh run by {diff:.2e}"
        assert event["verify_ms"] > 0 and event["commit_ms"] >= 0


@pytest.mark.parametrize("case, oracle", [
    ("full acceptance", {}),
    ("partial acceptance", {"errors": [3, 9, 10, 30, 31, 32, 77, 100, 101, 126]}),
    ("first candidate wrong", {"wrong_draft_index": [0]}),
])
def test_rollback_after_every_cycle(model_dir, case, oracle):
    """After each cycle: only reference tokens committed, consistent cache, logits equal a fresh run."""
    registry = load_registry(autoload=False)
    greedy = SamplingParams(max_new_tokens=NEW, ignore_eos=True)
    ref_ex = executor(graph(model_dir), registry)
    for prompt in PROMPTS:
        reference = list(ref_ex.generate(prompt, greedy).token_ids)
        ex = executor(graph(model_dir, {"reference": reference, "vocab": 256, **oracle}), registry)
        checker = CycleChecker(ex, reference, list(prompt))
        registry.pm.register(checker)
        try:
            result = ex.generate(list(prompt), greedy)
        finally:
            registry.pm.unregister(checker)
        assert list(result.token_ids) == reference
        assert checker.cycles == result.stats["cycles"]
        if case == "full acceptance":
            assert result.stats["acceptance_rate"] == 1.0 and checker.rejections == 0
        else:
            assert checker.rejections > 0
        if case == "first candidate wrong":
            assert result.stats["accepted"] == 0 and result.stats["tau"] == 1.0


def test_stop_token_inside_accepted_run(model_dir):
    """A stop token among accepted drafts ends the output right after it."""
    registry = load_registry(autoload=False)
    prompt = list(PROMPTS[0])
    reference = list(executor(graph(model_dir), registry).generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True)).token_ids)
    stop = reference[13]
    ex = executor(graph(model_dir, {"reference": reference}, num_draft=6), registry)
    result = ex.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True, stop_token_ids=(stop,)))
    assert list(result.token_ids) == reference[:reference.index(stop) + 1] and result.finish_reason == "stop"


def test_context_end_mid_window(model_dir):
    """With a small context, the last windows shrink to fit; one token more is a clear error."""
    registry = load_registry(autoload=False)
    prompt = list(PROMPTS[1])
    spec = graph(model_dir, num_draft=8, max_context=64)
    reference = list(executor(spec, registry).generate(prompt, SamplingParams(max_new_tokens=64 - len(prompt), ignore_eos=True)).token_ids)
    ex = executor(graph(model_dir, {"reference": reference}, num_draft=8, max_context=64), registry)
    result = ex.generate(prompt, SamplingParams(max_new_tokens=64 - len(prompt), ignore_eos=True))
    assert list(result.token_ids) == reference and len(reference) == 64 - len(prompt)
    assert ex.nodes["target"].cache.length == 63
    with pytest.raises(RequestError, match=r"= 65 exceeds the context of 64 tokens"):
        ex.generate(prompt, SamplingParams(max_new_tokens=65 - len(prompt)))

"""At temperature > 0 the speculative loop samples the target's *processed* distribution exactly.

Penalties whose effect on the second token depends on the first: when the oracle's first
draft is accepted, the second token comes from window row 1, which must count that draft
as output. A negative control processes every row with the un-advanced prefix and fails.
"""

from __future__ import annotations

import pytest
import torch
from stat_utils import chi_square_pvalue
from test_loop_distribution import PROMPT, T, VOCAB, tiny_target

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.processors import LogitProcessor
from draftflow.plugins.target.hf_loader import load_hf

RUNS = 3000
SETTINGS = dict(repetition_penalty=2.0, presence_penalty=1.5, frequency_penalty=0.5, logit_bias={3: 0.7}, top_k=5)


def processed_row(logits_row: torch.Tensor, sequence: list[int], s: SamplingParams) -> torch.Tensor:
    """The sampling distribution after ``sequence``, processed the slow way (one position, host loops)."""
    out = logits_row.double().clone()
    output = sequence[len(PROMPT):]
    for tok in set(sequence):
        out[tok] = out[tok] / s.repetition_penalty if out[tok] > 0 else out[tok] * s.repetition_penalty
    for tok in set(output):
        out[tok] -= s.frequency_penalty * output.count(tok) + s.presence_penalty
    for tok, bias in s.logit_bias:
        out[tok] += bias
    out = out / T
    if s.top_k:
        out = out.masked_fill(out < out.topk(s.top_k).values[-1], float("-inf"))
    return out.softmax(-1)


def exact_joint(path, s: SamplingParams) -> torch.Tensor:
    """p(t1, t2 | prompt) of target-only sampling with the processors."""
    model = load_hf(path, "cpu", torch.float32).model
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for t1 in range(VOCAB):
        cache = KVCache.growing(model.config, 1, 8, torch.float32, "cpu")
        logits, _ = model(torch.tensor([PROMPT + [t1]]), 0, cache)
        p1 = processed_row(logits[0, -2], PROMPT, s)
        joint[t1] = p1[t1] * processed_row(logits[0, -1], PROMPT + [t1], s)
    return joint


def sampled_pairs(path, joint) -> tuple[torch.Tensor, int]:
    t1 = int(joint.sum(1).argmax())
    reference = [t1, int(joint[t1].argmax())]  # the likeliest pair: the first draft is often accepted
    spec = GraphSpec.from_dict({"num_draft": 2, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(path)}},
        "oracle": {"plugin": "oracle", "params": {"reference": reference}},
        "verify": {"plugin": "verifier"}}})
    plan = build_plan(spec, load_registry(autoload=False))
    plan.raise_if_problems()
    ex = Executor(plan)
    counts, accepted = torch.zeros(VOCAB * VOCAB), 0
    for seed in range(RUNS):
        r = ex.generate(PROMPT, SamplingParams(temperature=T, seed=seed, max_new_tokens=2, ignore_eos=True, **SETTINGS))
        counts[r.token_ids[0] * VOCAB + r.token_ids[1]] += 1
        accepted += r.stats["accepted"]
    return counts, accepted


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tiny_target(tmp_path_factory.mktemp("processed") / "t")
    s = SamplingParams(temperature=T, **SETTINGS)
    return path, exact_joint(path, s)


def test_sampled_pairs_follow_the_processed_target_distribution(model):
    """With penalties, bias and top-k, the first two emitted tokens follow target-only processed sampling."""
    path, joint = model
    plain = exact_joint(path, SamplingParams(temperature=T, repetition_penalty=1.0))
    assert (joint - plain).abs().sum() > 0.3  # the processors move the distribution a lot
    counts, accepted = sampled_pairs(path, joint)
    pvalue = chi_square_pvalue(counts, joint.flatten())
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e}: processed speculative sampling is not exact"
    assert 0.2 * RUNS < accepted < RUNS  # row 1 (after an accepted draft) emitted often, but not always


def test_processing_the_unadvanced_prefix_fails(model, monkeypatch):
    """Negative control: rows that ignore the drafts before them (the un-advanced prefix) fail the same test."""
    original = LogitProcessor.process
    monkeypatch.setattr(LogitProcessor, "process", lambda self, logits, drafts=None, allowed=None:
                        original(self, logits, None, allowed))
    path, joint = model
    counts, _ = sampled_pairs(path, joint)
    assert chi_square_pvalue(counts, joint.flatten()) < 1e-6

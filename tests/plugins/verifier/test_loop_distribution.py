"""End to end at temperature > 0: the whole speculative loop samples the target's own distribution."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from stat_utils import chi_square_pvalue
from safetensors.torch import save_file

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec
from draftflow.layers.config import TargetConfig
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.layers.kv_cache import KVCache
from draftflow.tools.tiny_model import hf_config, random_weights

VOCAB, PROMPT, RUNS, T = 6, [1, 4, 2], 3000, 1.3


def tiny_target(path):
    config = hf_config(VOCAB, 32, 1, 2, 1, 48, 64)
    cfg = TargetConfig.from_hf_dict(config, "config.json")
    path.mkdir()
    (path / "config.json").write_text(json.dumps(config))
    weights = random_weights(cfg, seed=5)
    weights["lm_head.weight"] *= 6  # a peaked but not degenerate next-token distribution
    save_file(weights, str(path / "model.safetensors"))
    return path


def exact_joint(path) -> torch.Tensor:
    """p(t1, t2 | prompt) at temperature T, from plain forwards of the target."""
    model = load_hf(path, "cpu", torch.float32).model
    joint = torch.zeros(VOCAB, VOCAB, dtype=torch.float64)
    for t1 in range(VOCAB):
        cache = KVCache.growing(model.config, 1, 8, torch.float32, "cpu")
        logits, _ = model(torch.tensor([PROMPT + [t1]]), 0, cache)
        p1 = torch.softmax(logits[0, -2].double() / T, -1)
        p2 = torch.softmax(logits[0, -1].double() / T, -1)
        joint[t1] = p1[t1] * p2
    return joint


@pytest.mark.slow
def test_sampled_pairs_match_target_only_distribution(tmp_path):
    """With an oracle drafter (one-hot q, drafts often wrong) the first two emitted tokens follow p exactly."""
    path = tiny_target(tmp_path / "t")
    joint = exact_joint(path)
    t1 = int(joint.sum(1).argmax())
    reference = [t1, int(joint[t1].argmax())]  # the likeliest pair: drafts are right often, not always
    registry = load_registry(autoload=False)
    spec = GraphSpec.from_dict({"num_draft": 2, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(path)}},
        "oracle": {"plugin": "oracle", "params": {"reference": reference}},
        "verify": {"plugin": "verifier"}}})
    plan = build_plan(spec, registry)
    plan.raise_if_problems()
    ex = Executor(plan)
    counts = torch.zeros(VOCAB * VOCAB)
    accepted = 0
    for seed in range(RUNS):
        r = ex.generate(PROMPT, SamplingParams(temperature=T, seed=seed, max_new_tokens=2, ignore_eos=True))
        counts[r.token_ids[0] * VOCAB + r.token_ids[1]] += 1
        accepted += r.stats["accepted"]
    probs = joint.flatten()
    pvalue = chi_square_pvalue(counts, probs)
    assert pvalue > 1e-3, f"chi-square p-value {pvalue:.2e}: the loop does not preserve the target distribution"
    assert 0 < accepted < RUNS * 2  # drafts were both accepted and rejected
    # seeded requests repeat exactly
    again = [ex.generate(PROMPT, SamplingParams(temperature=T, seed=s, max_new_tokens=6)).token_ids for s in (1, 2)]
    assert again == [ex.generate(PROMPT, SamplingParams(temperature=T, seed=s, max_new_tokens=6)).token_ids for s in (1, 2)]

"""Temperature > 0 is lossless: dflash2 candidates -> selector walk -> candidate-restricted rejection sampling
emits the target's distribution (tiny vocabulary, 100,000 draws, exact target probabilities).

The drafter node runs once inside a real graph to produce the candidates of the first cycle; the
random part of the cycle (the selector's walk and the verifier's rejection sampling) is then run
vectorised over many draws against the target's exact distributions for the drafted prefixes.
Checks: the first emitted token ~ p(. | prompt); after an accepted first draft, the second ~ p(. | x1),
which tests that row 2's q is the one conditioned on row 1's pick. A q that drops the pairwise term
(the drafts still come from the walk) must fail the same checks.
"""

from __future__ import annotations

import pytest
import torch
from dflash2_testlib import build_reference2, build_target, save_reference, write_graph
from stat_utils import chi_square_pvalue, total_variation

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import load_graph
from draftflow.plugins.dflash.dflash2_model import walk
from draftflow.verify import filter_logits, rejection_sample

VOCAB, MASK, TOP_K, T = 12, 11, 4, 0.9
PROMPT = [3, 4, 5, 6]
NUM_DRAWS = 100_000


@pytest.fixture(scope="module")
def cycle(tmp_path_factory):
    """Target model, the first cycle's candidates from the dflash2 node and its selector weights."""
    root = tmp_path_factory.mktemp("tiny")
    target = build_target(vocab=VOCAB, head_scale=1.0)
    target.save_pretrained(root / "target", safe_serialization=True)
    ref = build_reference2(seed=5, vocab=VOCAB, mask_id=MASK, selector_top_k=TOP_K)
    with torch.no_grad():
        ref.candidate_selector.successor_codebook.weight.mul_(3.0)  # a pairwise term that matters
    save_reference(ref, root / "drafter")
    graph = write_graph(root / "g.yaml", root / "target", root / "drafter", num_draft=2)
    ex = Executor(build_plan(load_graph(graph), load_registry()))
    node, seen = ex.nodes["drafter"], []
    step = node.step
    node.step = lambda req, inputs: seen.append(step(req, inputs)) or seen[-1]
    ex.generate(PROMPT, SamplingParams(temperature=T, max_new_tokens=3, seed=0))
    return target, seen[0]["candidates"]


def target_probs(target, rows: torch.Tensor) -> torch.Tensor:
    """p after the prompt and each prefix in `rows` [N, J]: [N, J+1, V] (filtered at temperature T)."""
    ids = torch.cat([torch.tensor(PROMPT).expand(rows.shape[0], -1), rows], dim=1)
    with torch.no_grad():
        logits = target(ids).logits[:, len(PROMPT) - 1:].float()
    return filter_logits(logits, T)


def run_cycle(target, cand, broken_q: bool, seed: int = 0):
    """Vectorised cycles: (emitted [N, K+1], accepted [N])."""
    gen = torch.Generator().manual_seed(seed)
    n = NUM_DRAWS
    ids, scores, hidden = (t.expand(n, *t.shape[1:]) for t in (cand.ids, cand.scores, cand.hidden))
    drafts, q = walk(cand.selector, ids, scores, hidden, torch.full((n,), PROMPT[-1]), T, gen)  # [N, K], [N, K, M]
    if broken_q:
        q = (scores / T).softmax(-1)  # the unary q: wrong for drafts drawn by the walk
    # Distinct prefixes are few (at most M^K): evaluate the target once per distinct draft row.
    unique, inverse = drafts.unique(dim=0, return_inverse=True)
    probs = target_probs(target, unique)[inverse]  # [N, K+1, V]
    accepted, emitted = rejection_sample(drafts, probs, q, ids, generator=gen)
    return emitted, accepted


def fit(target, emitted, accepted):
    """(p-value, TV) of x1 against p(. | prompt) and of x2 | x1 (first draft accepted) against p(. | x1)."""
    p1 = target_probs(target, torch.empty(1, 0, dtype=torch.long))[0, 0]  # [V]
    counts1 = torch.bincount(emitted[:, 0], minlength=VOCAB)
    p2 = target_probs(target, torch.arange(VOCAB)[:, None])[:, 1]  # [V, V]: p(. | x1)
    kept = accepted >= 1
    pairs = torch.bincount(emitted[kept, 0] * VOCAB + emitted[kept, 1], minlength=VOCAB * VOCAB).view(VOCAB, VOCAB)
    expected = pairs.sum(1, keepdim=True) * p2  # counts per x1 times p(x2 | x1)
    probs2 = (expected / expected.sum()).flatten()
    return (chi_square_pvalue(counts1, p1), total_variation(counts1, p1),
            chi_square_pvalue(pairs.flatten(), probs2), total_variation(pairs.flatten(), probs2), float(kept.float().mean()))


@pytest.mark.slow
def test_selector_cycle_emits_the_target_distribution(cycle):
    """x1 ~ p(. | prompt) and x2 | x1 ~ p(. | x1) (chi-square p > 1e-3, small TV); drafts both accepted and rejected."""
    target, cand = cycle
    assert cand.ids.shape == (1, 2, TOP_K) and cand.hidden.shape[1] == 2
    pv1, tv1, pv2, tv2, accept_rate = fit(target, *run_cycle(target, cand, broken_q=False))
    assert 0.05 < accept_rate < 0.95, accept_rate
    assert pv1 > 1e-3 and tv1 < 0.02, (pv1, tv1)
    assert pv2 > 1e-3 and tv2 < 0.03, (pv2, tv2)


@pytest.mark.slow
def test_wrong_q_is_detected(cycle):
    """Negative control: handing the verifier the unary q instead of the walk's q fails the same checks."""
    target, cand = cycle
    pv1, _, pv2, _, _ = fit(target, *run_cycle(target, cand, broken_q=True))
    assert max(pv1, pv2) < 1e-6, (pv1, pv2)  # both checks have power

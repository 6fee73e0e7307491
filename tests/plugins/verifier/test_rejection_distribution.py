"""rejection_sample is lossless: emitted tokens follow the target distribution for every q form.

Each check draws >= 200,000 samples in one vectorised call and compares the histogram with
the exact target distribution by chi-square (p-value > 1e-3) and total variation. A broken
accept rule run through the same checks must fail them, so the checks have power.
"""

import pytest
import torch
from stat_utils import chi_square_pvalue, total_variation

import draftflow.plugins.verifier.accept as accept_module
from draftflow.verify import rejection_sample, sample

NUM_DRAWS = 200_000
FORMS = ["full", "one_hot", "candidates"]


def _broken_accept_flags(uniform, target_at_draft, draft_at_draft):
    """The accept rule with p and q swapped: accepts with probability min(1, q/p)."""
    return (target_at_draft > 0) & (uniform * target_at_draft < draft_at_draft)


def _broken_residual(target_row, *unused):
    """A subtler bug: the recovered token is drawn from p instead of max(0, p - q)."""
    return target_row


# Each entry replaces one private step of accept.py with a wrong version.
BROKEN_STEPS = {"_accept_flags": _broken_accept_flags, "_residual": _broken_residual}


def _draft(form: str, draft_dist: torch.Tensor, generator: torch.Generator, num_candidates: int = 3):
    """Draft one token per row from `draft_dist` [N, V] the way each kind of drafter does.

    Returns the draft ids [N] and the q that produced them in rejection_sample's form:
    full q [N, V]; None (one-hot q: the draft is the argmax); or ([N, C] q, [N, C] ids)
    for a drafter sampling among its top-C candidates.
    """
    if form == "full":
        return sample(draft_dist, generator), draft_dist, None
    if form == "one_hot":
        return draft_dist.argmax(-1), None, None
    candidate_ids = draft_dist.topk(num_candidates, dim=-1).indices  # [N, C]
    candidate_probs = draft_dist.gather(-1, candidate_ids)
    candidate_probs = candidate_probs / candidate_probs.sum(-1, keepdim=True)
    choice = sample(candidate_probs, generator)  # [N]
    return candidate_ids.gather(-1, choice[:, None])[:, 0], candidate_probs, candidate_ids


def _single_position_fit(form: str, seed: int) -> tuple[float, float, float]:
    """Chi-square p-value, total variation of the first emitted token against p (K = 1), accept rate."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size = 12
    target = (torch.randn(vocab_size, generator=generator) * 1.5).softmax(-1)  # [V] p
    # Per-row drafter distributions, so one-hot drafts (their argmax) vary across rows; the
    # shared part keeps the argmax far from uniform, else a residual bug cancels out on average.
    draft_logits = torch.randn(vocab_size, generator=generator) * 1.5  # [V]
    noise = torch.randn(NUM_DRAWS, vocab_size, generator=generator)
    draft_dist = (draft_logits + noise).softmax(-1)  # [N, V]
    drafts, draft_probs, candidate_ids = _draft(form, draft_dist, generator)
    unsqueeze = (lambda t: None if t is None else t[:, None])  # add the K = 1 axis
    target_probs = target.expand(NUM_DRAWS, 2, vocab_size)  # [N, K+1, V]
    accepted, emitted = rejection_sample(
        drafts[:, None], target_probs, unsqueeze(draft_probs), unsqueeze(candidate_ids), generator=generator
    )
    counts = torch.bincount(emitted[:, 0], minlength=vocab_size)
    return chi_square_pvalue(counts, target), total_variation(counts, target), float(accepted.float().mean())


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_single_position_emits_target_distribution(form):
    """The first emitted token is distributed as p for full, one-hot and candidate q."""
    pvalue, distance, accept_rate = _single_position_fit(form, seed=2)
    assert pvalue > 1e-3
    assert distance < 0.01
    assert 0.05 < accept_rate < 0.95  # both the accept and the recovery path were exercised


@pytest.mark.slow
@pytest.mark.parametrize("broken_step", sorted(BROKEN_STEPS))
@pytest.mark.parametrize("form", FORMS)
def test_single_position_check_catches_broken_sampler(form, broken_step, monkeypatch):
    """Negative control: a swapped accept rule or a residual-free recovery fails the same check."""
    monkeypatch.setattr(accept_module, broken_step, BROKEN_STEPS[broken_step])
    pvalue, _, _ = _single_position_fit(form, seed=2)
    assert pvalue < 1e-6


def test_no_drafts_emits_target_distribution():
    """With K = 0 the single emitted token is a plain sample from p."""
    generator = torch.Generator().manual_seed(3)
    target = (torch.randn(10, generator=generator) * 1.5).softmax(-1)  # [V]
    accepted, emitted = rejection_sample(
        torch.zeros(NUM_DRAWS, 0, dtype=torch.long), target.expand(NUM_DRAWS, 1, 10), generator=generator
    )
    counts = torch.bincount(emitted[:, 0], minlength=10)
    assert bool((accepted == 0).all())
    assert chi_square_pvalue(counts, target) > 1e-3
    assert total_variation(counts, target) < 0.01


def _markov_cycle(form, start, target_chain, draft_chain, generator, num_drafts=3):
    """One speculative cycle of K drafts from `start` [N]; returns (accepted [N], emitted [N, K+1])."""
    previous, drafts, draft_probs, candidate_ids = start, [], [], []
    for _ in range(num_drafts):  # the drafter runs autoregressively on its own tokens
        draft, probs, ids = _draft(form, draft_chain[previous], generator, num_candidates=2)
        drafts.append(draft)
        draft_probs.append(probs)
        candidate_ids.append(ids)
        previous = draft
    drafts = torch.stack(drafts, dim=1)  # [N, K]
    context = torch.cat([start[:, None], drafts], dim=1)  # [N, K+1]: token each target row conditions on
    stack = (lambda items: None if items[0] is None else torch.stack(items, dim=1))
    return rejection_sample(
        drafts, target_chain[context], stack(draft_probs), stack(candidate_ids), generator=generator
    )


def _markov_fit(form: str, seed: int, num_tokens: int = 3) -> tuple[float, float]:
    """Chi-square p-value and total variation of the first 3 emitted tokens against the target chain."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size = 5
    # [V, V] transition matrices, row = previous token: P for the target, Q for the drafter.
    target_chain = (torch.randn(vocab_size, vocab_size, generator=generator) * 1.2).softmax(-1)
    draft_chain = (torch.randn(vocab_size, vocab_size, generator=generator) * 1.2).softmax(-1)
    start = torch.zeros(NUM_DRAWS, dtype=torch.long)  # [N], every sequence starts after token 0
    # Each cycle emits >= 1 token, so num_tokens cycles always give num_tokens tokens.
    emitted_cycles, last = [], start
    for _ in range(num_tokens):
        accepted, emitted = _markov_cycle(form, last, target_chain, draft_chain, generator)
        emitted_cycles.append(emitted)
        last = emitted.gather(1, accepted[:, None])[:, 0]  # the chain continues from the last emitted token
    emitted = torch.cat(emitted_cycles, dim=1)  # [N, cycles * (K+1)], -1 between cycles
    valid_first = (emitted < 0).long().argsort(dim=1, stable=True)[:, :num_tokens]  # left-pack real tokens
    tokens = emitted.gather(1, valid_first)  # [N, 3]
    cells = (tokens[:, 0] * vocab_size + tokens[:, 1]) * vocab_size + tokens[:, 2]
    counts = torch.bincount(cells, minlength=vocab_size**3)
    # Exact joint of sampling the target alone: P[0, t1] P[t1, t2] P[t2, t3].
    exact = target_chain[0][:, None, None] * target_chain[:, :, None] * target_chain[None, :, :]
    return chi_square_pvalue(counts, exact.flatten()), total_variation(counts, exact.flatten())


@pytest.mark.slow
@pytest.mark.parametrize("form", FORMS)
def test_markov_chain_joint_of_three_emitted_tokens_matches_target(form):
    """Across cycles with K = 3, the joint of the first 3 emitted tokens equals the target chain's."""
    pvalue, distance = _markov_fit(form, seed=1)
    assert pvalue > 1e-3
    assert distance < 0.02


@pytest.mark.slow
def test_markov_check_catches_broken_accept_rule(monkeypatch):
    """Negative control: the swapped accept rule fails the multi-position joint check."""
    monkeypatch.setattr(accept_module, "_accept_flags", _broken_accept_flags)
    pvalue, _ = _markov_fit("full", seed=1)
    assert pvalue < 1e-6

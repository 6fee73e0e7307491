"""Behaviour tests for rejection_sample: edge cases, seeding, filters, greedy limit, no sync."""

import pytest
import torch

from draftflow.verify import filter_logits, greedy_accept, rejection_sample

B, K, V, C = 2_000, 3, 50, 4


def _case(seed: int):
    """Random target logits [B, K+1, V], drafter probs [B, K, V] and drafts [B, K] sampled from them."""
    generator = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(B, K + 1, V, generator=generator) * 2
    draft_probs = (torch.randn(B, K, V, generator=generator) * 2).softmax(-1)
    drafts = torch.multinomial(draft_probs.reshape(-1, V), 1, generator=generator).reshape(B, K)
    return target_logits, draft_probs, drafts


def _candidate_form(draft_probs: torch.Tensor, drafts: torch.Tensor):
    """q over C candidates that always contain the draft: [B, K, C] probs and ids."""
    others = (draft_probs.topk(C, dim=-1).indices + 1) % V  # [B, K, C], may hit the draft
    candidate_ids = torch.cat([drafts[..., None], others[..., 1:]], dim=-1)
    # Any positive q over the candidates will do; this one differs from p on purpose.
    return candidate_ids.float().sin().abs().softmax(-1), candidate_ids


def _q_forms(draft_probs, drafts):
    """The three forms of q as (draft_probs, candidate_ids) keyword sets."""
    candidate_probs, candidate_ids = _candidate_form(draft_probs, drafts)
    return {
        "one_hot": {},
        "full": {"draft_probs": draft_probs},
        "candidates": {"draft_probs": candidate_probs, "candidate_ids": candidate_ids},
    }


@pytest.mark.parametrize("form", ["one_hot", "full", "candidates"])
def test_seeded_runs_repeat_and_seeds_differ(form):
    """The same generator seed gives identical outputs; another seed gives different ones."""
    target_logits, draft_probs, drafts = _case(0)
    target_probs = filter_logits(target_logits, temperature=1.0)
    kwargs = _q_forms(draft_probs, drafts)[form]
    first = rejection_sample(drafts, target_probs, generator=torch.Generator().manual_seed(11), **kwargs)
    again = rejection_sample(drafts, target_probs, generator=torch.Generator().manual_seed(11), **kwargs)
    other = rejection_sample(drafts, target_probs, generator=torch.Generator().manual_seed(12), **kwargs)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert not torch.equal(first[1], other[1])


@pytest.mark.parametrize(("top_k", "top_p"), [(1, None), (5, None), (None, 0.5), (None, 0.9), (10, 0.8)])
@pytest.mark.parametrize("form", ["one_hot", "full", "candidates"])
def test_every_emitted_token_is_in_the_filtered_set(form, top_k, top_p):
    """With top-k/top-p, accepted, recovered and bonus tokens all lie in the allowed set."""
    target_logits, draft_probs, drafts = _case(1)
    target_probs = filter_logits(target_logits, temperature=0.8, top_k=top_k, top_p=top_p)
    allowed = target_probs > 0  # [B, K+1, V]
    kwargs = _q_forms(draft_probs, drafts)[form]
    _, emitted = rejection_sample(drafts, target_probs, generator=torch.Generator().manual_seed(2), **kwargs)
    is_emitted = emitted >= 0  # [B, K+1]
    in_allowed = allowed.gather(-1, emitted.clamp_min(0)[..., None])[..., 0]
    assert bool(in_allowed[is_emitted].all())
    # The drafter ignores the filter, so the check above had disallowed drafts to reject.
    assert not bool(allowed[:, :K].gather(-1, drafts[..., None]).all())


@pytest.mark.parametrize("form", ["one_hot", "full", "candidates"])
def test_temperature_zero_reproduces_greedy(form):
    """With p = filter_logits(T=0), rejection sampling returns exactly greedy_accept's result."""
    target_logits, draft_probs, drafts = _case(3)
    # Make about half of the drafts agree with the target so accept counts vary.
    agree = torch.rand(B, K, generator=torch.Generator().manual_seed(4)) < 0.7
    drafts = torch.where(agree, target_logits[:, :K].argmax(-1), drafts)
    # Any q that proposed the drafts gives them mass; mix in a one-hot at the draft to be sure.
    draft_probs = 0.5 * draft_probs + 0.5 * torch.nn.functional.one_hot(drafts, V)
    kwargs = _q_forms(draft_probs, drafts)[form]
    target_probs = filter_logits(target_logits, temperature=0.0)
    got = rejection_sample(drafts, target_probs, generator=torch.Generator().manual_seed(5), **kwargs)
    expected = greedy_accept(drafts, target_logits)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])
    assert len(set(expected[0].tolist())) == K + 1  # every accept count occurred


@pytest.mark.parametrize("form", ["one_hot", "full", "candidates"])
def test_no_drafts_emits_one_target_sample(form):
    """K = 0 accepts nothing and emits one token drawn from the single target row."""
    target_probs = torch.zeros(4, 1, 6)
    target_probs[:, 0, 3] = 1.0  # [4, 1, 6]: the target can only emit id 3
    kwargs = {
        "one_hot": {},
        "full": {"draft_probs": torch.zeros(4, 0, 6)},
        "candidates": {"draft_probs": torch.zeros(4, 0, 2), "candidate_ids": torch.zeros(4, 0, 2, dtype=torch.long)},
    }[form]
    accepted, emitted = rejection_sample(torch.zeros(4, 0, dtype=torch.long), target_probs, **kwargs)
    assert accepted.tolist() == [0] * 4
    assert emitted.tolist() == [[3]] * 4


def test_one_hot_recovered_token_never_repeats_the_rejected_draft():
    """With q one-hot, the residual is p without the draft, so the recovered token differs from it."""
    target_logits, _, drafts = _case(6)
    generator = torch.Generator().manual_seed(7)
    accepted, emitted = rejection_sample(drafts, target_logits.softmax(-1), generator=generator)
    rejected_first = accepted == 0
    assert bool(rejected_first.any())
    assert not bool((emitted[rejected_first, 0] == drafts[rejected_first, 0]).any())


def test_draft_without_draft_mass_is_rejected():
    """A draft with q(x) = 0 is rejected even when p(x) is large, for full and candidate q."""
    target_probs = torch.full((8, 2, 4), 0.25)  # [8, 2, 4]
    drafts = torch.full((8, 1), 2)
    full_q = torch.tensor([0.5, 0.5, 0.0, 0.0]).expand(8, 1, 4)
    candidate_q, candidate_ids = torch.ones(8, 1, 2) / 2, torch.tensor([0, 1]).expand(8, 1, 2)
    for kwargs in ({"draft_probs": full_q}, {"draft_probs": candidate_q, "candidate_ids": candidate_ids}):
        accepted, emitted = rejection_sample(drafts, target_probs, **kwargs)
        assert accepted.tolist() == [0] * 8
        assert set(emitted[:, 0].tolist()) <= {2, 3}  # residual max(0, p - q) lives on {2, 3}


def test_all_zero_residual_falls_back_to_target():
    """When q >= p everywhere the residual is empty and the recovered token comes from p."""
    probs = torch.tensor([0.0, 0.5, 0.5])  # p == q, and the draft (id 0) has p = q = 0
    accepted, emitted = rejection_sample(
        torch.zeros(1000, 1, dtype=torch.long), probs.expand(1000, 2, 3), draft_probs=probs.expand(1000, 1, 3)
    )
    assert accepted.tolist() == [0] * 1000
    assert set(emitted[:, 0].tolist()) == {1, 2}  # an all-zero row would have given id 0


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"candidate_ids": torch.zeros(2, 3, 4, dtype=torch.long)}, "candidate_ids given without draft_probs"),
        ({"draft_probs": torch.zeros(2, 3, 7)}, r"draft_probs has shape \(2, 3, 7\), expected \[2, 3, 6\]"),
        (
            {"draft_probs": torch.zeros(2, 3, 4), "candidate_ids": torch.zeros(2, 3, 5, dtype=torch.long)},
            r"must both be \[2, 3, C\]",
        ),
    ],
)
def test_inconsistent_draft_probs_are_rejected(kwargs, message):
    """draft_probs/candidate_ids outside the three q forms raise ValueError with the fix."""
    with pytest.raises(ValueError, match=message):
        rejection_sample(torch.zeros(2, 3, dtype=torch.long), torch.zeros(2, 4, 6), **kwargs)


@pytest.mark.parametrize("form", ["one_hot", "full", "candidates"])
def test_traces_as_one_graph_without_host_sync(form):
    """torch.compile(fullgraph=True) succeeds, so there is no .item() or branch on tensor values.

    generator=None here: dynamo cannot trace a torch.Generator argument (a tracing
    limitation, not a sync). CUDA sync-debug mode needs a GPU and is not run here.
    """
    torch._dynamo.reset()
    target_logits, draft_probs, drafts = _case(8)
    kwargs = _q_forms(draft_probs, drafts)[form]
    compiled_filter = torch.compile(filter_logits, fullgraph=True, backend="eager")
    compiled_sample = torch.compile(rejection_sample, fullgraph=True, backend="eager")
    compiled_greedy = torch.compile(greedy_accept, fullgraph=True, backend="eager")
    target_probs = compiled_filter(target_logits, 0.7, 10, 0.9)
    accepted, emitted = compiled_sample(drafts, target_probs, **kwargs)
    assert emitted.shape == (B, K + 1) and accepted.shape == (B,)
    compiled_greedy(drafts, target_logits)

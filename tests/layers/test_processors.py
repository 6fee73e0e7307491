"""layers.processors against a naive per-position Python reference, and min-p in layers.sampling."""

from __future__ import annotations

import math

import pytest
import torch

from draftflow.core.node import SamplingParams
from draftflow.layers.processors import LogitProcessor, draft_counts
from draftflow.layers.sampling import filter_logits, filter_scores

V = 12


def naive_row(logits_row, sequence, prompt_len, s: SamplingParams):
    """One row processed the slow, obvious way: ``sequence`` is everything committed before it (drafts included)."""
    out = [float(x) for x in logits_row]
    output = sequence[prompt_len:]
    for tok in set(sequence):
        if s.repetition_penalty != 1.0:
            out[tok] = out[tok] / s.repetition_penalty if out[tok] > 0 else out[tok] * s.repetition_penalty
    for tok in set(output):
        count = output.count(tok)
        out[tok] -= s.frequency_penalty * count + s.presence_penalty
    for tok, bias in s.logit_bias:
        out[tok] += bias
    return out


def window_case(seed, num_drafts=4):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, num_drafts + 1, V, generator=g) * 3  # [1, W, V], positive and negative
    committed = torch.randint(0, V, (9,), generator=g).tolist()
    drafts = torch.randint(0, V, (1, num_drafts), generator=g)  # [1, K], repeats likely with V = 12
    return logits, committed, drafts


SETTINGS = [
    dict(repetition_penalty=1.7),
    dict(repetition_penalty=0.6),
    dict(presence_penalty=1.5),
    dict(frequency_penalty=-0.7),
    dict(logit_bias={3: 4.5, 7: -100.0}),
    dict(repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.8, logit_bias={0: 2.0}),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=lambda d: "+".join(d))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_window_rows_match_naive_reference_with_drafts_before_them(settings, seed):
    """Row j equals the per-position reference over committed + drafts[:j] (prompt/output split respected)."""
    logits, committed, drafts = window_case(seed)
    s = SamplingParams(**settings)
    prompt_len = 5
    proc = LogitProcessor(s, committed, prompt_len, V, "cpu")
    got = proc.process(logits, drafts)  # [1, W, V]
    for j in range(logits.shape[1]):
        sequence = committed + drafts[0, :j].tolist()
        expected = torch.tensor(naive_row(logits[0, j], sequence, prompt_len, s))
        torch.testing.assert_close(got[0, j], expected, rtol=1e-6, atol=1e-5)


def test_drafts_change_later_rows_only():
    """A penalty's effect on row j depends on the drafts before j: the same window without drafts differs after row 0."""
    logits, committed, drafts = window_case(3)
    s = SamplingParams(repetition_penalty=2.0, frequency_penalty=1.0)
    proc = LogitProcessor(s, committed, 2, V, "cpu")
    advanced, frozen = proc.process(logits, drafts), proc.process(logits, None)
    torch.testing.assert_close(advanced[:, 0], frozen[:, 0])
    assert not torch.allclose(advanced[:, 1:], frozen[:, 1:])


def test_commit_in_pieces_equals_building_from_all_tokens():
    """Counts advanced by commit (prompt, then output in pieces) equal counts built at once."""
    _, committed, _ = window_case(4)
    s = SamplingParams(repetition_penalty=1.5, presence_penalty=0.3, frequency_penalty=0.4)
    whole = LogitProcessor(s, committed, 4, V, "cpu")
    pieces = LogitProcessor(s, committed[:3], 4, V, "cpu")
    pieces.commit(committed[3:6])
    pieces.commit(committed[6:])
    assert torch.equal(whole.seen, pieces.seen) and torch.equal(whole.output_counts, pieces.output_counts)
    assert whole.output_counts.sum() == len(committed) - 4


def test_follow_advances_the_same_request_and_restarts_for_a_new_one():
    """follow() counts only the new tokens of the request it tracks and rebuilds for another request."""

    class Req:
        def __init__(self, tokens):
            self.tokens, self.prompt_len, self.sampling = tokens, 2, SamplingParams(frequency_penalty=1.0)

    req = Req([1, 2, 3])
    proc = LogitProcessor.follow(None, req, V, "cpu")
    req.tokens += [3, 5]
    assert LogitProcessor.follow(proc, req, V, "cpu") is proc
    assert proc.output_counts[0, 3] == 2 and proc.output_counts[0, 5] == 1
    other = LogitProcessor.follow(proc, Req([3]), V, "cpu")
    assert other is not proc and other.output_counts.sum() == 0


def test_draft_counts_are_cumulative_over_the_window():
    """Row j of draft_counts counts drafts[:j]."""
    counts = draft_counts(torch.tensor([[2, 2, 5]]), 6)  # [1, 4, 6]
    assert counts[0, :, 2].tolist() == [0, 1, 2, 2] and counts[0, :, 5].tolist() == [0, 0, 0, 1]


def test_grammar_mask_sets_disallowed_tokens_to_minus_infinity():
    """Tokens outside a row's allowed set get -inf; allowed ones keep their processed score."""
    logits, committed, drafts = window_case(5, num_drafts=2)
    allowed = torch.rand(3, V, generator=torch.Generator().manual_seed(0)) > 0.5
    out = LogitProcessor(SamplingParams(), committed, 1, V, "cpu").process(logits, drafts, allowed)
    assert torch.isinf(out[0][~allowed]).all()
    torch.testing.assert_close(out[0][allowed], logits[0][allowed])


@pytest.mark.parametrize("min_p", [0.05, 0.3, 1.0])
def test_min_p_drops_tokens_below_a_fraction_of_the_top_probability(min_p):
    """min_p keeps exactly the tokens with p >= min_p * max p (after temperature), renormalised."""
    logits = torch.randn(50, V, generator=torch.Generator().manual_seed(6)) * 2  # [50, V]
    full = (logits / 0.8).softmax(-1)
    probs = filter_logits(logits, temperature=0.8, min_p=min_p)
    keep = full >= min_p * full.max(-1, keepdim=True).values
    assert torch.equal(probs > 0, keep)
    torch.testing.assert_close(probs, torch.where(keep, full, 0) / torch.where(keep, full, 0).sum(-1, keepdim=True))


def test_filter_scores_log_softmax_is_the_log_of_filter_logits():
    """filter_scores' log_softmax are the exact logprobs of filter_logits' distribution (top-k, top-p, min-p)."""
    logits = torch.randn(20, V, generator=torch.Generator().manual_seed(7))
    probs = filter_logits(logits, 1.3, top_k=8, top_p=0.9, min_p=0.1)
    logp = filter_scores(logits, 1.3, top_k=8, top_p=0.9, min_p=0.1).log_softmax(-1)
    torch.testing.assert_close(logp.exp(), probs)
    assert math.isinf(float(logp[probs == 0].max()))


def test_bad_min_p_is_refused_with_the_fix():
    """min_p outside [0, 1] raises a ValueError that says how to turn it off."""
    with pytest.raises(ValueError, match=r"min_p=1.5 is outside \[0, 1\]; use 0 or None"):
        filter_logits(torch.zeros(3), 1.0, min_p=1.5)

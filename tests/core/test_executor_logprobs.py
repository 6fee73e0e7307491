"""The executor reads logprobs with the verdict and exposes them; the trace names active processors."""

from __future__ import annotations

import math

import pytest
import toy_plugins
from test_executor_steps import Recorder, executor, run_steps

from draftflow.core.errors import RequestError
from draftflow.core.node import SamplingParams
from draftflow.core.request import TokenLogprob

VOCAB = 32  # good_toy.yaml: the toy target scores its next token +5, every other token -5
CHOSEN = 5 - math.log(math.exp(5) + (VOCAB - 1) * math.exp(-5))
OTHER = -5 - math.log(math.exp(5) + (VOCAB - 1) * math.exp(-5))


def test_logprobs_per_token_from_cycles_and_result(registry):
    """Each emitted token gets a TokenLogprob (its logprob, top-2 alternatives) in its CycleResult and the Result."""
    ex = executor(registry)  # the toy drafter is wrong at draft 2: accepted and rejected drafts both occur
    state, cycles = run_steps(ex, [1, 2, 3], SamplingParams(max_new_tokens=11, logprobs=2))
    result = ex.finish(state)
    assert len(result.logprobs) == len(result.token_ids) == 11
    assert [lp for c in cycles for lp in c.logprobs] == list(result.logprobs)
    for lp, tok in zip(result.logprobs, result.token_ids):
        assert isinstance(lp, TokenLogprob) and lp.token == tok
        assert lp.logprob == pytest.approx(CHOSEN, abs=1e-5)
        assert lp.top[0] == (tok, pytest.approx(CHOSEN, abs=1e-5)) and lp.top[1][1] == pytest.approx(OTHER, abs=1e-5)
    assert any(c.accepted > 0 for c in cycles) and any(c.accepted < len(c.draft) for c in cycles)


def test_logprobs_zero_gives_the_chosen_token_only_and_follow_cuts(registry):
    """logprobs=0: no alternatives; a stop token and finish(kept=...) cut the logprobs with the tokens."""
    ref = toy_plugins.reference([1, 2, 3], 20, VOCAB)
    ex = executor(registry, f"nodes.target.eos=[{ref[4]}]", "num_draft=6", "nodes.drafter.wrong_at=[]")
    state, cycles = run_steps(ex, [1, 2, 3], SamplingParams(max_new_tokens=20, logprobs=0))
    assert cycles[-1].finish == "stop" and len(cycles[-1].logprobs) == len(cycles[-1].emitted)
    result = ex.finish(state, kept=3)
    assert [lp.token for lp in result.logprobs] == ref[:3] and all(lp.top == () for lp in result.logprobs)


def test_no_logprobs_unless_asked(registry):
    """Without logprobs, CycleResult.logprobs and Result.logprobs are None."""
    ex = executor(registry)
    state, cycles = run_steps(ex, [1, 2, 3], SamplingParams(max_new_tokens=6))
    assert all(c.logprobs is None for c in cycles) and ex.finish(state).logprobs is None


def test_cycle_event_names_active_processors_only_when_any(registry):
    """draft_cycle carries "processors" (in run order) when a request turns any on, and no such key otherwise."""
    sink = Recorder()
    ex = executor(registry, sink=sink)
    sampling = SamplingParams(max_new_tokens=6, repetition_penalty=1.2, logit_bias={0: 1.0}, frequency_penalty=0.1)
    ex.generate([1, 2, 3], sampling)
    assert {tuple(e["processors"]) for e in sink.cycles} == {("repetition", "frequency", "logit_bias")}
    sink.cycles.clear()
    ex.generate([1, 2, 3], SamplingParams(max_new_tokens=6, logprobs=1, temperature=0.5, top_p=0.9))
    assert sink.cycles and not any("processors" in e for e in sink.cycles)


def test_logit_bias_outside_the_vocabulary_is_refused(registry):
    """A logit_bias token id past the target's vocabulary is a RequestError naming the field and the range."""
    ex = executor(registry)
    with pytest.raises(RequestError, match=r"'logit_bias' names token id 32, outside the vocabulary \[0, 32\)"):
        ex.generate([1, 2, 3], SamplingParams(logit_bias={32: 1.0}))


def test_processors_change_the_toy_output_identically_with_and_without_drafts(registry):
    """A bias against the toy target's favourite token changes the output, the same way with drafts or without."""
    ref = toy_plugins.reference([1, 2, 3], 8, VOCAB)
    sampling = SamplingParams(max_new_tokens=8, logit_bias={ref[2]: -20.0}, presence_penalty=2.0)
    spec = executor(registry).generate([1, 2, 3], sampling)
    alone = executor(registry, "num_draft=0").generate([1, 2, 3], sampling)
    assert spec.token_ids == alone.token_ids and list(spec.token_ids) != ref

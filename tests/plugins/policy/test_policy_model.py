"""The adaptive policy's acceptance and cost models, and its choice of K, on scripted observations."""

from __future__ import annotations

import pytest

from draftflow.core.node import Batch, CommitInfo, CycleCost, NodeContext, RequestState, SamplingParams
from draftflow.plugins.policy.model import COST_SAMPLES, Acceptance, CycleCosts, bucket
from draftflow.plugins.policy.plugin import AdaptiveK


def test_expected_tokens_is_one_plus_the_prefix_products():
    assert Acceptance.expected([0.5, 0.5, 0.5], 0) == 1.0
    assert Acceptance.expected([0.5, 0.5, 0.5], 3) == pytest.approx(1 + 0.5 + 0.25 + 0.125)
    assert Acceptance.expected([1.0] * 8, 8) == 9.0


def test_rates_follow_a_request_and_fall_back_to_all_requests():
    acc = Acceptance(4)
    for _ in range(50):
        acc.update("good", 4, 4)  # every draft accepted
        acc.update("bad", 4, 0)  # the first draft rejected: positions 2..4 never tried
    good, bad, new = acc.rates("good", 4), acc.rates("bad", 4), acc.rates("new", 4)
    assert good[0] > 0.85 and bad[0] < 0.15  # own counts (~20 after forgetting) against a prior of weight 4
    assert 0.3 < new[0] < 0.7  # all requests: half and half
    assert good[3] > 0.9  # only "good" tried position 4, always accepted
    acc.forget("good")
    assert acc.rates("good", 4) == acc.rates("new", 4)


def test_rates_are_kept_per_k_and_an_untried_k_borrows_the_pooled_ones():
    """A block drafter's first drafts are accepted more in a wider block: each K keeps its own rates."""
    acc = Acceptance(8)
    for _ in range(40):
        acc.update("r", 7, 7)  # the 8-row block: all accepted
        acc.update("r", 3, 0)  # the 4-row block: the first draft rejected
    assert acc.rates("r", 7)[0] > 0.9 and acc.rates("r", 3)[0] < 0.1
    assert 0.3 < acc.rates("r", 1)[0] < 0.7  # K = 1 never tried: the pooled rate


def test_costs_interpolate_between_measured_k_and_hold_flat_past_them():
    costs = CycleCosts()
    assert costs.estimate(1, 3) is None
    costs.add(1, 0, 10.0, 0)
    costs.add(1, 8, 30.0, 1)
    assert costs.estimate(1, 4) == pytest.approx(20.0)
    assert costs.estimate(1, 12) == 30.0
    assert costs.estimate(3, 4) is None and bucket(3) == 4 and bucket(1) == 1
    costs.add(1, 8, 50.0, 2)
    assert costs.estimate(1, 8) == 30.0  # the lowest of the last measurements: a slow cycle does not stick
    for cycle in range(3, 3 + COST_SAMPLES):
        costs.add(1, 8, 45.0, cycle)
    assert costs.estimate(1, 8) == 45.0 and costs.count(1, 8) == COST_SAMPLES  # a lasting change shows


def _policy(num_draft=8, explore_every=0):
    ctx = NodeContext(name="policy", params={"explore_every": explore_every, "step": 2}, manifest=None, device="cpu",
                      dtype=None, num_draft=num_draft, kv_tokens=None, buffers={}, shared={})
    return AdaptiveK(ctx)


def _rows(n, k):
    rows = [RequestState(f"r{i}", 1, [1, 2], SamplingParams(), None, num_draft=k, slot=i) for i in range(n)]
    return Batch(rows, k)


def _run(policy, batch, accepted_of, cost_of, cycles=40):
    """Drive the policy: each cycle it chooses K, the rows accept accepted_of(K), the cycle costs cost_of(K)."""
    chosen = []
    for _ in range(cycles):
        k = policy.choose_draft(batch)
        chosen.append(k)
        for _, req in batch.active():
            if k:
                policy.commit(req, CommitInfo(0, k, accepted_of(k), ()))
        policy.observe(CycleCost(batch.size, k, 0.0, 0.0, cost_of(k), batch.size * (accepted_of(k) + 1)))
    return chosen


def test_k_zero_when_drafts_are_never_accepted():
    chosen = _run(_policy(), _rows(4, 8), accepted_of=lambda k: 0, cost_of=lambda k: 10.0 + k)
    assert chosen[:4] == [8, 8, 0, 0]  # both ends measured twice first
    assert set(chosen[8:]) == {0}  # after a few tries of K = 1 (the optimistic prior)


def test_k_max_when_every_draft_is_accepted_and_drafting_is_cheap():
    chosen = _run(_policy(), _rows(1, 8), accepted_of=lambda k: k, cost_of=lambda k: 10.0 + 0.5 * k)
    assert set(chosen[5:]) == {8}


def test_a_middle_k_when_acceptance_runs_out_and_each_draft_costs():
    # Rows accept exactly 3 drafts; each draft costs as much as a third of the base step.
    chosen = _run(_policy(explore_every=4), _rows(2, 8), accepted_of=lambda k: min(k, 3),
                  cost_of=lambda k: 9.0 + 3.0 * k, cycles=80)
    steady = chosen[40:]
    assert max(set(steady), key=steady.count) == 3


def test_a_costly_first_cycle_does_not_talk_the_policy_out_of_drafting():
    """The first cycle at K_max costs 20x its steady state (CUDA: graph uploads, the drafter ingesting the prompt);
    drafts are all accepted and drafting is cheap, so the policy still settles on K_max."""
    first = {"k_max": True}

    def cost_of(k):
        if k == 8 and first["k_max"]:
            first["k_max"] = False
            return 200.0
        return 10.0 + 0.5 * k

    chosen = _run(_policy(), _rows(1, 8), accepted_of=lambda k: k, cost_of=cost_of)  # no exploration to recover by
    assert set(chosen[4:]) == {8}


def test_explore_remeasures_neighbours_of_the_best():
    chosen = _run(_policy(explore_every=4), _rows(1, 8), accepted_of=lambda k: k, cost_of=lambda k: 10.0, cycles=40)
    assert set(chosen) > {0, 8}  # besides the ends, neighbours of the best were tried

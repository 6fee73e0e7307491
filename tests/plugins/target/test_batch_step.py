"""The target node batched: B requests per cycle, one slot each (issue 18's contract), on dense, hybrid and MoE targets."""

from __future__ import annotations

import pytest
import torch
from hybrid_testlib import build_hybrid, save
from moe_testlib import build_hf_moe, save_hf_moe
from numerics import assert_close_to_scale
from target_testlib import build_hf_model, save_hf_model

from draftflow.core.executor import Executor
from draftflow.core.node import Batch, CommitInfo, RequestState, SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.ports import Proposal
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec

KINDS = ("dense", "hybrid", "moe")
K = 3  # drafts per window in the direct node tests
PROMPTS = ([5, 17, 42, 9, 33], [200, 2, 7, 81, 64, 11, 90, 3, 12], [8, 1, 77], [61, 4, 150, 23, 99, 7, 18, 45, 2, 300, 6, 31])


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    return {"dense": save_hf_model(build_hf_model("qwen3", seed=3), root / "dense"),
            "hybrid": save(build_hybrid(seed=2, head_scale=4.0), root / "hybrid"),
            "moe": save_hf_moe(build_hf_moe(seed=1), root / "moe")}


def executor(path, max_batch: int, num_draft: int = K, taps=(0,)) -> Executor:
    registry = load_registry(autoload=False)
    spec = GraphSpec.from_dict({"num_draft": num_draft, "max_batch": max_batch, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(path), "tap_layers": list(taps)}},
        "verify": {"plugin": "verifier"}}})
    plan = build_plan(spec, registry)
    plan.raise_if_problems()
    return Executor(plan, hook=registry.pm.hook)


def request(tokens, slot: int) -> RequestState:
    return RequestState(f"r{slot}", len(tokens), list(tokens), SamplingParams(), torch.Generator(), slot=slot)


def alone(path, tokens: list[int], drafts: torch.Tensor | None) -> torch.Tensor:
    """Logits [1, W, V] of one request's window in a fresh single-slot target (the B = 1 reference)."""
    target = executor(path, 1).nodes["target"]
    req = request(tokens, 0)
    target.prefill(req)
    proposal = Proposal(drafts) if drafts is not None else None
    return target.step(Batch([req], 0 if drafts is None else drafts.shape[1]), {"proposal": proposal})["logits"].logits


def assert_rows_match(batched: torch.Tensor, reference: torch.Tensor, what: str) -> None:
    """Equal to rounding (1e-5 of the logits' scale: batched products may sum in another order), same argmax."""
    assert_close_to_scale(batched, reference, 1e-5, what)
    assert torch.equal(batched.argmax(-1), reference.argmax(-1)), f"{what}: argmax differs"


def committed(target, slot: int) -> dict[str, torch.Tensor]:
    """Copies of everything slot `slot` has committed: K/V cells, taps, linear states."""
    n = target.cache.lengths[slot]
    out = {"kv": target.cache.buffer[:, :, slot, :n].clone(), "features": target.features[slot, :n].clone()}
    if target.linear is not None:
        tail = target.linear.kernel_tail
        out["conv"] = target.linear.conv[:, slot, :, :tail].clone()
        out["rec"] = target.linear.rec[:, 0, slot].clone()
    return out


@pytest.mark.parametrize("kind", KINDS)
def test_batched_window_equals_each_row_alone(model_dirs, kind):
    """A [4, 1+K] window with rows at different positions gives each row's B = 1 logits; a pad row's slot keeps its state."""
    path = model_dirs[kind]
    target = executor(path, 4).nodes["target"]
    reqs = [request(p, i) for i, p in enumerate(PROMPTS)]
    for req in reqs:
        target.prefill(req)
    assert target.cache.lengths == [len(p) - 1 for p in PROMPTS]
    drafts = torch.randint(0, 300, (4, K), generator=torch.Generator().manual_seed(0))
    kept = committed(target, 1)
    rows = [reqs[0], None, reqs[2], reqs[3]]  # slot 1 holds a live request this cycle leaves out: a pad row
    logits = target.step(Batch(rows, K), {"proposal": Proposal(drafts)})["logits"].logits  # [4, 1+K, V]
    assert logits.shape == (4, 1 + K, target.vocab_size)
    for i in (0, 2, 3):
        assert_rows_match(logits[i:i + 1], alone(path, PROMPTS[i], drafts[i:i + 1]), f"{kind} row {i}")
    after = committed(target, 1)
    assert target.cache.lengths[1] == len(PROMPTS[1]) - 1
    for name, value in kept.items():
        assert torch.equal(after[name], value), f"{kind}: the pad row changed slot 1's committed {name}"
    # Slot 1's next window still equals its own B = 1 run: nothing it reads was disturbed.
    one = target.step(Batch([reqs[0], reqs[1]], 0), {"proposal": None})["logits"].logits
    assert_rows_match(one[1:2], alone(path, PROMPTS[1], None), f"{kind} slot 1 after the pad row")


def two_cycles(target, reqs, drafts, accepted, again) -> torch.Tensor:
    """Prefill, verify `drafts`, commit `accepted[i]` drafts + a bonus token per row, verify `again`: its logits."""
    for req in reqs:
        target.prefill(req)
    target.step(Batch(reqs, K), {"proposal": Proposal(drafts)})
    for req, n, row in zip(reqs, accepted, range(len(reqs))):
        position = req.position
        req.tokens += drafts[row, :n].tolist() + [11 + req.prompt_len]  # accepted drafts, then a bonus token
        carried = target.commit(req, CommitInfo(position, K, n, tuple(req.tokens[position + 1:])))
        assert target.cache.lengths[req.slot] == len(req.tokens) - 1
        assert carried["features"].start == position
        assert carried["features"].hidden.shape[1] == len(req.tokens) - 1 - position
    return target.step(Batch(reqs, K), {"proposal": Proposal(again)})["logits"].logits


@pytest.mark.parametrize("kind", KINDS)
def test_commit_and_rollback_per_slot(model_dirs, kind):
    """Each slot commits its own acceptance (all, some, none): the next batched window equals the same cycles run alone."""
    path = model_dirs[kind]
    drafts = torch.randint(0, 300, (4, K), generator=torch.Generator().manual_seed(1))
    again = torch.randint(0, 300, (4, K), generator=torch.Generator().manual_seed(2))
    accepted = (K, 1, 0, 2)
    batched = two_cycles(executor(path, 4).nodes["target"], [request(p, i) for i, p in enumerate(PROMPTS)], drafts,
                         accepted, again)
    for i, prompt in enumerate(PROMPTS):
        target = executor(path, 1).nodes["target"]
        one = two_cycles(target, [request(prompt, 0)], drafts[i:i + 1], accepted[i:i + 1], again[i:i + 1])
        assert_rows_match(batched[i:i + 1], one, f"{kind} slot {i} after commit")


@pytest.mark.parametrize("kind", KINDS)
def test_concurrent_greedy_requests_equal_each_alone(model_dirs, kind):
    """Target-only decoding of 4 concurrent requests (different lengths, one joining a freed slot) equals each run alone."""
    path = model_dirs[kind]
    budgets = (14, 6, 20, 9, 12)
    solo = executor(path, 1, num_draft=0)
    expected = [list(solo.generate(p, SamplingParams(max_new_tokens=n, ignore_eos=True)).token_ids)
                for p, n in zip(PROMPTS + (PROMPTS[0][::-1],), budgets)]
    ex = executor(path, 4, num_draft=0)
    live = [(ex.start(p, SamplingParams(max_new_tokens=n, ignore_eos=True)), i)
            for i, (p, n) in enumerate(zip(PROMPTS, budgets))]
    waiting, got = [4], {}
    while live:
        ex.step([state for state, _ in live])
        for state, i in [pair for pair in live if pair[0].finish_reason is not None]:
            got[i] = list(ex.finish(state).token_ids)
            live.remove((state, i))
            if waiting:  # the late request takes the freed slot
                j = waiting.pop()
                live.append((ex.start(PROMPTS[0][::-1], SamplingParams(max_new_tokens=budgets[j], ignore_eos=True)), j))
    assert [got[i] for i in range(5)] == expected


@pytest.mark.parametrize("kind", KINDS)
def test_batched_prefill_equals_each_prompt_alone(model_dirs, kind):
    """prefill_batch (one padded forward; a hybrid prefills each alone): every slot's K/V and taps, and the first
    window's logits, as after that prompt's own prefill; the anchor windows then verify the same."""
    path = model_dirs[kind]
    target = executor(path, 4).nodes["target"]
    reqs = [request(p, i) for i, p in enumerate(PROMPTS)]
    out = target.prefill_batch(reqs)
    assert target.cache.lengths == [len(p) - 1 for p in PROMPTS]
    for req, values in zip(reqs, out):
        single = executor(path, 1).nodes["target"]
        ref = request(req.tokens, 0)
        ref_values = single.prefill(ref)
        n = len(req.tokens) - 1
        assert_close_to_scale(target.cache.buffer[:, :, req.slot, :n], single.cache.buffer[:, :, 0, :n], 1e-5, "kv")
        assert_close_to_scale(values["features"].hidden, ref_values["features"].hidden, 1e-5, "taps")
    logits = target.step(Batch(reqs, 0), {"proposal": None})["logits"].logits
    for i, req in enumerate(reqs):
        assert_rows_match(logits[i:i + 1], alone(path, req.tokens, None), f"{kind} row {i}")

"""The verifier node at batch > 1: every row is verified exactly as that request alone at batch 1.

Rows mix plain greedy, greedy with processors and logprobs, and seeded sampling at several
temperatures, with ragged proposal lengths, rows wanting fewer drafts than proposed, and
pad rows. Each row's verdict must equal a batch-1 verifier's on that row's own window, over
several cycles (so the per-slot processor state is committed per slot), and sampled rows of
one batch must follow their own target distributions independently (chi-square).
"""

from __future__ import annotations

import attrs
import pytest
import torch
from stat_utils import chi_square_pvalue

from draftflow.plugin import Batch, CommitInfo, NodeContext, Proposal, RequestState, SamplingParams, TargetOutput
from draftflow.plugins.verifier.plugin import Verifier, manifest

VOCAB, K = 12, 4


def verifier(mode: str = "auto") -> Verifier:
    params = {"mode": mode}
    return Verifier(NodeContext("verify", params, manifest(params, None), torch.device("cpu"), torch.float32, K, None, {}, {}))


def request(slot: int, sampling: SamplingParams, seed: int, num_draft: int = K) -> RequestState:
    prompt = [(slot * 5 + j) % VOCAB for j in range(6)]
    return RequestState(f"r{slot}", len(prompt), prompt, sampling, torch.Generator().manual_seed(seed), num_draft, 0, slot)


ROWS = {  # slot -> (sampling, proposal length, drafts wanted); slot 2 is a pad row
    0: (SamplingParams(), 4, 4),
    1: (SamplingParams(repetition_penalty=1.8, presence_penalty=0.6, logprobs=3), 3, 4),
    3: (SamplingParams(temperature=0.8, seed=1), 4, 2),
    4: (SamplingParams(temperature=1.3, top_k=5, frequency_penalty=0.4, logit_bias={2: 1.5}), 1, 4),
    5: (SamplingParams(temperature=1.0, top_p=0.9, logprobs=2), 0, 4),
    6: (SamplingParams(), 2, 3),
}
SIZE = 7


def cycle_inputs(gen: torch.Generator, with_q: bool):
    """Peaked random logits [SIZE, K+1, V] and drafts that are often the argmax (so runs get accepted)."""
    logits = 3 * torch.randn(SIZE, K + 1, VOCAB, generator=gen)
    best = logits[:, :-1].argmax(-1)  # [SIZE, K]
    other = torch.randint(0, VOCAB, (SIZE, K), generator=gen)
    drafts = torch.where(torch.rand(SIZE, K, generator=gen) < 0.7, best, other)
    q = torch.softmax(torch.randn(SIZE, K, VOCAB, generator=gen), -1) if with_q else None
    if q is not None:
        q.scatter_(-1, drafts[..., None], 0.5).div_(q.sum(-1, keepdim=True))  # drafts are likely under q
    return logits, drafts, q


@pytest.mark.parametrize("with_q", [False, True])
def test_batched_rows_equal_batch_one_verdicts(with_q):
    """Over 4 cycles each row's accepted count, emitted run and logprobs equal a lone batch-1 verifier's."""
    batched = verifier()
    alone = {slot: verifier() for slot in ROWS}
    reqs = {slot: request(slot, s, seed=100 + slot, num_draft=want) for slot, (s, _, want) in ROWS.items()}
    solo = {slot: attrs.evolve(r, slot=0, tokens=list(r.tokens), generator=torch.Generator().manual_seed(100 + slot))
            for slot, r in reqs.items()}
    for slot in ROWS:
        batched.prefill(reqs[slot])
        alone[slot].prefill(solo[slot])
    lengths = torch.tensor([ROWS[i][1] if i in ROWS else 0 for i in range(SIZE)])
    gen = torch.Generator().manual_seed(7)
    for cycle in range(4):
        logits, drafts, q = cycle_inputs(gen, with_q)
        batch = Batch(tuple(reqs.get(i) for i in range(SIZE)), K)
        got = batched.step(batch, {"logits": TargetOutput(logits), "proposal": Proposal(drafts, q, lengths=lengths)})["verdict"]
        assert got.accepted.shape == (SIZE,) and got.emitted.shape == (SIZE, K + 1)
        for slot, (s, length, want) in ROWS.items():
            n = min(length, want)
            row_q = None if q is None else q[slot:slot + 1, :n]
            ref = alone[slot].step(Batch((solo[slot],), n), {
                "logits": TargetOutput(logits[slot:slot + 1, :n + 1]),
                "proposal": Proposal(drafts[slot:slot + 1, :n], row_q)})["verdict"]
            accepted = int(ref.accepted[0])
            assert int(got.accepted[slot]) == accepted, (cycle, slot)
            assert got.emitted[slot].tolist() == ref.emitted[0].tolist() + [-1] * (K - n), (cycle, slot)
            if s.logprobs is not None:
                torch.testing.assert_close(got.logprobs[slot, :n + 1], ref.logprobs[0])
                assert got.top_ids[slot, :n + 1, :s.logprobs].tolist() == ref.top_ids[0].tolist()
                torch.testing.assert_close(got.top_logprobs[slot, :n + 1, :s.logprobs], ref.top_logprobs[0])
            emitted = ref.emitted[0, :accepted + 1].tolist()
            for r, node in ((reqs[slot], batched), (solo[slot], alone[slot])):
                info = CommitInfo(r.position, n, accepted, tuple(emitted))
                r.tokens.extend(emitted)
                node.commit(r, info)
        assert got.emitted[2, 0] >= 0  # the pad row still holds a valid first token


def test_greedy_rows_are_capped_by_lengths_and_num_draft():
    """Plain greedy rows in one batched call: acceptance stops at min(lengths[i], rows[i].num_draft)."""
    node = verifier()
    logits = torch.full((3, K + 1, VOCAB), -1.0)
    logits[:, torch.arange(K + 1), torch.arange(K + 1)] = 1.0  # argmax of window row j is token j
    drafts = torch.arange(K).repeat(3, 1)  # every draft matches
    reqs = [request(0, SamplingParams(), 0, num_draft=K), request(1, SamplingParams(), 0, num_draft=2), None]
    out = node.step(Batch(reqs, K), {"logits": TargetOutput(logits),
                                     "proposal": Proposal(drafts, lengths=torch.tensor([3, 4, 4]))})["verdict"]
    assert out.accepted.tolist()[:2] == [3, 2]
    assert out.emitted[:2].tolist() == [[0, 1, 2, 3, -1], [0, 1, 2, -1, -1]]
    alone = node.step(Batch(reqs[:1], K), {"logits": TargetOutput(logits[:1]), "proposal": Proposal(drafts[:1])})
    assert alone["verdict"].accepted.tolist() == [K]  # batch 1 with no lengths: the untouched fast path


def test_release_drops_the_slot_state():
    """A slot's processor and matcher go at release; the next request in that slot starts clean."""
    node = verifier()
    req = request(0, SamplingParams(repetition_penalty=2.0), 0)
    node.prefill(req)
    node.step(Batch((req,), 0), {"logits": TargetOutput(torch.randn(1, 1, VOCAB))})
    assert 0 in node.processors
    node.release(req)
    assert node.processors == {} and node.matchers == {}


TEMPERATURES = (0.7, 1.0, 1.4, 2.0)
RUNS = 3000


def first_token_counts(batch_logits, drafts, temperatures):
    """Per sampled row, how often each token is emitted first over RUNS cycles, each row with its own seed."""
    node = verifier()
    counts = torch.zeros(len(temperatures), VOCAB)
    pairs = torch.zeros(VOCAB, VOCAB)  # (row 0's first token, row 1's first token)
    size = len(temperatures) + 2  # one greedy row and one pad row in the batch too
    for run in range(RUNS):
        rows = [request(i, SamplingParams(temperature=t, seed=run), run * 8 + i, num_draft=2)
                for i, t in enumerate(temperatures)]
        rows += [request(len(temperatures), SamplingParams(), 0, num_draft=2), None]
        out = node.step(Batch(rows, 2), {"logits": TargetOutput(batch_logits[:size]),
                                         "proposal": Proposal(drafts[:size])})["verdict"]
        first = out.emitted[:, 0].tolist()
        for i in range(len(temperatures)):
            counts[i, first[i]] += 1
        pairs[first[0], first[1]] += 1
    return counts, pairs


@pytest.mark.slow
def test_batched_rows_sample_their_own_distributions_independently():
    """4 seeded rows of different temperatures in one batch: each first token follows its own p; rows 0 and 1 are independent."""
    gen = torch.Generator().manual_seed(3)
    size = len(TEMPERATURES) + 2
    logits = 2 * torch.randn(size, 3, VOCAB, generator=gen)
    drafts = logits[:, :-1].topk(2, dim=-1).indices[..., 1]  # the second likeliest: often rejected, often accepted
    counts, pairs = first_token_counts(logits, drafts, TEMPERATURES)
    exact = [torch.softmax(logits[i, 0].double() / t, -1) for i, t in enumerate(TEMPERATURES)]
    for i in range(len(TEMPERATURES)):
        assert chi_square_pvalue(counts[i], exact[i]) > 1e-3, f"row {i} (T={TEMPERATURES[i]})"
    assert chi_square_pvalue(pairs.flatten(), torch.outer(exact[0], exact[1]).flatten()) > 1e-3
    # The test has power: row 3 (T=2) does not follow row 0's distribution (T=0.7 over other logits).
    assert chi_square_pvalue(counts[3], exact[0]) < 1e-6


def loop_executor(path, max_batch: int):
    """The tiny target + an oracle drafter (drafts every cycle, some accepted) + verifier, with request slots."""
    from draftflow.core.executor import Executor
    from draftflow.core.plan import build_plan
    from draftflow.core.registry import load_registry
    from draftflow.core.spec import GraphSpec

    spec = GraphSpec.from_dict({"num_draft": 2, "max_batch": max_batch, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(path)}},
        "oracle": {"plugin": "oracle", "params": {"reference": [(3 * i) % 6 for i in range(8)]}},
        "verify": {"plugin": "verifier"}}})
    return Executor(build_plan(spec, load_registry(autoload=False)))


def run_together(ex, requests, late=(), after: int = 0):
    """Tokens of ``requests`` + ``late`` stepped together; the late ones join after ``after`` cycles."""
    states = [ex.start(p, s) for p, s in requests]
    for cycle in range(10**6):
        if cycle == after:
            states += [ex.start(p, s) for p, s in late]
        live = [s for s in states if s.finish_reason is None]
        if not live and cycle >= after:
            break
        if live:
            ex.step(live)
    return [ex.finish(s).token_ids for s in states]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from test_loop_distribution import tiny_target

    return tiny_target(tmp_path_factory.mktemp("batch") / "t")


@pytest.mark.parametrize("seed", [11, 12, 13])
def test_seeded_requests_repeat_whatever_else_is_batched(tiny, seed):
    """A seeded T>0 request gives the same tokens alone and batched with greedy, processed and other seeded requests."""
    ex = loop_executor(tiny, 4)
    mine = ([1, 4, 2], SamplingParams(temperature=3.0, seed=seed, max_new_tokens=12, ignore_eos=True))
    alone = ex.generate(*mine).token_ids
    others = [([3], SamplingParams(max_new_tokens=5, ignore_eos=True)),
              ([2, 2, 5, 1], SamplingParams(temperature=0.7, seed=3, max_new_tokens=9, ignore_eos=True, logprobs=2)),
              ([0, 1], SamplingParams(temperature=1.0, repetition_penalty=1.5, max_new_tokens=20, ignore_eos=True))]
    assert run_together(ex, [others[0], mine, others[1]])[1] == alone
    assert run_together(ex, [others[2], others[1], others[0], mine])[3] == alone
    # Companions joining later still draft while this request's oracle has run out (ragged proposal lengths).
    assert run_together(ex, [mine], late=others, after=3)[0] == alone


@pytest.mark.slow
def test_batched_loop_samples_the_target_distribution(tiny):
    """chi-square through the whole loop at batch 4: every request's first two tokens follow target-only sampling."""
    from test_loop_distribution import PROMPT, T, VOCAB, exact_joint

    joint = exact_joint(tiny)
    ex = loop_executor(tiny, 4)
    counts = torch.zeros(VOCAB * VOCAB)
    runs = 2000
    for first in range(0, runs, 4):
        batch = [(PROMPT, SamplingParams(temperature=T, seed=first + j, max_new_tokens=2, ignore_eos=True)) for j in range(4)]
        for tokens in run_together(ex, batch):
            counts[tokens[0] * VOCAB + tokens[1]] += 1
    assert chi_square_pvalue(counts, joint.flatten()) > 1e-3


def test_each_request_gets_the_logprobs_it_asked_for(tiny):
    """Batched with logprobs=3 and none, a logprobs=1 request gets exactly its lone logprobs (one alternative each)."""
    ex = loop_executor(tiny, 3)
    asks = [3, 1, None]
    requests = [([1, 4, 2], SamplingParams(temperature=1.2, seed=5, max_new_tokens=6, ignore_eos=True, logprobs=n))
                for n in asks]
    alone = [ex.generate(*r).logprobs for r in requests]
    states = [ex.start(*r) for r in requests]
    while any(s.finish_reason is None for s in states):
        for result in ex.step([s for s in states if s.finish_reason is None]):
            assert (result.logprobs is None) == (result.request_id == states[2].request_id)
    together = [ex.finish(s).logprobs for s in states]
    assert together[2] is None and alone[2] is None
    for got, want in zip(together[:2], alone[:2]):  # the target's batched logits may differ in the last bits
        assert [(t.token, [i for i, _ in t.top]) for t in got] == [(t.token, [i for i, _ in t.top]) for t in want]
        assert [t.logprob for t in got] == pytest.approx([t.logprob for t in want], abs=1e-5)
    assert [len(lp.top) for lp in together[1]] == [1] * 6

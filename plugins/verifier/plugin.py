"""The verifier node: turns target logits and a proposal into a verdict, row by row of the batch.

Greedy at temperature 0, otherwise lossless rejection sampling (Leviathan et al.) against
the target's processed distribution. The math lives in ``draftflow.verify`` so plugin
authors can call it directly.

Rows of a batch are independent requests. Plain greedy rows (no logit processors, no
logprobs) and pad rows are verified together in one ``greedy_accept``. Every other row
(temperature > 0, processors, a grammar, logprobs) runs on its own with its own
SamplingParams and generator, on exactly the window it would have at batch 1 (its first
``min(lengths[i], rows[i].num_draft)`` drafts), so it consumes exactly the random draws it
consumes alone: a seeded request's tokens do not depend on what else is batched.

Requests with logit processors (penalties, logit bias, min-p, a grammar) have every window
row processed as if the drafts before it were committed (``layers.processors``), so
greedy speculative output equals target-only output with the same processors and
sampling stays distribution-exact. A grammar needs the drafts on the host to advance its
matcher over them, and a ragged proposal's lengths are read there for the rows that run on
their own: one extra host sync per cycle, only when such rows are in the batch.
"""

from __future__ import annotations

import torch

from draftflow.plugin import TARGET_HANDLE, Manifest, Node, NodeType, ParamSpec, Port, Verdict, hookimpl
from draftflow.plugins.verifier.accept import greedy_accept, rejection_sample
from draftflow.layers.processors import LogitProcessor, sampling_scores
from draftflow.layers.sampling import filter_logits

PARAMS = (
    ParamSpec("mode", "str", "auto", "auto: greedy at temperature 0, rejection sampling above; greedy: always argmax",
              choices=("auto", "greedy")),
)


def manifest(params, env) -> Manifest:
    provides = {"verify.greedy"} | ({"sampling.temperature>0"} if params["mode"] == "auto" else set())
    return Manifest(
        role="verifier",
        inputs=(Port("logits", "logits", doc="target window logits [B, K+1, V]"),
                Port("proposal", "proposal", required=False, doc="drafts; absent means target-only decoding")),
        outputs=(Port("verdict", "verdict"),),
        provides=provides,
        requires={TARGET_HANDLE},  # the tokenizer and EOS ids a grammar is compiled against
    )


def grammar_compiler(handle):
    """The grammar engine's compiler for the target's tokenizer (imported only when a request has a grammar)."""
    from draftflow.layers.grammar import GrammarCompiler

    return GrammarCompiler(handle.hf_tokenizer, handle.vocab_size, tuple(handle.eos_ids))


def token_logprobs(
    scores: torch.Tensor,  # [B, W, V] processed, filtered scores (-inf = dropped)
    emitted: torch.Tensor,  # [B, W] int64, -1 past the emitted run
    top_n: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # [B, W], [B, W, N] int64, [B, W, N]
    """Logprob of each emitted token and the ``top_n`` likeliest tokens with theirs."""
    logp = scores.log_softmax(dim=-1)  # [B, W, V]
    chosen = logp.gather(-1, emitted.clamp_min(0)[..., None])[..., 0]  # [B, W]
    top = logp.topk(top_n, dim=-1)  # N may be 0
    return chosen, top.indices, top.values


def capped_drafts(
    drafts: torch.Tensor,  # [B, K] int64
    lengths: torch.Tensor | None,  # [B] int64: real drafts per row, or None (all K)
    wanted: list[int],  # drafts each row may have accepted (0 for pad rows)
) -> torch.Tensor:  # [B, K]: columns past a row's cap hold -1, which no argmax equals
    """Drafts with every column past min(lengths[i], wanted[i]) replaced by -1 (no sync)."""
    k = drafts.shape[1]
    if lengths is None and min(wanted, default=k) >= k:
        return drafts  # the usual batch-1 case: nothing to cap
    cap = torch.tensor(wanted, dtype=torch.long).to(drafts.device, non_blocking=True)  # [B]
    if lengths is not None:
        cap = torch.minimum(cap, lengths)
    keep = torch.arange(k, device=drafts.device)[None, :] < cap[:, None]  # [B, K]
    return torch.where(keep, drafts, torch.full_like(drafts, -1))


class Verifier(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.compiler = None  # built on the first request with a grammar, then reused
        self.processors: dict[int, LogitProcessor] = {}  # slot -> its request's penalties and bias
        self.matchers: dict = {}  # slot -> its request's grammar matcher

    def prefill(self, req):
        self.release(req)  # the processor is built at the first window, when the vocabulary width is known
        if req.sampling.grammar is not None:
            if self.compiler is None:
                self.compiler = grammar_compiler(self.ctx.target)
            self.matchers[req.slot] = self.compiler.compile(req.sampling.grammar)
        return {}

    def release(self, req):
        self.processors.pop(req.slot, None)
        self.matchers.pop(req.slot, None)

    def _plain(self, req) -> bool:
        """A row the batched greedy rule verifies: greedy, no processors, no logprobs."""
        s = req.sampling
        greedy = self.ctx.params["mode"] == "greedy" or s.temperature == 0
        return greedy and not s.has_processors and s.logprobs is None

    def step(self, batch, inputs):
        logits = inputs["logits"].logits  # [B, K+1, V]
        proposal = inputs.get("proposal")
        if proposal is None:
            drafts = torch.empty(logits.shape[0], 0, dtype=torch.long, device=logits.device)  # [B, 0]
            lengths = None
        else:
            drafts, lengths = proposal.tokens, proposal.lengths  # [B, K], [B] or None
        own = [(i, r) for i, r in batch.active() if not self._plain(r)]  # rows verified on their own
        if len(own) < batch.size:  # plain greedy rows and pad rows, all at once
            accepted, emitted = greedy_accept(capped_drafts(drafts, lengths, batch.draft_lengths()), logits)
        else:
            accepted = torch.zeros(batch.size, dtype=torch.long, device=logits.device)  # [B]
            emitted = torch.full((batch.size, drafts.shape[1] + 1), -1, dtype=torch.long, device=logits.device)
        verdict = Verdict(accepted, emitted)
        if own:
            self._verify_rows(own, logits, drafts, lengths, proposal, verdict)
        return {"verdict": verdict}

    def _verify_rows(self, own, logits, drafts, lengths, proposal, verdict: Verdict) -> None:
        """Verify each of ``own`` on its batch-1 window and write its row of ``verdict`` in place."""
        k = drafts.shape[1]
        # The host needs the lengths (to cut each window as at batch 1) and a grammar's drafts: one transfer.
        needs_drafts = any(r.slot in self.matchers for _, r in own)
        host_lengths, host_drafts = [k] * logits.shape[0], None
        if lengths is not None or needs_drafts:
            parts = ([drafts] if needs_drafts else []) + ([lengths[:, None]] if lengths is not None else [])
            packed = torch.cat(parts, dim=1).tolist()
            host_drafts = [row[:k] for row in packed] if needs_drafts else None
            host_lengths = [row[-1] for row in packed] if lengths is not None else host_lengths
        top_n = max((r.sampling.logprobs for _, r in own if r.sampling.logprobs is not None), default=None)
        if top_n is not None:
            verdict.logprobs = torch.zeros(verdict.emitted.shape, dtype=torch.float32, device=logits.device)
            verdict.top_ids = torch.zeros(*verdict.emitted.shape, top_n, dtype=torch.long, device=logits.device)
            verdict.top_logprobs = torch.zeros(*verdict.emitted.shape, top_n, dtype=torch.float32, device=logits.device)
        for i, req in own:
            n = min(k, req.num_draft, host_lengths[i])  # this row's drafts, as its batch-1 proposal had them
            q = cand = None
            if proposal is not None and proposal.probs is not None:
                q = proposal.probs[i:i + 1, :n]  # [1, n, V or C]
                cand = None if proposal.candidate_ids is None else proposal.candidate_ids[i:i + 1, :n]
            row_drafts = host_drafts[i][:n] if host_drafts is not None else None
            out = self._verify_row(req, logits[i:i + 1, :n + 1], drafts[i:i + 1, :n], row_drafts, q, cand)
            verdict.accepted[i:i + 1] = out.accepted
            verdict.emitted[i, :n + 1] = out.emitted[0]
            verdict.emitted[i, n + 1:] = -1
            if out.logprobs is not None:
                verdict.logprobs[i, :n + 1] = out.logprobs[0]
                width = out.top_ids.shape[-1]
                verdict.top_ids[i, :n + 1, :width] = out.top_ids[0]
                verdict.top_logprobs[i, :n + 1, :width] = out.top_logprobs[0]

    def _verify_row(self, req, logits, drafts, host_drafts, q, cand) -> Verdict:
        """One request's verdict at batch 1: logits [1, n+1, V], drafts [1, n]; consumes only req.generator."""
        s = req.sampling
        greedy = self.ctx.params["mode"] == "greedy" or s.temperature == 0
        if not greedy and not s.has_processors and s.logprobs is None:
            probs = filter_logits(logits, s.temperature, s.top_k, s.top_p)  # [1, n+1, V]
            return Verdict(*rejection_sample(drafts, probs, q, cand, generator=req.generator))
        processed = self._process(req, logits, drafts, host_drafts)  # [1, n+1, V]
        scores = None
        if greedy:
            accepted, emitted = greedy_accept(drafts, processed)
        else:
            scores = sampling_scores(processed, s)  # [1, n+1, V]
            accepted, emitted = rejection_sample(drafts, scores.softmax(dim=-1), q, cand, generator=req.generator)
        verdict = Verdict(accepted, emitted)
        if s.logprobs is not None:
            if scores is None:  # greedy: the processed distribution at the request's temperature, 1 at T = 0
                scores = sampling_scores(processed, s, temperature=s.temperature or 1.0)
            verdict.logprobs, verdict.top_ids, verdict.top_logprobs = token_logprobs(scores, emitted, s.logprobs)
        return verdict

    def _process(self, req, logits, drafts, host_drafts):
        """Penalties, bias and grammar mask over one row's window, row j given committed + drafts[:j]."""
        vocab = logits.shape[-1]
        processor = self.processors.get(req.slot)
        if processor is None:
            processor = LogitProcessor(req.sampling, req.tokens, req.prompt_len, vocab, logits.device)
            self.processors[req.slot] = processor
        allowed = None
        matcher = self.matchers.get(req.slot)
        if matcher is not None:
            rows = matcher.allowed(host_drafts)  # [n+1, V_grammar] bool
            allowed = torch.zeros(rows.shape[0], vocab, dtype=torch.bool)
            width = min(vocab, rows.shape[1])
            allowed[:, :width] = rows[:, :width]
            allowed = allowed.to(logits.device, non_blocking=True)
        return processor.process(logits, drafts, allowed)

    def commit(self, req, info):
        if req.slot in self.processors:
            self.processors[req.slot].commit(info.emitted)
        if req.slot in self.matchers:
            self.matchers[req.slot].commit(info.emitted)
        return {}


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="verifier", role="verifier", manifest=manifest, factory=Verifier, params=PARAMS,
        description="greedy or lossless rejection-sampling verification of drafts against the target, "
                    "with the request's logit processors applied at every window row",
    ))

"""The verifier node: turns target logits and a proposal into a verdict.

Greedy at temperature 0, otherwise lossless rejection sampling (Leviathan et al.) against
the target's processed distribution. The math lives in ``draftflow.verify`` so plugin
authors can call it directly.

Requests with logit processors (penalties, logit bias, min-p, a grammar) have every window
row processed as if the drafts before it were committed (``layers.processors``), so
greedy speculative output equals target-only output with the same processors and
sampling stays distribution-exact. A grammar needs the drafts on the host to advance its
matcher over them: one extra host sync per cycle, only for requests with a grammar.
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


class Verifier(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.compiler = None  # built on the first request with a grammar, then reused
        self.processor: LogitProcessor | None = None  # the live request's penalties and bias
        self.matcher = None  # the live request's grammar matcher

    def prefill(self, req):
        self.processor = None  # built at the first window, when the vocabulary width is known
        self.matcher = None
        if req.sampling.grammar is not None:
            if self.compiler is None:
                self.compiler = grammar_compiler(self.ctx.target)
            self.matcher = self.compiler.compile(req.sampling.grammar)
        return {}

    def step(self, req, inputs):
        logits = inputs["logits"].logits  # [B, K+1, V]
        proposal = inputs.get("proposal")
        batch = logits.shape[0]
        if proposal is None:
            drafts = torch.empty(batch, 0, dtype=torch.long, device=logits.device)  # [B, 0]
        else:
            drafts = proposal.tokens  # [B, K]
        s = req.sampling
        greedy = self.ctx.params["mode"] == "greedy" or s.temperature == 0
        q = proposal.probs if proposal is not None else None
        cand = proposal.candidate_ids if proposal is not None else None
        if not s.has_processors and s.logprobs is None:
            if greedy:
                accepted, emitted = greedy_accept(drafts, logits)
            else:
                probs = filter_logits(logits, s.temperature, s.top_k, s.top_p)  # [B, K+1, V]
                accepted, emitted = rejection_sample(drafts, probs, q, cand, generator=req.generator)
            return {"verdict": Verdict(accepted, emitted)}

        processed = self._process(req, logits, drafts)  # [B, K+1, V]
        scores = None
        if greedy:
            accepted, emitted = greedy_accept(drafts, processed)
        else:
            scores = sampling_scores(processed, s)  # [B, K+1, V]
            accepted, emitted = rejection_sample(drafts, scores.softmax(dim=-1), q, cand, generator=req.generator)
        verdict = Verdict(accepted, emitted)
        if s.logprobs is not None:
            if scores is None:  # greedy: the processed distribution at the request's temperature, 1 at T = 0
                scores = sampling_scores(processed, s, temperature=s.temperature or 1.0)
            verdict.logprobs, verdict.top_ids, verdict.top_logprobs = token_logprobs(scores, emitted, s.logprobs)
        return {"verdict": verdict}

    def _process(self, req, logits, drafts):
        """Penalties, bias and grammar mask over the window, row j given committed + drafts[:j]."""
        vocab = logits.shape[-1]
        if self.processor is None:
            self.processor = LogitProcessor(req.sampling, req.tokens, req.prompt_len, vocab, logits.device)
        allowed = None
        if self.matcher is not None:
            # The matcher walks the drafts on the host: the one extra sync a grammar costs per cycle.
            rows = self.matcher.allowed(drafts[0].tolist())  # [K+1, V_grammar] bool
            allowed = torch.zeros(rows.shape[0], vocab, dtype=torch.bool)
            width = min(vocab, rows.shape[1])
            allowed[:, :width] = rows[:, :width]
            allowed = allowed.to(logits.device, non_blocking=True)
        return self.processor.process(logits, drafts, allowed)

    def commit(self, req, info):
        if self.processor is not None:
            self.processor.commit(info.emitted)
        if self.matcher is not None:
            self.matcher.commit(info.emitted)
        return {}


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="verifier", role="verifier", manifest=manifest, factory=Verifier, params=PARAMS,
        description="greedy or lossless rejection-sampling verification of drafts against the target, "
                    "with the request's logit processors applied at every window row",
    ))

"""Logit processors over a verify window: penalties and logit bias, each row given its own prefix.

Row j of a window `[anchor, d_0, ..., d_{K-1}]` scores the token after `committed +
drafts[:j]`, so a processor whose effect depends on the sequence (the penalties) must see
the drafts before row j as if they were committed. `LogitProcessor` does that for a whole
window at once, on the device:

- **repetition** (transformers / vLLM): for every token present in prompt + output
  (+ drafts before j), a positive logit is divided by `repetition_penalty`, a negative one
  multiplied by it.
- **presence / frequency** (OpenAI): over output tokens only (+ drafts before j),
  `logit -= frequency_penalty * count + presence_penalty * (count > 0)`.
- **logit_bias**: added.
- an optional grammar mask (`allowed`, `[K+1, V]` bool) sets disallowed tokens to -inf.

Then `layers.sampling.filter_scores` applies temperature, top-k, top-p and min-p (see
`sampling_scores`). The running counts live on the device, built once from the prompt and
advanced by `commit` with the tokens each cycle committed, so a cycle costs O((K+1) * V)
whatever the sequence length; the draft counts of a window come from one scatter and one
cumulative sum, with no host loop over positions.
"""

from __future__ import annotations

from typing import Sequence

import torch

from draftflow.layers.sampling import filter_scores

__all__ = ["LogitProcessor", "apply_penalties", "draft_counts", "sampling_scores"]


def draft_counts(
    drafts: torch.Tensor,  # [B, K] int64
    vocab_size: int,
) -> torch.Tensor:  # [B, K+1, V] float32: row j counts drafts[:j]
    """How often each token occurs among the drafts before each window row."""
    batch, num_drafts = drafts.shape
    step = torch.zeros(batch, num_drafts + 1, vocab_size, dtype=torch.float32, device=drafts.device)
    # Draft i first counts for row i + 1; the cumulative sum carries it to every later row.
    step[:, 1:].scatter_(-1, drafts[:, :, None], 1.0)
    return step.cumsum(dim=1)


def apply_penalties(
    logits: torch.Tensor,  # [B, W, V] float32
    seen: torch.Tensor,  # [B, V] bool: token in prompt + committed output
    output_counts: torch.Tensor,  # [B, V] float32: occurrences in the committed output
    drafts: torch.Tensor | None,  # [B, W-1] int64; None: every row sees the committed prefix only
    repetition: float = 1.0,
    presence: float = 0.0,
    frequency: float = 0.0,
) -> torch.Tensor:  # [B, W, V] float32
    """Repetition, then presence / frequency penalties, row j as if drafts[:j] were committed."""
    if drafts is None:
        window = torch.zeros(1, 1, logits.shape[-1], device=logits.device)  # [1, 1, V]
    else:
        window = draft_counts(drafts, logits.shape[-1])  # [B, W, V]
    if repetition != 1.0:
        present = seen[:, None, :] | (window > 0)  # [B, W, V]
        penalised = torch.where(logits > 0, logits / repetition, logits * repetition)
        logits = torch.where(present, penalised, logits)
    if presence or frequency:
        counts = output_counts[:, None, :] + window  # [B, W, V]
        logits = logits - (frequency * counts + presence * (counts > 0).float())
    return logits


def sampling_scores(
    processed: torch.Tensor,  # [B, W, V] processed logits
    sampling,
    temperature: float | None = None,
) -> torch.Tensor:  # [B, W, V]: softmax = sampling distribution, log_softmax = logprobs
    """Temperature, top-k, top-p and min-p over processed logits (dropped tokens at -inf).

    ``temperature`` defaults to the request's; greedy requests pass 1 to get the processed
    distribution their logprobs report.
    """
    t = sampling.temperature if temperature is None else temperature
    return filter_scores(processed, t, sampling.top_k, sampling.top_p, sampling.min_p)


class LogitProcessor:
    """One request's penalties and bias, with its running token counts on the device.

    Build it from the committed tokens (prompt + output so far), ``process`` each window,
    ``commit`` the tokens each cycle committed. ``follow`` keeps one up to date from
    ``req.tokens`` for a node without a commit hook of its own (a drafter).
    """

    def __init__(self, sampling, tokens: Sequence[int], prompt_len: int, vocab_size: int, device):
        self.sampling = sampling
        self.vocab_size = vocab_size
        self.device = torch.device(device)
        self.num_tokens = 0
        self.prompt_len = prompt_len
        self.seen = torch.zeros(1, vocab_size, dtype=torch.bool, device=self.device)  # [1, V]
        self.output_counts = torch.zeros(1, vocab_size, dtype=torch.float32, device=self.device)  # [1, V]
        self.bias = None
        if sampling.logit_bias:
            ids = torch.tensor([i for i, _ in sampling.logit_bias], dtype=torch.long)
            values = torch.tensor([b for _, b in sampling.logit_bias], dtype=torch.float32)
            keep = ids < vocab_size  # ids past a padded vocabulary cannot be emitted anyway
            self.bias = torch.zeros(vocab_size, dtype=torch.float32).index_put_((ids[keep],), values[keep],
                                                                               accumulate=True).to(self.device)  # [V]
        self.request = None  # the request `follow` tracks
        self.commit(tokens)

    @property
    def has_penalties(self) -> bool:
        s = self.sampling
        return s.repetition_penalty != 1.0 or bool(s.presence_penalty) or bool(s.frequency_penalty)

    def commit(self, tokens: Sequence[int]) -> None:
        """Count newly committed tokens (host ints: one small host-to-device copy, no sync)."""
        tokens = [t for t in tokens if 0 <= t < self.vocab_size]
        start = self.num_tokens
        self.num_tokens += len(tokens)
        if not tokens or not self.has_penalties:
            return
        ids = torch.tensor(tokens, dtype=torch.long).to(self.device, non_blocking=True)
        self.seen[0, ids] = True
        in_output = max(0, self.prompt_len - start)  # the first ones may still be prompt tokens
        if in_output < len(tokens):
            out = ids[in_output:]
            self.output_counts[0].index_add_(0, out, torch.ones(out.shape, dtype=torch.float32, device=self.device))

    def process(
        self,
        logits: torch.Tensor,  # [B, W, V]
        drafts: torch.Tensor | None = None,  # [B, W-1] int64; None: every row sees only the committed prefix
        allowed: torch.Tensor | None = None,  # [W, V] or [B, W, V] bool grammar mask
    ) -> torch.Tensor:  # [B, W, V] float32
        """Penalties, logit bias and the grammar mask; row j as if drafts[:j] were committed."""
        scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if self.has_penalties:
            s = self.sampling
            scores = apply_penalties(scores, self.seen, self.output_counts, drafts,
                                     s.repetition_penalty, s.presence_penalty, s.frequency_penalty)
        if self.bias is not None:
            scores = scores + self.bias
        if allowed is not None:
            scores = scores.masked_fill(~allowed.to(scores.device), float("-inf"))
        return scores

    @classmethod
    def follow(cls, previous: LogitProcessor | None, req, vocab_size: int, device) -> LogitProcessor:
        """``previous`` advanced to ``req.tokens`` when it tracks this request, else a new one for it.

        Costs O(new tokens) per call: a drafter calls it once per cycle instead of hooking commit.
        """
        if (previous is not None and previous.request is req and previous.vocab_size == vocab_size
                and previous.num_tokens <= len(req.tokens)):
            previous.commit(req.tokens[previous.num_tokens:])
            return previous
        proc = cls(req.sampling, req.tokens, req.prompt_len, vocab_size, device)
        proc.request = req
        return proc

"""Port types: what may flow along an edge of a decode graph.

An edge joins an output port to an input port of the same type. The value types are the
attrs classes below; their tensors keep shape comments so plugin authors know the layout.
"""

from __future__ import annotations

import attrs
import torch

# type name -> one-line description (documented in docs/GRAPHS.md)
PORT_TYPES: dict[str, str] = {
    "proposal": "draft tokens for this cycle, with optional draft probabilities (Proposal)",
    "logits": "target logits over the verify window [anchor, drafts...] (TargetOutput)",
    "features": "target feature taps of committed tokens, carried to the next cycle (Features)",
    "verdict": "accepted count and emitted tokens for this cycle (Verdict)",
    "candidates": "top-C candidate ids and scores per draft row (Candidates)",
}


@attrs.define
class Proposal:
    """Draft tokens for one cycle. ``probs`` is None for deterministic drafts (one-hot q).

    Row i proposes ``tokens[i, :lengths[i]]`` (``lengths`` None: every row all K columns); the
    columns past it are padding and must still hold valid token ids (the target embeds them).
    The verifier also never accepts more than the row's ``num_draft``.
    """

    tokens: torch.Tensor  # [B, K] int64
    probs: torch.Tensor | None = None  # [B, K, V] full q, or [B, K, C] with candidate_ids
    candidate_ids: torch.Tensor | None = None  # [B, K, C] int64
    lengths: torch.Tensor | None = None  # [B] int64 on the device: real drafts per row

    @property
    def num_draft(self) -> int:
        return self.tokens.shape[1]

    @classmethod
    def from_rows(cls, rows: list[list[int] | None], device) -> Proposal:
        """A deterministic proposal from per-row host drafts (None for a pad row, [] for a row without drafts):
        ``[B, K']`` with K' the longest row, padded with token 0, and ``lengths`` when the stepped rows differ
        (a pad row never needs them: the verifier accepts nothing in it)."""
        width = max((len(r) for r in rows if r), default=0)
        tokens = torch.tensor([list(r or ()) + [0] * (width - len(r or ())) for r in rows], dtype=torch.long)
        tokens = tokens.reshape(len(rows), width).to(device, non_blocking=True)  # [B, K']
        if all(r is None or len(r) == width for r in rows):
            return cls(tokens)
        lengths = torch.tensor([len(r or ()) for r in rows], dtype=torch.long).to(device, non_blocking=True)  # [B]
        return cls(tokens, lengths=lengths)


@attrs.define
class TargetOutput:
    """Target logits for the verify window: row 0 scores the token after the anchor."""

    logits: torch.Tensor  # [B, K+1, V] float32


@attrs.define
class Features:
    """Feature taps (hidden states after chosen target layers) for a run of positions."""

    hidden: torch.Tensor  # [B, T, n_taps * H]
    start: int  # sequence position of row 0


@attrs.define
class Candidates:
    """Top-C candidates per draft row, for selector nodes."""

    ids: torch.Tensor  # [B, K, C] int64
    scores: torch.Tensor  # [B, K, C]
    hidden: torch.Tensor | None = None  # [B, K, H]


@attrs.define
class Verdict:
    """Verifier result. Its tensors stay on the device; the executor reads them in one transfer.

    The logprob fields are set only when the request asks for logprobs: row j describes the
    token emitted at window row j under the processed distribution there (rows past the
    emitted run hold anything).
    """

    accepted: torch.Tensor  # [B] int64
    emitted: torch.Tensor  # [B, K+1] int64, padded with -1
    logprobs: torch.Tensor | None = None  # [B, K+1] float32: logprob of the emitted token
    top_ids: torch.Tensor | None = None  # [B, K+1, N] int64: the N likeliest tokens, best first
    top_logprobs: torch.Tensor | None = None  # [B, K+1, N] float32: their logprobs

"""How a block drafter turns each row's draft logits into its drafts: exactly as the row would alone.

A row's drafts depend only on its own request: its processors (penalties, bias over its
committed tokens), its grammar (drafts masked row by row on the host), its temperature and
filters, its generator and its K. A sampled row draws from a q over its own first k rows,
so its generator advances exactly as in a batch of one and a seeded request's drafts do
not depend on what else is batched. Greedy rows of a batch are one argmax over all rows;
when some row sampled, the Proposal carries q for every row (one-hot for greedy rows).

The node keeps per slot: ``matchers`` (grammar), ``host_generators`` (their draws) and
``processors``; it sets them at prefill and drops them at release.
"""

from __future__ import annotations

import torch

from draftflow.layers.processors import LogitProcessor
from draftflow.layers.sampling import filter_logits, sample
from draftflow.plugin import Proposal


class RowProposals:
    """Mixin of the DFlash node: processed logits and Proposals, per row."""

    def processed(self, batch, logits: torch.Tensor) -> torch.Tensor:
        """Each row's logits after its request's penalties and bias (committed prefix only): higher acceptance."""
        # logits: [B, K, V]; returns [B, K, V] (the same tensor when no row has processors)
        out = logits
        for i, req in batch.active():
            if req.sampling.has_processors:
                proc = self.processors[i] = LogitProcessor.follow(self.processors.get(i), req, logits.shape[-1],
                                                                  logits.device)
                if batch.size == 1:
                    return proc.process(logits)
                if out is logits:
                    out = logits.clone()
                out[i:i + 1] = proc.process(logits[i:i + 1])
        return out

    def _row_proposal(self, req, logits: torch.Tensor) -> Proposal:
        """One request's drafts from its K rows: grammar-masked, argmax (T = 0) or drawn from the filtered q."""
        # logits: [1, k, V] processed
        s = req.sampling
        if req.slot in self.matchers:
            return self._grammar_proposal(req, logits)
        if s.temperature == 0:
            return Proposal(logits.argmax(dim=-1))
        q = filter_logits(logits, s.temperature, s.top_k, s.top_p, s.min_p)  # [1, K, V]: the q the drafts come from
        return Proposal(sample(q, generator=req.generator), probs=q)

    def _batch_proposal(self, batch, logits: torch.Tensor, widths: list[int]) -> Proposal:
        """Every row's drafts as that row alone would draw them (its own K, generator and grammar), in one Proposal:
        the argmax for greedy rows and padding, q one-hot there when some row sampled."""
        # logits: [B, K, V] processed; widths: drafts per row
        tokens = logits.argmax(dim=-1)  # [B, K]
        lengths, sampled = list(widths), []
        for i, req in batch.active():
            k = widths[i]
            if k == 0 or (req.sampling.temperature == 0 and req.slot not in self.matchers):
                continue
            row = self._row_proposal(req, logits[i:i + 1, :k])
            lengths[i] = row.tokens.shape[1]
            tokens[i, :lengths[i]] = row.tokens[0]
            if row.probs is not None:
                sampled.append((i, row.probs[0]))
        probs = None
        if sampled:
            probs = torch.zeros(logits.shape, dtype=torch.float32, device=logits.device)  # [B, K, V]
            probs.scatter_(-1, tokens[..., None], 1.0)
            for i, q in sampled:
                probs[i, :q.shape[0]] = q
        return Proposal(tokens, probs=probs, lengths=torch.tensor(lengths, dtype=torch.long).to(logits.device))

    def _grammar_proposal(self, req, logits: torch.Tensor) -> Proposal:
        """Drafts picked one row at a time, row j masked by the grammar after the committed tokens and drafts[:j]:
        the masked argmax (T = 0) or a draw from the masked, filtered q (T > 0), which the Proposal carries.
        Drafting stops after an EOS draft (the output ends there)."""
        # logits: [1, K, V] processed (penalties, bias)
        s = req.sampling
        rows = logits[0].float().cpu()  # [K, V]: the row's one host sync, all its draft rows at once
        vocab = rows.shape[-1]
        mask = torch.zeros(vocab, dtype=torch.bool)  # [V]
        probs = []  # [V] per draft
        generator = self.host_generators[req.slot]

        def choose(j: int, allowed: torch.Tensor) -> int:  # allowed: [V_grammar] bool, after drafts[:j]
            width = min(vocab, allowed.shape[0])
            mask[:width] = allowed[:width]
            row = rows[j].masked_fill(~mask, float("-inf"))  # [V]
            if s.temperature == 0:
                return int(row.argmax())
            q = filter_logits(row, s.temperature, s.top_k, s.top_p, s.min_p)  # [V]
            probs.append(q)
            return int(sample(q, generator=generator))

        drafts = self.matchers[req.slot].walk(choose, rows.shape[0])
        device = self.ctx.device
        tokens = torch.tensor([drafts], dtype=torch.long).to(device, non_blocking=True)  # [1, K']
        if not probs:
            return Proposal(tokens)
        return Proposal(tokens, probs=torch.stack(probs)[None].to(device, non_blocking=True))  # [1, K', V]

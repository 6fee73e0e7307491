"""Reading a cycle's verdicts: the one packed device-to-host transfer, row by row, and the cut at a stop.

``read_verdicts`` is the cycle's only host synchronisation (a grammar adds its own, in the
verifier): the verifier's accepted counts and emitted tokens, the proposal's drafts and
lengths, and the logprobs when asked for, in one transfer.
"""

from __future__ import annotations

import torch

from draftflow.core.errors import ModelFormatError
from draftflow.core.node import Batch
from draftflow.core.ports import Verdict
from draftflow.core.request import ActiveRequest, TokenLogprob


def read_verdicts(plan, verifier: str, batch: Batch, values, agree=None) -> dict[int, tuple[int, list[int], list[int], list | None]]:
    """slot -> (accepted, emitted, drafts, logprobs) for every stepped row, from one packed device-to-host transfer.

    ``logprobs`` is None unless the request asked for them; then it holds one ``TokenLogprob`` per emitted token.
    ``agree`` (tensor parallelism): replaces the packed tensor by rank 0's before it is read, on the device.
    """
    b = batch.size
    verdict: Verdict = values[(verifier, "verdict")]
    proposal = next((values.get((e.src, e.src_port)) for e in plan.inputs_of(verifier)
                     if plan.nodes[verifier].manifest.input(e.dst_port).type == "proposal"), None)
    width = verdict.emitted.shape[1]  # K + 1 for the K drafts actually proposed
    # accepted [B], emitted [B, K+1] (-1 past the accepted run), drafts [B, K], lengths [B]: one int64 transfer
    parts = [verdict.accepted[:b].to(torch.int64), verdict.emitted[:b].to(torch.int64).reshape(-1)]
    k = 0
    if proposal is not None and proposal.tokens.numel():
        k = proposal.tokens.shape[1]
        parts.append(proposal.tokens[:b].to(torch.int64).reshape(-1))
        if proposal.lengths is not None:
            parts.append(proposal.lengths[:b].to(torch.int64))
    n = -1
    if verdict.logprobs is not None:
        # Logprobs ride the same transfer: everything as float64, exact for token ids (< 2**53).
        n = verdict.top_ids.shape[-1]
        parts = [p.to(torch.float64) for p in parts] + [
            verdict.logprobs[:b].to(torch.float64).reshape(-1), verdict.top_ids[:b].to(torch.float64).reshape(-1),
            verdict.top_logprobs[:b].to(torch.float64).reshape(-1)]
    packed = torch.cat(parts)
    packed = (packed if agree is None else agree(packed)).tolist()
    lengths_at = b + b * width + b * k
    has_lengths = k > 0 and proposal.lengths is not None
    base = lengths_at + (b if has_lengths else 0)  # the logprob parts start here
    out = {}
    for i, req in batch.active():
        accepted = int(packed[i])
        real = min(int(packed[lengths_at + i]) if has_lengths else k, req.num_draft)
        if not 0 <= accepted <= real:
            node = plan.nodes[verifier].node_type.name
            raise ModelFormatError(f"node '{verifier}' ({node}) accepted {accepted} drafts in row {i} of a cycle "
                                   f"that proposed {real} there; a verifier must accept at most the row's drafts "
                                   "(Proposal.lengths and the request's num_draft)")
        emitted_row = [int(t) for t in packed[b + i * width:b + (i + 1) * width]]
        draft = [int(t) for t in packed[b + b * width + i * k:b + b * width + i * k + real]]
        emitted = [t for t in emitted_row[:accepted + 1] if t >= 0]
        logprobs = None
        if n >= 0 and req.sampling.logprobs is not None:  # rows that did not ask get none
            chosen = packed[base + i * width:base + (i + 1) * width]
            ids_at, lp_at = base + b * width + i * width * n, base + b * width + b * width * n + i * width * n
            ids, lps = packed[ids_at:ids_at + width * n], packed[lp_at:lp_at + width * n]
            top = min(n, req.sampling.logprobs or 0)  # N is the batch's largest; this request asked for `top`
            logprobs = [TokenLogprob(tok, chosen[j], tuple((int(ids[j * n + c]), lps[j * n + c]) for c in range(top)))
                        for j, tok in enumerate(emitted)]
        out[i] = (accepted, emitted, draft, logprobs)
    return out


def cut_at_stop(req: ActiveRequest, emitted: list[int]) -> list[int]:
    """The emitted tokens up to and including a stop token, and within max_new_tokens; sets ``finish_reason``."""
    cut = []
    for tok in emitted:
        cut.append(tok)
        if tok in req.stops:
            req.finish_reason = "stop"
            break
        if len(req.generated) + len(cut) >= req.sampling.max_new_tokens:
            req.finish_reason = "length"
            break
    return cut

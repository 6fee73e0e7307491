"""Acceptance rules: which drafted tokens the target keeps, and what it adds.

One verification cycle checks K drafted tokens against the target's K+1 next-token
distributions (one per draft position plus one after the last draft). Terms used
throughout draftflow (they match vLLM's rejection sampler):

- **accepted** tokens: the longest prefix of the drafts that the rule keeps.
- **recovered** token: emitted at the first rejected position instead of the draft;
  greedy emits the target's argmax there, sampling draws it from the residual
  normalize(max(0, p - q)).
- **bonus** token: emitted after all K drafts were accepted, from the target's
  distribution at row K (the position after the last draft).

So every cycle emits the accepted drafts plus exactly one recovered-or-bonus token:
between 1 and K+1 tokens. Outputs are `accepted` `[B]` (number of drafts kept) and
`emitted` `[B, K+1]`, the emitted ids left-aligned and padded with -1.

`rejection_sample` is lossless (Leviathan et al., arXiv 2211.17192): whatever q the
drafter used, emitted tokens are distributed exactly as sampling the target alone.
Neither function synchronizes with the host: no `.item()`, no `.tolist()`, no Python
branch on tensor values (only on shapes and on whether optional arguments were given),
so a cycle can run inside CUDA graphs / `torch.compile` and the caller decides when to
read `accepted` back.
"""

from __future__ import annotations

import torch

from draftflow.layers.sampling import sample

__all__ = ["greedy_accept", "rejection_sample"]


def greedy_accept(
    draft_tokens: torch.Tensor,  # [B, K] int64
    target_logits: torch.Tensor,  # [B, K+1, V]
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [B] int64, emitted [B, K+1] int64
    """Accept the longest draft prefix equal to the target's argmax (temperature 0).

    The token after the accepted prefix is the target's argmax there: the recovered
    token at the first mismatch, or the bonus token after a full match.

    Args:
        draft_tokens: drafted ids, `[B, K]`; K may be 0.
        target_logits: target scores for the K+1 positions, `[B, K+1, V]`.

    Returns:
        `accepted` `[B]` and `emitted` `[B, K+1]` padded with -1.
    """
    _check_shapes(draft_tokens, target_logits, "greedy_accept", "target_logits")
    if target_logits.is_cuda and draft_tokens.dtype == torch.long:
        from draftflow.plugins.verifier.greedy_kernel import greedy_verdict

        return greedy_verdict(draft_tokens, target_logits)  # the same rule in two launches instead of nine
    target_ids = target_logits.argmax(dim=-1)  # [B, K+1]
    is_match = draft_tokens == target_ids[:, :-1]  # [B, K]
    accepted = is_match.long().cumprod(dim=1).sum(dim=1)  # [B]
    # Accepted drafts equal the target argmax, so the emitted row is just the target's
    # argmax up to and including position `accepted`.
    positions = torch.arange(target_ids.shape[1], device=target_ids.device)  # [K+1]
    is_emitted = positions[None, :] <= accepted[:, None]  # [B, K+1]
    emitted = torch.where(is_emitted, target_ids, torch.full_like(target_ids, -1))
    return accepted, emitted


def rejection_sample(
    draft_tokens: torch.Tensor,  # [B, K] int64
    target_probs: torch.Tensor,  # [B, K+1, V], already filtered (see filter_logits)
    draft_probs: torch.Tensor | None = None,  # [B, K, V], or [B, K, C] with candidate_ids
    candidate_ids: torch.Tensor | None = None,  # [B, K, C] int64
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # accepted [B] int64, emitted [B, K+1] int64
    """Lossless speculative sampling of K drafts against target distributions p.

    Draft x at position j is accepted with probability min(1, p(x) / q(x)); a draft
    with q(x) = 0 is rejected. The first rejection emits a recovered token from
    normalize(max(0, p - q)) (from p if that residual is all zero) and ends the cycle;
    after K accepts a bonus token is drawn from p at row K.

    q, the distribution the drafter drew x from, takes one of three forms:

    - `draft_probs=None`: deterministic drafts (argmax, n-gram, ...), q is one-hot at x.
      Accept with probability p(x); the residual is p with x removed.
    - `draft_probs` `[B, K, V]`: q over the full vocabulary.
    - `draft_probs` `[B, K, C]` with `candidate_ids` `[B, K, C]`: q is a distribution over
      C candidate ids; q(x) is the mass of the candidates equal to x and the residual
      subtracts q scattered onto the candidate ids.

    Args:
        draft_tokens: drafted ids, `[B, K]`; K may be 0 (then only the bonus is drawn).
        target_probs: the target's filtered probabilities, `[B, K+1, V]`; pass the
            output of `filter_logits` so the result matches ordinary sampling.
        draft_probs: q as described above, or None.
        candidate_ids: vocabulary ids of the C candidates, only with `[B, K, C]` q.
        generator: source of all randomness; a seeded generator repeats exactly.

    Returns:
        `accepted` `[B]` and `emitted` `[B, K+1]` padded with -1.

    Raises:
        ValueError: when shapes disagree or `candidate_ids` comes without `draft_probs`.
    """
    _check_shapes(draft_tokens, target_probs, "rejection_sample", "target_probs")
    _check_draft_probs(draft_tokens, target_probs, draft_probs, candidate_ids)
    batch_size, num_drafts = draft_tokens.shape
    device = target_probs.device
    work_dtype = torch.promote_types(target_probs.dtype, torch.float32)

    draft_ids = draft_tokens[:, :, None]  # [B, K, 1]
    target_at_draft = target_probs[:, :-1].gather(-1, draft_ids)[..., 0].to(work_dtype)  # [B, K]
    draft_at_draft = _draft_mass(draft_tokens, draft_probs, candidate_ids).to(work_dtype)  # [B, K]
    uniform = torch.rand((batch_size, num_drafts), generator=generator, device=device, dtype=work_dtype)
    is_accepted = _accept_flags(uniform, target_at_draft, draft_at_draft)  # [B, K]
    # A draft only counts if every earlier draft was accepted too.
    accepted = is_accepted.long().cumprod(dim=1).sum(dim=1)  # [B]

    # Only one position per row needs a fresh token: `accepted` itself (recovered when
    # < K, bonus when == K). Gathering that row first keeps the residual work at [B, V]
    # instead of [B, K, V].
    vocab_size = target_probs.shape[-1]
    row_index = accepted[:, None, None].expand(batch_size, 1, vocab_size)  # [B, 1, V]
    target_row = target_probs.gather(1, row_index)[:, 0].to(work_dtype)  # [B, V]
    if num_drafts == 0:
        final_dist = target_row
    else:
        draft_row = accepted.clamp(max=num_drafts - 1)  # [B]; clamped rows are bonus rows
        residual = _residual(target_row, draft_row, draft_tokens, draft_probs, candidate_ids)  # [B, V]
        # max(0, p - q) is all zero only when q == p, where a rejection needs a draft q
        # gives no mass (which q could not have drawn); p is the sensible fallback.
        residual_mass = residual.sum(dim=-1, keepdim=True)  # [B, 1]
        residual = torch.where(residual_mass > 0, residual, target_row)
        is_bonus = (accepted == num_drafts)[:, None]  # [B, 1]
        final_dist = torch.where(is_bonus, target_row, residual)
    final_token = sample(final_dist, generator)  # [B]; the race needs no normalisation

    positions = torch.arange(num_drafts + 1, device=device)[None, :]  # [1, K+1]
    padded_drafts = torch.nn.functional.pad(draft_tokens, (0, 1), value=-1)  # [B, K+1]
    emitted = torch.where(positions < accepted[:, None], padded_drafts, final_token[:, None])
    emitted = torch.where(positions <= accepted[:, None], emitted, torch.full_like(emitted, -1))
    return accepted, emitted


def _accept_flags(
    uniform: torch.Tensor,  # [B, K] in [0, 1)
    target_at_draft: torch.Tensor,  # [B, K] p(x)
    draft_at_draft: torch.Tensor,  # [B, K] q(x)
) -> torch.Tensor:  # [B, K] bool
    """Accept with probability min(1, p/q); q(x) = 0 (a token q never proposes) rejects.

    `u * q < p` avoids dividing by q; with u in [0, 1) it holds with probability
    min(1, p/q). Kept separate so tests can swap in a broken rule as a negative control.
    """
    return (draft_at_draft > 0) & (uniform * draft_at_draft < target_at_draft)


def _draft_mass(
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # None, [B, K, V] or [B, K, C]
    candidate_ids: torch.Tensor | None,  # None or [B, K, C]
) -> torch.Tensor:  # [B, K] q(x)
    """q(x) for each draft under the three forms of q."""
    if draft_probs is None:
        return torch.ones(draft_tokens.shape, device=draft_tokens.device)
    if candidate_ids is None:
        return draft_probs.gather(-1, draft_tokens[:, :, None])[..., 0]
    # Summing over matches handles repeated candidate ids and drafts outside the set.
    is_draft = candidate_ids == draft_tokens[:, :, None]  # [B, K, C]
    return (draft_probs * is_draft).sum(dim=-1)


def _residual(
    target_row: torch.Tensor,  # [B, V] p at the rejected position
    draft_row: torch.Tensor,  # [B] index of that position in [0, K)
    draft_tokens: torch.Tensor,  # [B, K]
    draft_probs: torch.Tensor | None,  # None, [B, K, V] or [B, K, C]
    candidate_ids: torch.Tensor | None,  # None or [B, K, C]
) -> torch.Tensor:  # [B, V] max(0, p - q), unnormalised
    """max(0, p - q) at one position per row, for the three forms of q."""
    if draft_probs is None:
        # One-hot q: p - q is p with the draft's entry lowered by 1, i.e. zeroed.
        draft_id = draft_tokens.gather(1, draft_row[:, None])  # [B, 1]
        return target_row.scatter(-1, draft_id, 0.0)
    width = draft_probs.shape[-1]
    row_index = draft_row[:, None, None].expand(-1, 1, width)  # [B, 1, V or C]
    q_row = draft_probs.gather(1, row_index)[:, 0].to(target_row.dtype)  # [B, V or C]
    if candidate_ids is None:
        return (target_row - q_row).clamp_min(0.0)
    ids_row = candidate_ids.gather(1, row_index)[:, 0]  # [B, C]
    return target_row.scatter_add(-1, ids_row, -q_row).clamp_min(0.0)


def _check_shapes(draft_tokens: torch.Tensor, target: torch.Tensor, caller: str, name: str) -> None:
    """Reject mismatched shapes early with the fix in the message (shapes only, no sync)."""
    if draft_tokens.dim() != 2 or target.dim() != 3:
        raise ValueError(
            f"{caller}: draft_tokens must be [B, K] and {name} [B, K+1, V]; got "
            f"{tuple(draft_tokens.shape)} and {tuple(target.shape)}"
        )
    batch_size, num_drafts = draft_tokens.shape
    if target.shape[:2] != (batch_size, num_drafts + 1):
        raise ValueError(
            f"{caller}: {name} has shape {tuple(target.shape)} but draft_tokens {tuple(draft_tokens.shape)} "
            f"needs [{batch_size}, {num_drafts + 1}, V]: one row per draft plus one for the bonus token"
        )


def _check_draft_probs(
    draft_tokens: torch.Tensor,
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor | None,
    candidate_ids: torch.Tensor | None,
) -> None:
    """Check that draft_probs / candidate_ids form one of the three supported q forms."""
    if draft_probs is None:
        if candidate_ids is not None:
            raise ValueError(
                "rejection_sample: candidate_ids given without draft_probs; "
                "pass q over the candidates as draft_probs [B, K, C]"
            )
        return
    batch_size, num_drafts = draft_tokens.shape
    if candidate_ids is None:
        expected = (batch_size, num_drafts, target_probs.shape[-1])
        if tuple(draft_probs.shape) != expected:
            raise ValueError(
                f"rejection_sample: draft_probs has shape {tuple(draft_probs.shape)}, expected "
                f"{list(expected)} (full-vocabulary q); for q over candidates also pass candidate_ids [B, K, C]"
            )
        return
    same_shape = tuple(candidate_ids.shape) == tuple(draft_probs.shape)
    if draft_probs.dim() != 3 or not same_shape or draft_probs.shape[:2] != (batch_size, num_drafts):
        raise ValueError(
            f"rejection_sample: draft_probs {tuple(draft_probs.shape)} and candidate_ids "
            f"{tuple(candidate_ids.shape)} must both be [{batch_size}, {num_drafts}, C]"
        )

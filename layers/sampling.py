"""Turn target logits into the distribution p that verification is lossless against.

`filter_logits` applies temperature, top-k, top-p (nucleus) and min-p in that order, the
order of the usual single-model sampler, so speculative decoding reproduces exactly the
distribution a user would get without a drafter. `sample` draws from (possibly
unnormalised) probabilities without a host synchronization.

Both functions are vectorised over any leading dimensions and never read tensor values
on the host: their only Python branches are on arguments (floats, ints) and shapes.
"""

from __future__ import annotations

import math

import torch

__all__ = ["filter_logits", "filter_scores", "sample"]


def filter_logits(
    logits: torch.Tensor,  # [..., V]
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:  # [..., V] float, each row sums to 1
    """Return the sampling distribution for `logits` after temperature, top-k, top-p and min-p.

    Args:
        logits: raw scores, `[..., V]`.
        temperature: divides the logits; `0` means greedy, a one-hot row at the argmax
            (top-k, top-p and min-p never drop the argmax, so they are ignored).
        top_k: keep the `top_k` highest-scoring tokens; `None` or `0` keeps all.
            Tokens tied with the k-th score are kept too.
        top_p: nucleus filter applied after top-k: keep the smallest set of most likely
            tokens whose mass reaches `top_p`; the most likely token is always kept.
            `None` or `1.0` keeps all.
        min_p: applied last: drop tokens whose probability is below `min_p` times the
            most likely token's. `None` or `0` keeps all.

    Raises:
        ValueError: when `temperature < 0`, `top_k < 0`, `top_p` is outside (0, 1] or
            `min_p` outside [0, 1].
    """
    if temperature < 0:
        raise ValueError(
            f"filter_logits: temperature={temperature} is negative; use 0 for greedy or a value > 0"
        )
    if temperature == 0:
        _check_filters(top_k, top_p, min_p)
        scores = logits.to(torch.promote_types(logits.dtype, torch.float32))
        greedy_ids = scores.argmax(dim=-1, keepdim=True)  # [..., 1]
        return torch.zeros_like(scores).scatter_(-1, greedy_ids, 1.0)
    return filter_scores(logits, temperature, top_k, top_p, min_p).softmax(dim=-1)


def filter_scores(
    logits: torch.Tensor,  # [..., V]
    temperature: float = 1.0,
    top_k: int | None = None,
    top_p: float | None = None,
    min_p: float | None = None,
) -> torch.Tensor:  # [..., V] float32 at least; dropped tokens are -inf
    """The tempered scores `filter_logits` takes the softmax of, with filtered tokens at -inf.

    `.softmax(-1)` of the result is `filter_logits(...)` and `.log_softmax(-1)` its exact
    log-probabilities (what `logprobs` reports). `temperature` must be > 0 here.
    """
    if not temperature > 0:
        raise ValueError(f"filter_scores: temperature={temperature} must be > 0; use filter_logits for greedy")
    _check_filters(top_k, top_p, min_p)
    # float32 at least: bf16 softmax/cumsum rounding would shift nucleus boundaries.
    scores = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    vocab_size = scores.shape[-1]
    if top_k and top_k < vocab_size:
        kth_score = scores.topk(top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth_score, float("-inf"))

    if top_p is not None and top_p < 1.0:
        sorted_probs, sorted_ids = scores.softmax(dim=-1).sort(dim=-1, descending=True)  # [..., V] each
        # Mass strictly before each token: a token is needed while that mass is still
        # short of top_p. The top token has 0 before it, so it is always kept.
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        keep_sorted = mass_before < top_p  # [..., V]
        keep = torch.zeros_like(keep_sorted).scatter_(-1, sorted_ids, keep_sorted)
        scores = scores.masked_fill(~keep, float("-inf"))
    if min_p:
        # p_i < min_p * p_max  <=>  s_i < s_max + log(min_p): no softmax needed, and the
        # renormalisation after top-p does not move the threshold.
        best = scores.max(dim=-1, keepdim=True).values  # [..., 1]
        scores = scores.masked_fill(scores < best + math.log(min_p), float("-inf"))
    return scores


def _check_filters(top_k: int | None, top_p: float | None, min_p: float | None) -> None:
    if top_k is not None and top_k < 0:
        raise ValueError(f"filter_logits: top_k={top_k} is negative; use 0 or None to disable top-k")
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise ValueError(f"filter_logits: top_p={top_p} is outside (0, 1]; use 1.0 or None to disable top-p")
    if min_p is not None and not 0.0 <= min_p <= 1.0:
        raise ValueError(f"filter_logits: min_p={min_p} is outside [0, 1]; use 0 or None to disable min-p")


def sample(
    probs: torch.Tensor,  # [..., V] non-negative, need not be normalised
    generator: torch.Generator | None = None,
) -> torch.Tensor:  # [...] int64
    """Draw one token id per row of `probs` without a host synchronization.

    Uses the exponential race: `argmax(probs / E)` with `E ~ Exp(1)` i.i.d. picks index
    i with probability `probs[i] / sum(probs)`, so rows need not be normalised (the
    rejection sampler relies on this for its residuals). Zero-probability tokens are
    never picked unless the whole row is zero (then index 0 is returned).

    Args:
        probs: non-negative weights, `[..., V]`.
        generator: source of all randomness; seeded generators repeat exactly.
    """
    race = torch.empty_like(probs, dtype=torch.promote_types(probs.dtype, torch.float32))
    race.exponential_(generator=generator)
    # exponential_ may return exactly 0; p/0 would be inf (or nan for p == 0, which
    # argmax would pick), so keep the divisor positive.
    race.clamp_min_(torch.finfo(race.dtype).tiny)
    return (probs / race).argmax(dim=-1)

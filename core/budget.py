"""The VRAM plan: weights, KV and scratch per node against a budget; the KV cache autosizes.

Like vLLM's memory-utilization setting, the target's KV capacity is whatever the budget
leaves after every node's weights and scratch, capped by the model's context limit.

A graph whose target declares an expert pool (MoE, ``Vram.experts``) is planned the other
way round: the KV cache gets its full cap (``max_context``, else the model's context
limit) and the expert cache takes what is left after every node's weights, KV and
scratch. Each other node's cost is stated in experts: how many more would be resident
without it.
"""

from __future__ import annotations

import attrs

# The smallest KV capacity we accept when autosizing; below this a graph is not useful.
MIN_KV_TOKENS = 256
AUTO_BATCH_CAP = 64  # max_batch: auto never plans more request slots than this
AUTO_BATCH_NO_BUDGET = 16  # max_batch: auto without a budget to size it from (CPU graphs without vram_budget)
AUTO_BATCH_EXPERTS = 8  # max_batch: auto for MoE targets, whose expert cache takes what the budget leaves


@attrs.frozen
class VramRow:
    node: str
    weights: int
    kv: int
    scratch: int
    experts: int = 0  # bytes of the resident expert cache

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.scratch + self.experts


@attrs.frozen
class ExpertPlan:
    """How many of a node's pooled experts are device resident, and what each other node costs in experts."""

    node: str
    resident: int
    total: int
    bytes_per_expert: int
    reason: str  # "pinned by expert_cache", "vram_budget", "all fit", "no vram_budget"
    costs: tuple[tuple[str, int], ...] = ()  # (node, experts it displaces); empty without a budget


@attrs.frozen
class VramPlan:
    rows: tuple[VramRow, ...]
    budget: int | None
    kv_tokens: int | None
    kv_limit_reason: str
    experts: ExpertPlan | None = None
    batch: int = 1  # request slots allocated (max_batch)
    batch_reason: str = "max_batch"
    batch_fits: int | None = None  # requests of kv_tokens context the budget holds (None: no budget)

    @property
    def total(self) -> int:
        return sum(r.total for r in self.rows)


def fmt_bytes(n: int | None) -> str:
    if n is None:
        return "unlimited"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def plan_vram(manifests: dict, budget: int | None, max_context: int | None, max_batch: int | None = 1):
    """Size the request slots and the KV cache and fill the table. Returns (VramPlan, [(node, message, fix)]).

    ``max_batch`` None is "auto": as many request slots of the full context as the budget holds
    (at most AUTO_BATCH_CAP).
    """
    problems = []
    per_token = {name: m.kv_bytes_per_token() for name, m in manifests.items()}
    limits = [m.max_tokens for m in manifests.values() if m.max_tokens is not None and per_token[_n(manifests, m)]]
    cap = min(limits) if limits else None
    reason = "model context limit"
    if max_context is not None:
        if cap is not None and max_context > cap:
            problems.append(("", f"max_context {max_context} exceeds the model context limit {cap}", f"set max_context <= {cap}"))
        cap = max_context if cap is None else min(cap, max_context)
        reason = "max_context"
    batch, batch_reason, fits = _slots(manifests, budget, cap, max_batch)
    fixed = {name: m.vram.weights + m.vram.scratch + m.fixed_buffer_bytes(batch) for name, m in manifests.items()}
    per_token = {name: m.kv_bytes_per_token(batch) for name, m in manifests.items()}
    kv_bytes_per_token = sum(per_token.values())
    fixed_total = sum(fixed.values())
    kv_tokens = cap if kv_bytes_per_token else None
    pools = {name: m.vram.experts for name, m in manifests.items() if m.vram.experts is not None}
    if pools:
        vram, problems = _plan_with_experts(manifests, budget, fixed, per_token, kv_tokens, reason, pools, problems, batch)
        return attrs.evolve(vram, batch=batch, batch_reason=batch_reason, batch_fits=fits), problems
    if budget is not None:
        left = budget - fixed_total
        if left < 0:
            worst = max(fixed, key=fixed.get)
            problems.append((worst, f"weights and scratch need {fmt_bytes(fixed_total)} but vram_budget is {fmt_bytes(budget)}",
                             f"raise vram_budget above {fmt_bytes(fixed_total)} or use a smaller dtype/model (largest: '{worst}')"))
            left = 0
        if kv_bytes_per_token:
            fit = left // kv_bytes_per_token
            if cap is None or fit < cap:
                kv_tokens, reason = fit, "vram_budget"
            need = min(MIN_KV_TOKENS, cap) if cap else MIN_KV_TOKENS
            if max_context is not None:
                need = max_context
            if fit < need and left >= 0 and fixed_total <= budget:
                owner = max(per_token, key=per_token.get)
                problems.append((owner, f"the KV cache fits only {fit} tokens in the {fmt_bytes(left)} left of vram_budget, {need} needed",
                                 f"raise vram_budget by {fmt_bytes((need - fit) * kv_bytes_per_token)} or lower max_context"))
    rows = []
    for name, m in manifests.items():
        kv = per_token[name] * (kv_tokens or 0)
        rows.append(VramRow(name, m.vram.weights, kv, m.vram.scratch + m.fixed_buffer_bytes(batch)))
    return VramPlan(tuple(rows), budget, kv_tokens, reason, batch=batch, batch_reason=batch_reason, batch_fits=fits), problems


def _slots(manifests: dict, budget: int | None, cap: int | None, max_batch: int | None) -> tuple[int, str, int | None]:
    """(slots, why, requests of `cap` tokens the budget holds): bytes are linear in the slots, a + b * slots."""
    tokens = cap or MIN_KV_TOKENS

    def cost(slots: int) -> int:
        return sum(m.vram.weights + m.vram.scratch + m.fixed_buffer_bytes(slots) + m.kv_bytes_per_token(slots) * tokens
                   for m in manifests.values())

    base, per_slot = cost(0), cost(1) - cost(0)
    fits = None if budget is None or per_slot <= 0 else max(0, (budget - base) // per_slot)
    if max_batch is not None:
        return max_batch, "max_batch", fits
    moe = any(m.vram.experts is not None for m in manifests.values())
    if fits is None:
        return (AUTO_BATCH_EXPERTS if moe else AUTO_BATCH_NO_BUDGET), "max_batch auto, no vram_budget", fits
    cap_slots = AUTO_BATCH_EXPERTS if moe else AUTO_BATCH_CAP
    return max(1, min(cap_slots, fits)), f"max_batch auto, at most {cap_slots}", fits


def _n(manifests, manifest):
    return next(name for name, m in manifests.items() if m is manifest)


def _plan_with_experts(manifests, budget, fixed, per_token, kv_tokens, reason, pools, problems, batch=1):
    """KV at its cap; the one expert pool gets what the budget leaves (or its pinned count)."""
    owner, pool = next(iter(pools.items()))
    if len(pools) > 1:
        problems.append((sorted(pools)[1], f"nodes {', '.join(sorted(pools))} each declare an expert pool; one graph "
                         "can size only one", "keep one MoE target in the graph"))
    if kv_tokens is None and any(per_token.values()):
        kv_tokens, reason = MIN_KV_TOKENS, "default for MoE targets without a context limit"
    kv = {name: per_token[name] * (kv_tokens or 0) for name in manifests}
    used = sum(fixed.values()) + sum(kv.values())
    b = pool.bytes_per_expert
    costs: tuple = ()
    if budget is None:
        resident, why = (pool.pinned, "pinned by expert_cache") if pool.pinned else (pool.total, "no vram_budget")
    else:
        left = budget - used
        fit = min(pool.total, max(left, 0) // b)
        if left < 0:
            problems.append((owner, f"weights, scratch and a {kv_tokens}-token KV cache need {fmt_bytes(used)} but "
                             f"vram_budget is {fmt_bytes(budget)}, before any expert",
                             f"raise vram_budget above {fmt_bytes(used + pool.minimum * b)} or lower max_context"))
        resident, why = (pool.pinned, "pinned by expert_cache") if pool.pinned else (
            fit, "all fit" if fit == pool.total else "vram_budget")
        if not pool.pinned and 0 <= left and fit < pool.minimum:
            problems.append((owner, f"the expert cache fits only {fit} experts in the {fmt_bytes(left)} left of "
                             f"vram_budget after weights and a {kv_tokens}-token KV cache; {pool.minimum} needed "
                             "(top-k per MoE layer)",
                             f"raise vram_budget by {fmt_bytes((pool.minimum - fit) * b)} or lower max_context"))
        elif pool.pinned and left >= 0 and pool.pinned * b > left:
            problems.append((owner, f"expert_cache={pool.pinned} needs {fmt_bytes(pool.pinned * b)} but only "
                             f"{fmt_bytes(left)} of vram_budget is left after weights and KV",
                             f"lower expert_cache to at most {fit} or raise vram_budget"))
        costs = tuple((name, min(pool.total, (max(left, 0) + fixed[name] + kv[name]) // b) - fit)
                      for name in manifests if name != owner)
    if pool.pinned and pool.pinned > pool.total:
        problems.append((owner, f"expert_cache={pool.pinned} is more than the model's {pool.total} experts",
                         f"set expert_cache to at most {pool.total} (0 = autosize)"))
    elif pool.pinned and pool.pinned < pool.minimum:
        problems.append((owner, f"expert_cache={pool.pinned} is below the minimum of {pool.minimum} (top-k per MoE layer)",
                         f"set expert_cache to at least {pool.minimum} (0 = autosize)"))
    resident = max(0, min(resident, pool.total))
    rows = tuple(VramRow(name, m.vram.weights, kv[name], m.vram.scratch + m.fixed_buffer_bytes(batch),
                         resident * b if name == owner else 0) for name, m in manifests.items())
    plan = ExpertPlan(owner, resident, pool.total, b, why, costs)
    return VramPlan(rows, budget, kv_tokens, reason, plan), problems

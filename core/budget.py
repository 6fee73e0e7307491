"""The VRAM plan: weights, KV and scratch per node against a budget; the KV cache autosizes.

Like vLLM's memory-utilization setting, the target's KV capacity is whatever the budget
leaves after every node's weights and scratch, capped by the model's context limit.
"""

from __future__ import annotations

import attrs

# The smallest KV capacity we accept when autosizing; below this a graph is not useful.
MIN_KV_TOKENS = 256


@attrs.frozen
class VramRow:
    node: str
    weights: int
    kv: int
    scratch: int

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.scratch


@attrs.frozen
class VramPlan:
    rows: tuple[VramRow, ...]
    budget: int | None
    kv_tokens: int | None
    kv_limit_reason: str

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


def plan_vram(manifests: dict, budget: int | None, max_context: int | None):
    """Size the KV cache and fill the table. Returns (VramPlan, [problem texts (node, message, fix)])."""
    problems = []
    fixed = {name: m.vram.weights + m.vram.scratch + m.fixed_buffer_bytes() for name, m in manifests.items()}
    per_token = {name: m.kv_bytes_per_token() for name, m in manifests.items()}
    kv_bytes_per_token = sum(per_token.values())
    limits = [m.max_tokens for m in manifests.values() if m.max_tokens is not None and per_token[_n(manifests, m)]]
    cap = min(limits) if limits else None
    reason = "model context limit"
    if max_context is not None:
        if cap is not None and max_context > cap:
            problems.append(("", f"max_context {max_context} exceeds the model context limit {cap}", f"set max_context <= {cap}"))
        cap = max_context if cap is None else min(cap, max_context)
        reason = "max_context"
    fixed_total = sum(fixed.values())
    kv_tokens = cap if kv_bytes_per_token else None
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
        rows.append(VramRow(name, m.vram.weights, kv, m.vram.scratch + m.fixed_buffer_bytes()))
    return VramPlan(tuple(rows), budget, kv_tokens, reason), problems


def _n(manifests, manifest):
    return next(name for name, m in manifests.items() if m is manifest)

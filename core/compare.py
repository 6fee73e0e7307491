"""`draftflow generate --compare`: the same request again on the graph's target alone, in the same process.

The target-only graph keeps the graph's target and verifier nodes with their resolved params
(paths absolute), drops every drafter, selector and policy, and drafts nothing (`num_draft: 0`,
no feature taps). Both sessions load and warm up the same way, so their `tokens_per_s` (first
emitted token to the last, prefill included) compare like for like.

The speed of a shared or busy machine drifts between runs, so one run a side can put a
machine's load change into the speedup. `compare` times ROUNDS rounds (`--compare-rounds`,
default 3): round 1 pairs the printed (traced) run with a target-only run, each later round
repeats the request on the speculative session (untraced) and then on the target alone. The
reported speedup is the median of the rounds' ratios (each ratio pairs two adjacent runs),
the target-only rate the median of its runs. Greedy requests must give the same tokens in
every run: `identical` says whether they did.
"""

from __future__ import annotations

import statistics
from pathlib import Path

KEPT_ROLES = ("target", "verifier")
ROUNDS = 3  # --compare-rounds's default


def target_only_graph(plan) -> dict:
    """A graph dict with `plan`'s target and verifier alone (params as resolved, so paths are absolute)."""
    spec = plan.spec
    nodes = {}
    for name, node in plan.nodes.items():
        if node.manifest.role not in KEPT_ROLES:
            continue
        params = {k: str(v) if isinstance(v, Path) else v for k, v in node.params.items()}
        if node.manifest.role == "target" and "tap_layers" in params:
            params["tap_layers"] = []  # no drafter reads features
        nodes[name] = {"plugin": node.node_type.name, "params": params}
    graph = {"name": f"{spec.name}-target-only", "device": spec.device, "dtype": spec.dtype, "num_draft": 0,
             "nodes": nodes}
    if spec.max_context is not None:
        graph["max_context"] = spec.max_context
    return graph


def compare(session, prompt_ids, sampling, result, rounds: int = ROUNDS) -> dict:
    """Time `rounds` rounds of `prompt_ids` (speculative run, then target-only run); `result` is round 1's first run.

    Returns the median target-only rate, the median of the rounds' speedups, whether every run gave
    `result`'s tokens, and each round's rates. The target-only session runs on `session`'s threads.
    """
    from draftflow.core.session import Session

    baseline = Session.open(graph_dict=target_only_graph(session.plan), threads=session.threads)
    want, runs, same = list(result.token_ids), [], True
    try:
        for i in range(rounds):
            if i:
                with session.untraced():
                    spec = session.generate(prompt_ids, sampling)
            else:
                spec = result
            alone = baseline.generate(prompt_ids, sampling)
            same = same and list(spec.token_ids) == want == list(alone.token_ids)
            spec_rate, base_rate = spec.stats["tokens_per_s"], alone.stats["tokens_per_s"]
            runs.append({"tokens_per_s": spec_rate, "target_only_tokens_per_s": base_rate,
                         "speedup": round(spec_rate / base_rate, 3) if base_rate else None})
    finally:
        baseline.close()
    ratios = [r["speedup"] for r in runs if r["speedup"] is not None]
    return {"target_only_tokens_per_s": statistics.median(r["target_only_tokens_per_s"] for r in runs),
            "speedup": round(statistics.median(ratios), 3) if ratios else None, "identical": same, "rounds": runs}

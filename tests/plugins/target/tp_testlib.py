"""Tensor-parallel test worker: `python tp_testlib.py SCENARIOS.json OUT_DIR` as one rank of 2 (RANK etc. set).

Every scenario runs twice on rank 0: at tensor_parallel 1 (the reference; no collective, the other
rank waits) and at tensor_parallel 2 (both ranks: rank 0 leads, rank 1 mirrors until rank 0 closes).
Rank 0 writes what both runs emitted, and its shard's shapes, to OUT_DIR/results.json.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def run_scenario(scenario: dict, tensor_parallel: int) -> dict | None:
    """One scenario's requests through a Session; None on a follower (it mirrored rank 0 instead)."""
    from draftflow.core.errors import FollowerDone
    from draftflow.core.node import SamplingParams
    from draftflow.core.session import Session

    overrides = [*scenario.get("overrides", []), f"tensor_parallel={tensor_parallel}"]
    try:
        session = Session.open(graph_dict=scenario["graph"], overrides=overrides, threads=1)
    except FollowerDone:
        return None
    try:
        ex = session.executor
        sampling = SamplingParams(**scenario["sampling"])
        prompts = scenario["prompts"]
        if scenario.get("together"):  # every prompt live at once, prefilled in chunks, batched cycles: the server's path
            states = [ex.start(p, sampling, defer_prefill=True) for p in prompts]
            while not all(s.ready for s in states):
                ex.prefill_many([s for s in states if not s.ready], budget=3)
            while any(s.finish_reason is None for s in states):
                ex.step([s for s in states if s.finish_reason is None])
            results = [ex.finish(s) for s in states]
        else:
            results = [session.generate(p, sampling) for p in prompts]
        target = ex.nodes["target"]
        return {"tokens": [list(r.token_ids) for r in results], "drafted": sum(r.stats["drafted"] for r in results),
                "accepted": sum(r.stats["accepted"] for r in results),
                "heads": [target.model.config.num_heads, target.model.config.num_kv_heads],
                "kv_shape": list(target.cache.buffer.shape)}
    finally:
        session.close()


def main(scenarios_file: str, out_dir: str) -> int:
    import torch

    from draftflow.core.tracing import configure_logging

    configure_logging(verbose=False)  # no line per cycle
    torch.set_num_threads(1)
    rank = int(os.environ["RANK"])
    scenarios = json.loads(Path(scenarios_file).read_text())
    results = {}
    for name, scenario in scenarios.items():
        ref = run_scenario(scenario, 1) if rank == 0 else None
        sharded = run_scenario(scenario, 2)
        if rank == 0:
            results[name] = {"tp1": ref, "tp2": sharded}
    if rank == 0:
        Path(out_dir, "results.json").write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))

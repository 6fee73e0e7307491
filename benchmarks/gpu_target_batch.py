"""Batched target steps on one GPU at Qwen3-8B shapes (random bf16 weights): ms per step at B rows and W tokens.

Every slot holds `--context` committed positions (random K/V); a step verifies a [B, W] window,
each row at its own position, through the node's GraphRunner (CUDA graphs keyed by batch
bucket). Split-KV Triton attention (the default) is compared with the masked SDPA kernel.
`--b1-only` times only the single-request path through the API older trees also have
(`GraphRunner(model, cache, 16)(anchor, drafts, start)`), to compare B = 1 before and after.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu_target as gt  # noqa: E402  (the model shapes, the random model and the CUDA-event timer)


def b1(model, cfg, context: int) -> dict:
    from draftflow.layers.kv_cache import KVCache, static_shape
    from draftflow.plugins.target.graphs import GraphRunner

    kv = KVCache.from_static(torch.randn(static_shape(cfg, 1, 2048), dtype=torch.bfloat16, device=gt.DEV) * 0.1)
    kv.commit(context)
    runner = GraphRunner(model, kv, 16, capture=gt.DEV == "cuda")
    out = {}
    with torch.inference_mode():
        for w in (1, 16):
            drafts = torch.randint(0, 100, (1, w - 1), device=gt.DEV) if w > 1 else None
            runner(7, drafts, context)
            gt.sync()
            out[f"B=1 W={w}"] = gt.cuda_ms(lambda: runner(7, drafts, context), reps=50)
    return out


def batched(model, cfg, context: int, batches: list[int], widths: list[int]) -> dict:
    from draftflow.layers.kv_cache import KVCache, static_shape
    from draftflow.plugins.target.graphs import GraphRunner

    slots = max(batches)
    kv = KVCache.from_static(torch.randn(static_shape(cfg, slots, context + 32), dtype=torch.bfloat16, device=gt.DEV) * 0.1)
    # Rows at different positions around `context` (a real batch is ragged).
    starts = [context - (b * 37) % 64 for b in range(slots)]
    for b, s in enumerate(starts):
        kv.commit(s, row=b)
    out = {}
    for name, split in (("split-KV", True), ("masked SDPA", False)):
        runner = GraphRunner(model, kv, 16, triton_attention=split, capture=gt.DEV == "cuda")
        for w in widths:
            for b in batches:
                if b == 1 and not split:
                    continue
                drafts = torch.randint(0, 100, (b, w - 1), device=gt.DEV) if w > 1 else None
                anchors = [7] * b
                with torch.inference_mode():
                    runner.step(anchors, drafts, starts[:b])
                    gt.sync()
                    ms = gt.cuda_ms(lambda: runner.step(anchors, drafts, starts[:b]), reps=20)
                out[f"{name} B={b} W={w}"] = {"ms": round(ms, 4), "rows_per_s": round(b / ms * 1e3, 1),
                                             "tokens_per_s": round(b * w / ms * 1e3, 1)}
                print(f"{name} B={b} W={w}: {ms:.3f} ms  ({b / ms * 1e3:.0f} windows/s)", flush=True)
        del runner
        torch.cuda.empty_cache() if gt.DEV == "cuda" else None
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="results JSON file")
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--batches", default="1,4,16,64")
    p.add_argument("--widths", default="1,16")
    p.add_argument("--b1-only", action="store_true")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model on the CPU: checks this script")
    a = p.parse_args()
    from draftflow.layers.config import TargetConfig

    if a.tiny:
        gt.DEV = "cpu"
    cfg = TargetConfig.from_hf_dict(gt.TINY if a.tiny else gt.QWEN3_8B, "qwen3-8b-shapes")
    model = gt.build_model(cfg, seed=0)
    res = {"gpu": torch.cuda.get_device_name() if gt.DEV == "cuda" else "cpu", "context": a.context}
    res["b1"] = b1(model, cfg, a.context)
    print(json.dumps(res["b1"]), flush=True)
    if not a.b1_only:
        res["batched"] = batched(model, cfg, a.context, [int(x) for x in a.batches.split(",")],
                                 [int(x) for x in a.widths.split(",")])
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

"""One DFlash proposal over B request slots at Qwen3-8B-DFlash-b16 shapes (random bf16 weights).

    python benchmarks/gpu_dflash_slots.py [--tiny] [--batches 1,4,16] [--out FILE]

Times the dflash node's proposal paths on one device: each slot ingests 5 new feature rows
(tau ~ 5) and drafts a 16-row block over a 160-token context, then the LM head over the 15
draft rows. B = 1 is the batch-1 CUDA graph (`DraftRunner.__call__`, what a lone request
replays); B > 1 is `DraftRunner.propose` (one graph per batch bucket, host metadata in one
copy) and the eager `draft_slots` forward. Times are per proposal (all B slots), host work
included: back-to-back calls between two CUDA events.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_dflash as gd  # noqa: E402
import gpu_target as gt  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="a CPU dry run at toy shapes")
    p.add_argument("--batches", default="1,4,16")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from draftflow.layers.kv_cache import KVCache
    from draftflow.plugins.dflash.config import DFlashConfig, kv_shape
    from draftflow.plugins.dflash.graphs import DraftRunner
    from draftflow.plugins.dflash.model import DFlashModel, draft_logits

    dcfg_d, vocab, dev = dict(gd.DRAFTER_8B), gd.DRAFTER_8B["vocab_size"], gt.DEV
    if a.tiny:
        dev = gt.DEV = "cpu"
        vocab = 512
        dcfg_d.update(vocab_size=vocab, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_target_layers=4,
                      dflash_config={"mask_token_id": 511, "target_layer_ids": [1, 2]})
    batches = [int(b) for b in a.batches.split(",")]
    dtype = torch.bfloat16
    cfg = DFlashConfig.from_hf_dict(dcfg_d, "dflash-b16-shape")
    h, w, ctx, new = cfg.hidden_size, cfg.block_size, 160, 5
    gen = torch.Generator(device=dev).manual_seed(1)
    model = DFlashModel(cfg, dtype=dtype, device=dev).eval()
    with torch.no_grad():
        for name, prm in sorted(model.named_parameters()):
            prm.fill_(1.0) if "norm" in name else prm.normal_(0.0, 0.02, generator=gen)
    embed = torch.randn(vocab, h, dtype=dtype, device=dev, generator=gen) * 0.02
    head = torch.randn(vocab, h, dtype=dtype, device=dev, generator=gen) * 0.02
    slots = torch.zeros(kv_shape(cfg, 1024 + w, max(batches)), dtype=dtype, device=dev)
    cache = KVCache.from_static(slots[:, :, :1])
    runner = DraftRunner(model, cache, embed, head, w, capture=dev == "cuda", slots=slots)
    rows = torch.randn(max(batches), new, cfg.num_taps * h, dtype=dtype, device=dev, generator=gen)
    start = ctx - new
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "context": ctx, "new_rows": new, "block": w, "per_batch": {}}
    with torch.inference_mode():
        for b in batches:
            out = {}
            if b == 1:
                cache.commit(ctx)

                def graph():
                    cache.crop(start)
                    return runner(rows[:1], start, 7)[1].argmax(-1)
            else:
                size = runner.batch_size(b)
                ins = [rows[i:i + 1] for i in range(b)] + [None] * (size - b)
                starts = [start] * b + [0] * (size - b)
                lasts = [ctx + w - 1] * size

                def graph():
                    return runner.propose(ins, starts, [7] * size, lasts, w)[1][:b].argmax(-1)

                def eager():
                    n = torch.full((b,), new, device=dev)
                    x = model.embed_block(torch.full((b, w), cfg.mask_token_id, device=dev), embed)
                    hidden = model.draft_slots(rows[:b], x, torch.full((b,), start, device=dev), n,
                                               torch.full((b,), ctx + w - 1, device=dev), slots[:, :, :b], ctx + w)
                    return draft_logits(hidden[:, 1:], head, cfg).argmax(-1)

                eager()
                out["eager_ms"] = round(gt.cuda_ms(eager, reps=10), 4)
            graph()
            out["graph_ms"] = round(gt.cuda_ms(graph, reps=20), 4)
            out["graph_ms_per_row"] = round(out["graph_ms"] / b, 4)
            res["per_batch"][b] = out
            print(f"B={b}: {out}", flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

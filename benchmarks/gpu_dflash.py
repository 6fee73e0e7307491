"""DFlash cycle costs at Qwen3-8B / Qwen3-8B-DFlash-b16 shapes (random bf16 weights), and a projection.

    python3 benchmarks/gpu_dflash.py [--tiny]      # --tiny: a CPU dry run at toy shapes

Measures, in one run on one device: copy bandwidth; one target verify window of 16 tokens
(the CUDA-graph path of the target node); one DFlash proposal pass (ingest C new feature rows,
then the 16-row block, then the LM head over the 15 draft rows; eager); their floors
(bytes read / bandwidth). Then it projects end-to-end speedup over target-only decoding at
the published acceptance lengths from those per-cycle costs. The projection is labelled
as one: it is arithmetic on measured costs, not a measured speedup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_target as gt  # noqa: E402  (shares the model builder and timers)

DRAFTER_8B = {"architectures": ["DFlashDraftModel"], "model_type": "qwen3", "vocab_size": 151936, "hidden_size": 4096,
              "intermediate_size": 12288, "num_hidden_layers": 5, "num_attention_heads": 32, "num_key_value_heads": 8,
              "head_dim": 128, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 40960,
              "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "block_size": 16,
              "num_target_layers": 36, "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}}
# Published tau of Qwen3-8B-DFlash-b16 at T=0 (z-lab README, batch 1): GSM8K, HumanEval, MATH500, MT-Bench, Alpaca.
PUBLISHED_TAU = {"GSM8K": 6.55, "HumanEval": 6.55, "MATH500": 7.87, "MT-Bench": 4.25, "Alpaca": 3.16}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()
    from draftflow.plugins.dflash.config import DFlashConfig, kv_shape
    from draftflow.plugins.dflash.model import DFlashModel, draft_logits
    from draftflow.plugins.target.config import TargetConfig
    from draftflow.plugins.target.graphs import GraphRunner
    from draftflow.plugins.target.kv_cache import KVCache, static_shape

    tcfg_d, dcfg_d = dict(gt.QWEN3_8B), dict(DRAFTER_8B)
    if a.tiny:
        gt.DEV = "cpu"
        tcfg_d = dict(gt.TINY, num_hidden_layers=4)
        dcfg_d.update(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, num_target_layers=4,
                      dflash_config={"mask_token_id": 511, "target_layer_ids": [1, 2]})
    dev, bf16 = gt.DEV, torch.bfloat16
    tcfg = TargetConfig.from_hf_dict(tcfg_d, "qwen3-8b-shape")
    dcfg = DFlashConfig.from_hf_dict(dcfg_d, "dflash-b16-shape")
    taps = tuple(dcfg.target_layer_ids)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__}
    res["copy_tb_s"] = bw = gt.copy_bandwidth() * 1e12

    target = gt.build_model(tcfg, seed=0)
    kv = torch.zeros(static_shape(tcfg, 1, 1024), dtype=bf16, device=dev)
    cache = KVCache.from_static(kv)
    cache.commit(160)
    runner = GraphRunner(target, cache, 16, taps) if dev == "cuda" else None
    drafter = DFlashModel(dcfg, dtype=bf16, device=dev).eval()
    gen = torch.Generator(device=dev).manual_seed(1)
    with torch.no_grad():
        for name, prm in sorted(drafter.named_parameters()):
            prm.fill_(1.0) if "norm" in name else prm.normal_(0.0, 0.02, generator=gen)
    dkv = torch.zeros(kv_shape(dcfg, 1024), dtype=bf16, device=dev)
    dcache = KVCache.from_static(dkv)
    head = target.head_weight()
    embed = target.embed_tokens.weight
    feats = torch.randn(1, 160, len(taps) * tcfg.hidden_size, dtype=bf16, device=dev)

    with torch.inference_mode():
        drafter.add_context(feats, 0, dcache)  # the prompt's context
        new_rows = torch.randn(1, 5, len(taps) * tcfg.hidden_size, dtype=bf16, device=dev)  # tau ~ 5 rows per cycle
        block_ids = torch.full((1, dcfg.block_size), dcfg.mask_token_id, device=dev)

        def propose():
            dcache.crop(160)
            drafter.add_context(new_rows, 160, dcache)
            hidden = drafter(torch.nn.functional.embedding(block_ids, embed), dcache)[:, 1:]
            return draft_logits(hidden, head, dcfg).argmax(-1)

        propose()
        res["draft_ms"] = gt.cuda_ms(propose, reps=20)
        drafts = torch.randint(0, 100, (1, dcfg.block_size - 1), device=dev)
        if runner is not None:
            runner(7, drafts, 160)
            runner(7, None, 160)
            gt.sync()
            res["verify16_ms"] = gt.cuda_ms(lambda: runner(7, drafts, 160), reps=50)
            res["step1_ms"] = gt.cuda_ms(lambda: runner(7, None, 160), reps=50)
        else:
            def eager(w):
                ids = torch.randint(0, 100, (1, w), device=dev)
                return target(ids, 160, cache, logit_rows=None, tap_layers=taps)
            res["verify16_ms"] = gt.cuda_ms(lambda: eager(16), reps=3)
            res["step1_ms"] = gt.cuda_ms(lambda: eager(1), reps=3)

    target_bytes = sum(p.numel() * p.element_size() for n, p in target.named_parameters() if "embed_tokens" not in n)
    drafter_bytes = sum(p.numel() * p.element_size() for p in drafter.parameters()) + head.numel() * head.element_size()
    res["target_floor_ms"] = target_bytes / bw * 1e3
    res["drafter_floor_ms"] = drafter_bytes / bw * 1e3
    res["cycle_ms"] = res["draft_ms"] + res["verify16_ms"]
    res["cycle_floor_ms"] = res["target_floor_ms"] + res["drafter_floor_ms"]
    print(f"DFlash cycle costs, {res['device']}, torch {res['torch']}, random bf16 weights, context 160")
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s; target floor {res['target_floor_ms']:.3f} ms; drafter floor "
          f"(weights + LM head) {res['drafter_floor_ms']:.3f} ms")
    rows = [("target 1-token step (graph)", res["step1_ms"], res["target_floor_ms"]),
            ("target 16-token verify (graph)", res["verify16_ms"], res["target_floor_ms"]),
            ("DFlash proposal pass (eager)", res["draft_ms"], res["drafter_floor_ms"]),
            ("whole cycle (draft + verify)", res["cycle_ms"], res["cycle_floor_ms"])]
    print(f"{'part':<34}{'ms':>9}{'floor ms':>10}{'x floor':>9}{'x 1-token step':>16}")
    for name, ms, floor in rows:
        print(f"{name:<34}{ms:>9.3f}{floor:>10.3f}{ms / floor:>9.2f}{ms / res['step1_ms']:>16.2f}")
    print("\nPROJECTION (not a measurement): speedup over target-only = tau * step1_ms / cycle_ms")
    res["projection"] = {}
    for name, tau in PUBLISHED_TAU.items():
        s = tau * res["step1_ms"] / res["cycle_ms"]
        res["projection"][name] = round(s, 3)
        print(f"  Qwen3-8B-DFlash-b16 on {name:<12} tau {tau:>5.2f} -> {s:.2f}x")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

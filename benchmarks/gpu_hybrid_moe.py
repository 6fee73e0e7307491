"""A Qwen3-Next-80B-A3B-shaped hybrid MoE target on one GPU (random bf16 weights): the expert cache decides what stays.

    python benchmarks/gpu_hybrid_moe.py --out DIR                    # H200: ~3 min
    python benchmarks/gpu_hybrid_moe.py --tiny --device cpu --out DIR  # CPU smoke run at toy shapes

Shapes (Qwen/Qwen3-Next-80B-A3B config.json): hidden 2048, 48 layers (every 4th gated full
attention, the other 36 Gated DeltaNet), attention 16 query / 2 KV heads of 256 (rotary on a
quarter of each head), linear attention 16 key / 32 value heads of 128, conv 4; every layer
sparse: 512 experts, top-10 renormalised, width 512, plus a shared expert of width 512;
vocabulary 151936, untied head. 4.7 GB of dense weights and 154.6 GB of routed experts.

It does not fit, and not only on the GPU (139 GiB): the host has 128 GiB, so a real
checkpoint's expert stacks could not be pinned either. Here one layer's random experts
(3.2 GB, pinned) stand for all 48 layers (bench_models.host_experts, `alias`): routing is
random, so values shared between layers change no timing, and every miss still reads its
own 6.3 MB expert from pinned host memory, every upload copies one. Everything else is as
for a checkpoint: the graph is planned with the default budget (90% of the device) and the
planner decides how many experts are resident (core/budget.py, what `draftflow check`
prints), with the drafter's bytes costed in experts.

Two graphs through the executor (spec_session.py: Executor.step cycles, CUDA graphs where
the expert cache is capturable, sampled at T = 1 so that routing keeps moving): target-only,
and target + a random DFlash drafter of the 30B-A3B-width shape (gpu_moe.DRAFTER: hidden
2048, 5 layers, 32 / 4 heads of 128, MLP 6144, block 16, taps [1, 12, 23, 34, 45]). Each
reports tokens/s, tokens per cycle, the cache's hit rate, misses and uploads per token
(misses are read by the kernels from host memory; uploads are promotions), host
synchronisations per cycle, whether the target's windows are CUDA graphs, and the plan's
bytes next to the measured peak. The floor: the bytes a 1-token step must read (dense
weights but the embedding, top-10 experts and the shared expert per layer, the recurrent
state) over the copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

QWEN3_NEXT_80B = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=151936,
                      hidden_size=2048, intermediate_size=5120, num_hidden_layers=48, full_attention_interval=4,
                      num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                      linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
                      linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
                      shared_expert_intermediate_size=512, norm_topk_prob=True, decoder_sparse_step=1,
                      mlp_only_layers=[], rms_norm_eps=1e-6, max_position_embeddings=262144,
                      tie_word_embeddings=False, attention_bias=False, hidden_act="silu",
                      rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, full_attention_interval=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=16,
            num_experts_per_tok=4, moe_intermediate_size=32, shared_expert_intermediate_size=32)


def floor(cfg, bw_tbps: float, context: int) -> dict:
    """Bytes a 1-token step must read and the tokens/s that allows at the measured copy bandwidth."""
    from draftflow.layers.config import kv_bytes_per_token, weight_bytes
    from draftflow.layers.moe import bytes_per_expert, total_experts

    per = bytes_per_expert(cfg, torch.bfloat16)
    dense = weight_bytes(cfg, torch.bfloat16) - per * total_experts(cfg) - cfg.vocab_size * cfg.hidden_size * 2
    state = cfg.num_linear_layers * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    parts = {"dense_weights": dense, "routed_experts": len(cfg.moe_layers) * cfg.num_experts_per_tok * per,
             "kv_read": context * kv_bytes_per_token(cfg, torch.bfloat16), "state_read_write": 2 * state}
    total = sum(parts.values())
    return {**parts, "total": total, "copy_TBps": bw_tbps, "floor_ms": total / (bw_tbps * 1e12) * 1e3,
            "floor_tok_s": bw_tbps * 1e12 / total, "bytes_per_expert": per, "experts": total_experts(cfg)}


def budget_for(tcfg_d: dict, dcfg_d: dict, device: str, context: int, fraction: float) -> int:
    """The vram_budget that leaves `fraction` of the experts resident in the target + drafter graph (gpu_moe's plans)."""
    from gpu_moe import plans, predict

    with_taps, _, drafter_m = plans(tcfg_d, dcfg_d, device, context, dcfg_d["block_size"] - 1)
    free = predict({"target": with_taps, "drafter": drafter_m}, None, context)
    used = sum(row.total - row.experts for row in free.rows)
    return used + round(fraction * free.experts.total) * free.experts.bytes_per_expert + free.experts.bytes_per_expert // 2


def run_graph(label: str, model, tcfg_d: dict, drafter, dcfg_d: dict | None, a, cuda_graphs: bool = True) -> dict:
    """Open one graph over the in-memory models, step it, close it; the plan next to what ran. If the graph fails
    under CUDA graphs it runs again eagerly, and the row keeps the failure (`graphs_error`)."""
    import spec_session as ss

    if a.device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    began = time.monotonic()
    try:
        session = ss.open_session(a.device, model, tcfg_d, drafter, dcfg_d, max_context=a.context,
                                  budget=a.vram_budget, dtype="bfloat16", cuda_graphs=cuda_graphs)
        try:
            row = {"run": label, "open_s": time.monotonic() - began, **ss.plan_row(session)}
            ex = session.executor
            row["measured_target_bytes"], row["executor_warnings"] = ex.measured.get(ex.target), list(ex.warnings)
            prompt = torch.randint(0, model.config.vocab_size, (a.prompt,), generator=torch.Generator().manual_seed(3))
            cycles = a.cycles if drafter is None else max(1, a.cycles // 2)
            row.update(ss.cycles(session, prompt.tolist(), cycles, rounds=2, warm=2 if a.tiny else 4,
                                 sync_cycles=2 if a.tiny else 4, temperature=1.0))
        finally:
            ss.close(session)
    except Exception as exc:  # noqa: BLE001 - the hybrid MoE capture is new on CUDA: keep an eager number
        if not cuda_graphs or a.device != "cuda":
            raise
        traceback.print_exc()
        failed = f"{type(exc).__name__}: {str(exc)[:400]}"
    else:
        row["run_s"] = time.monotonic() - began
        return row
    gc.collect()  # outside the except block: its traceback no longer holds the failed graph's buffers
    row = run_graph(label, model, tcfg_d, drafter, dcfg_d, a, cuda_graphs=False)
    row["graphs_error"] = failed
    return row


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json")
    p.add_argument("--tiny", action="store_true", help="toy shapes (a CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens (prefilled eagerly)")
    p.add_argument("--cycles", type=int, default=24, help="timed cycles per round (2 rounds; half with the drafter)")
    p.add_argument("--context", type=int, default=1024, help="max_context of the graphs (sizes the KV cache)")
    p.add_argument("--vram-budget", type=int, default=None, help="bytes (default: the planner's, 90%% of the device)")
    p.add_argument("--resident-fraction", type=float, default=None, help="instead of --vram-budget: the budget that "
                   "leaves this fraction of the experts resident with the drafter (tiny default: 0.5)")
    p.add_argument("--runs", default="target-only,dflash", help="which graphs to run, in order")
    a = p.parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    elif not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible; run on the GPU machine or pass --tiny --device cpu")
        return 2
    import bench_models
    import gpu_target as gt
    from gpu_moe import DRAFTER, TINY_DRAFTER

    from draftflow.layers.config import TargetConfig
    from draftflow.plugins.dflash.config import DFlashConfig

    gt.DEV = a.device
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    r = gt.Results(out / "results.json")
    tcfg_d = {**QWEN3_NEXT_80B, **(TINY if a.tiny else {})}
    dcfg_d = TINY_DRAFTER if a.tiny else DRAFTER
    cfg = TargetConfig.from_hf_dict(tcfg_d, "qwen3-next-80b-a3b shape")
    fraction = a.resident_fraction or (0.5 if a.tiny and a.vram_budget is None else None)
    if fraction:
        a.vram_budget = budget_for(tcfg_d, dcfg_d, a.device, a.context, fraction)
    began = time.monotonic()
    r.save("env", {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "torch": torch.__version__,
                   "layers": cfg.num_layers, "linear_layers": cfg.num_linear_layers, "moe_layers": len(cfg.moe_layers),
                   "experts_per_layer": cfg.num_experts, "top_k": cfg.num_experts_per_tok, "prompt": a.prompt,
                   "max_context": a.context, "vram_budget": a.vram_budget or "default (90% of the device)",
                   "host_experts": "one layer's stack aliased for every layer"})
    r.save("floor", floor(cfg, gt.copy_bandwidth(), a.prompt))
    model, gen = bench_models.target(cfg, a.device, seed=0)
    model.host_experts = bench_models.host_experts(cfg, a.device, gen, alias=True)
    gt.sync()
    if a.device == "cuda":
        torch.cuda.empty_cache()  # the per-layer draws' cached blocks: the expert slots want one contiguous block
    r.save("build_s", time.monotonic() - began)
    for run in a.runs.split(","):  # the drafter exists only for its own run: the target-only peak is the target's
        dr = bench_models.drafter(DFlashConfig.from_hf_dict(dcfg_d, "dflash shape"), a.device, 1) if run == "dflash" \
            else None
        gt.guarded(r, run, lambda run=run, dr=dr: run_graph(run, model, tcfg_d, dr, dcfg_d if dr else None, a))
        del dr
    r.save("elapsed_s", time.monotonic() - began)
    report(r)
    return 0


def report(r: dict) -> None:
    env, f = r["env"], r["floor"]
    print(f"\nQwen3-Next-80B-A3B shape, {env['device']}: {env['layers']} layers ({env['linear_layers']} Gated DeltaNet), "
          f"{f['experts']} experts of {f['bytes_per_expert'] / 2**20:.2f} MiB ({env['host_experts']}), top-"
          f"{env['top_k']}; built in {r['build_s']:.0f} s; copy {f['copy_TBps']:.2f} TB/s; 1-token floor "
          f"{f['floor_ms']:.3f} ms = {f['floor_tok_s']:.0f} tok/s")
    print(f"{'run':<14}{'graphs':>7}{'resident':>10}{'tok/s':>9}{'tok/cyc':>8}{'cycle ms':>10}{'spread':>8}"
          f"{'hit rate':>9}{'miss/tok':>9}{'up/tok':>8}{'syncs':>7}{'plan GiB':>9}{'peak GiB':>9}")
    for run in ("target-only", "dflash"):
        d = r.get(run)
        if not d:
            continue
        if "error" in d:
            print(f"{run:<14}{d['error']}")
            continue
        print(f"{run:<14}{'yes' if d['graphs'] else 'no':>7}{d['resident']:>10}{d['tokens_per_s']:>9.2f}"
              f"{d['tokens_per_cycle']:>8.2f}{d['cycle_ms']:>10.3f}{d['spread']:>8.1%}{d['hit_rate']:>9.3f}"
              f"{d['misses_per_token']:>9.1f}{d['uploads_per_token']:>8.2f}{d['host_syncs_per_cycle']:>7.1f}"
              f"{d['plan_gib']:>9.2f}{d.get('peak_gib', float('nan')):>9.2f}")
        costs = ", ".join(f"{n} {c} experts" for n, c in d.get("expert_costs", {}).items() if c)
        print(f"    {d['resident']} of {d['experts']} resident ({d['resident_reason']}{'; ' + costs if costs else ''}); "
              f"capturable windows: {d['capturable']}; opened in {d['open_s']:.0f} s, ran {d['run_s']:.0f} s"
              + (f"; warnings: {d['executor_warnings']}" if d["executor_warnings"] else ""))
        if "graphs_error" in d:
            print(f"    under CUDA graphs it failed ({d['graphs_error']}); the row above ran eagerly")
    print(f"elapsed {r['elapsed_s']:.0f} s")


if __name__ == "__main__":
    raise SystemExit(main())

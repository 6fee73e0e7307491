"""MoE expert cache at Qwen3-30B-A3B shape (random bf16 weights): tokens/s and hit rate against the resident fraction.

    python3 benchmarks/gpu_moe.py --out results.json             # H200: 48 layers x 128 experts, ~61 GB bf16
    python3 benchmarks/gpu_moe.py --fractions 0.25,1.0 --tokens 32 --alias-host-experts --no-kernel-sweep --out r.json
    python3 benchmarks/gpu_moe.py --tiny --device cpu            # a CPU smoke run at toy shapes

Nothing is written to disk: the non-expert weights are drawn on the device and the 6,144
routed experts straight into pinned host memory. For each resident fraction the VRAM
budget is set so that the planner (core/budget.py, the same code `draftflow check` runs)
leaves that fraction of the experts resident *with* the DFlash drafter in the graph; the
table shows the plan's resident counts (with and without the drafter) next to what ran,
and the plan's bytes next to the measured peak. Three runs per fraction: target-only at
the drafter graph's count (pinned: the comparable pair), target + DFlash at that count,
and target-only autosized (the drafter's bytes given back to experts).

The drafter has random weights too, so its acceptance is meaningless (near 0): the point
is its cost, in experts and in time per cycle, not a speedup. A random router routes
close to uniformly, so the hit rate is about the resident fraction (no locality to
exploit); real checkpoints route with skew and hit more. Finally it times one miss
served by upload (pinned host -> device) against the same expert computed on the CPU.

On CUDA the runs take the device path (docs/MOE.md: routing and fused experts on the device,
misses read from pinned host memory, promotions between windows) wherever the expert cache
enables it; each row also runs a short pass under torch's sync debug mode and reports the
host synchronisations per cycle (the loop's own verdict read is one), and the target-only
@spec run is repeated on the host-routed path (one sync per MoE layer and window) to compare.
The rows above are this script's own eager loop; the `session ...` rows run target-only and
target + DFlash through the executor at the same budget (spec_session.py: the planner's resident
count, CUDA graphs where the cache is capturable, the cycle's own sync included, sampled at
T = 1 so routing keeps moving), as `draftflow generate` would. `--alias-host-experts`: one
layer's host experts stand for all (bench_models.py; pins ~2 GiB instead of ~64 GiB).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_models  # noqa: E402
import spec_session  # noqa: E402
from bench_models import target as random_model  # noqa: E402,F401  (gpu_moe_fused builds with it too)
from spec_session import SyncCounter  # noqa: E402,F401  (gpu_moe_fused counts syncs with it)

QWEN3_30B_A3B = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=151936, hidden_size=2048,
                     intermediate_size=6144, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960,
                     tie_word_embeddings=False, attention_bias=False, hidden_act="silu", num_experts=128,
                     num_experts_per_tok=8, moe_intermediate_size=768, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[])
# A DFlash-b16-shaped drafter at the 30B-A3B width (assumed shape: 5 layers, taps spread over the 48 layers).
DRAFTER = dict(architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=151936, hidden_size=2048,
               intermediate_size=6144, num_hidden_layers=5, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
               rms_norm_eps=1e-6, rope_theta=1000000.0, max_position_embeddings=40960, tie_word_embeddings=False,
               attention_bias=False, hidden_act="silu", block_size=16, num_target_layers=48,
               dflash_config={"mask_token_id": 151669, "target_layer_ids": [1, 12, 23, 34, 45]})
TINY = {**QWEN3_30B_A3B, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 16, "num_experts_per_tok": 4,
        "moe_intermediate_size": 32}
TINY_DRAFTER = {**DRAFTER, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "block_size": 6,
                "num_target_layers": 4, "dflash_config": {"mask_token_id": 511, "target_layer_ids": [1, 2]}}
DTYPE = torch.bfloat16


def plans(tcfg_d: dict, dcfg_d: dict, device: str, context: int, num_draft: int):
    """Target and drafter manifests from config files alone (as `draftflow check` computes them)."""
    from draftflow.core.plan import Env
    from draftflow.plugins.dflash.plugin import manifest as dflash_manifest
    from draftflow.plugins.target.plugin import PARAMS
    from draftflow.plugins.target.plugin import manifest as target_manifest

    root = Path(tempfile.mkdtemp(prefix="gpu_moe_"))
    for name, d in (("target", tcfg_d), ("drafter", dcfg_d)):
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(d))
    env = Env(device, "bfloat16", num_draft, context)
    params = {p.name: p.default for p in PARAMS if p.name != "path"}
    taps = list(dcfg_d["dflash_config"]["target_layer_ids"])
    with_taps = target_manifest({**params, "path": str(root / "target"), "tap_layers": taps}, env)
    plain = target_manifest({**params, "path": str(root / "target"), "tap_layers": []}, env)
    return with_taps, plain, dflash_manifest({"path": str(root / "drafter"), "cuda_graphs": False}, env)


def predict(manifests: dict, budget: int | None, context: int):
    from draftflow.core.budget import plan_vram

    plan, problems = plan_vram(manifests, budget, context)
    if problems:
        raise SystemExit(f"plan problems: {problems}")
    return plan


def build(cfg, device: str, seed: int, alias: bool = False):
    """TargetModel with N(0, 0.02) weights on `device` and routed experts in (pinned) host memory (bench_models.py;
    `alias`: one layer's experts stand for every layer)."""
    model, gen = random_model(cfg, device, seed)
    model.host_experts = bench_models.host_experts(cfg, device, gen, alias)
    return model


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def decode(model, dcfg, drafter, dkv, device: str, prompt: int, tokens: int, seed: int, count_syncs: bool = False) -> dict:
    """Prefill `prompt` random tokens, then greedy-decode `tokens` (target-only when drafter is None); `count_syncs`:
    count the decode loop's host synchronisations (slower: not for timing)."""
    from draftflow.plugins.dflash.model import draft_logits
    from draftflow.layers.kv_cache import KVCache, static_shape

    cfg = model.config
    kv = KVCache.from_static(torch.zeros(static_shape(cfg, 1, prompt + tokens + 32), dtype=DTYPE, device=device))
    taps = tuple(dcfg.target_layer_ids) if drafter is not None else None
    ids = torch.randint(0, cfg.vocab_size, (1, prompt), generator=torch.Generator().manual_seed(seed)).to(device)
    # Teacher-forced anchors from a fixed random stream: greedy decoding of random weights falls into a
    # repetition loop whose routing never changes (every run would be all hits); this keeps routing varied.
    stream = torch.randint(0, cfg.vocab_size, (tokens + 64,), generator=torch.Generator().manual_seed(seed + 1)).tolist()
    embed, head = model.embed_tokens.weight, model.head_weight()
    cache = model.expert_cache
    with torch.inference_mode():
        _, feats = model(ids[:, :-1], 0, kv, logit_rows=0, tap_layers=taps)
        kv.commit(prompt - 1)
        if drafter is not None:
            dkv.crop(0)
            drafter.draft(feats, 0, None, dkv)
        anchor, pos, done, cycles, accepted = ids[:, -1:], prompt - 1, 0, 0, 0
        sync(device)
        before, start = cache.counters(), time.perf_counter()
        counter = SyncCounter() if count_syncs else None
        if counter is not None:
            counter.__enter__()
        while done < tokens:
            window = anchor
            if drafter is not None:
                block = torch.full((1, dcfg.block_size), dcfg.mask_token_id, dtype=torch.long, device=device)
                block[:, :1] = anchor
                hidden = drafter.draft(feats[:, :0], pos, drafter.embed_block(block, embed), dkv)[:, 1:]  # [1, K, H]
                window = torch.cat([anchor, draft_logits(hidden, head, dcfg).argmax(-1)], dim=1)  # [1, K+1]
            logits, feats = model(window, pos, kv, tap_layers=taps)  # [1, W, V]
            best = logits[0].argmax(-1)  # [W]
            run = (window[0, 1:] == best[:-1]).int().cumprod(0).sum()[None]  # accepted drafts
            host = torch.cat([run, best]).tolist()  # the cycle's one sync
            acc = host[0]
            kv.commit(pos + acc + 1)
            if drafter is not None:
                dkv.crop(pos)
                drafter.draft(feats[:, :acc + 1], pos, None, dkv)
            anchor = torch.tensor([[stream[done + acc + 1]]], device=device)
            pos, done, cycles, accepted = pos + acc + 1, done + acc + 1, cycles + 1, accepted + acc
        if counter is not None:
            counter.__exit__(None, None, None)
        sync(device)
        elapsed = time.perf_counter() - start
    after = cache.counters()
    hits, misses = (after[k] - before[k] for k in ("expert_hits", "expert_misses"))
    uploaded = after["expert_upload_bytes"] - before["expert_upload_bytes"]
    return {"tokens_per_s": done / elapsed, "tokens": done, "cycles": cycles, "accepted": accepted,
            "hit_rate": hits / max(hits + misses, 1), "misses_per_token": misses / done,
            "uploads_per_token": uploaded / cache.bytes_per_expert / done, "upload_gb": uploaded / 1e9,
            "device_path": cache.device_path,
            **({"host_syncs_per_cycle": counter.count / max(cycles, 1)} if counter is not None else {})}


def miss_costs(model, device: str) -> dict:
    """One expert served by upload vs computed on the CPU (activations both ways), in ms."""
    import torch.nn.functional as F

    cache, host = model.expert_cache, model.host_experts
    res = {}
    reps = 20

    def timed(fn) -> float:
        sync(device)
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        sync(device)
        return (time.perf_counter() - t) * 1e3 / reps

    res["upload_ms"] = timed(lambda: cache.upload(0, 1, 0))
    res["upload_gb_s"] = cache.bytes_per_expert / res["upload_ms"] / 1e6
    i = model.config.moe_intermediate_size
    for t in (1, 16):
        x = torch.randn(t, model.config.hidden_size, dtype=DTYPE, device=device)

        def cpu_expert():
            xc = x.to("cpu")
            g, u = F.linear(xc, host.gate_up[0, 1]).split(i, dim=-1)
            return F.linear(F.silu(g) * u, host.down[0, 1]).to(device)

        res[f"cpu_compute_{t}tok_ms"] = timed(cpu_expert)
    if cache.device_path and not cache.all_resident:  # the device path reads a miss from pinned host memory
        from draftflow.layers.moe_kernels import fused_experts

        layer, k = cache.layers[0], model.config.num_experts_per_tok
        x = torch.randn(1, model.config.hidden_size, dtype=DTYPE, device=device)
        ids, weights = torch.arange(k, device=device)[None], torch.full((1, k), 1 / k, dtype=DTYPE, device=device)
        slots = slice(layer.start, layer.start + layer.size)
        args = (cache.slot_gate_up[slots], cache.slot_down[slots])
        host_stacks, tally = (host.gate_up[0], host.down[0]), torch.zeros_like(cache.tally[0])
        resident = torch.arange(cache.num_experts, device=device).clamp(max=layer.size)  # experts < size: a slot
        missing = torch.full_like(resident, layer.size)  # every expert read from the host
        ms = {name: timed(lambda key=key: fused_experts(x, ids, weights, *args, key, tally, host_stacks))
              for name, key in (("resident", resident), ("from_host", missing))}
        res["zero_copy_miss_ms"] = (ms["from_host"] - ms["resident"]) / k
        res["zero_copy_gb_s"] = cache.bytes_per_expert / res["zero_copy_miss_ms"] / 1e6
    return res


def session_rows(model, drafter, tcfg_d: dict, dcfg_d: dict, dev: str, budget: int, a) -> list[tuple[str, dict]]:
    """Target-only and target + DFlash as `draftflow generate` runs them (spec_session.py: the planner sizes the
    cache from `budget`, CUDA graphs where the cache is capturable), sampled at T = 1 so routing keeps moving."""
    rows = []
    for label, dr in (("session target-only", None), ("session dflash (random)", drafter)):
        if dev == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            session = spec_session.open_session(dev, model, tcfg_d, dr, dcfg_d if dr is not None else None,
                                                max_context=a.context, budget=budget)
            try:
                prompt = torch.randint(0, model.config.vocab_size, (a.prompt,), generator=torch.Generator().manual_seed(4))
                row = spec_session.plan_row(session)
                row.update(spec_session.cycles(session, prompt.tolist(), max(1, a.tokens // 2), rounds=2,
                                               warm=2 if a.tiny else 4, sync_cycles=2 if a.tiny else 4, temperature=1.0))
            finally:
                spec_session.close(session)
        except Exception as exc:  # noqa: BLE001 - one failed graph must not lose the other fractions' rows
            traceback.print_exc()
            print(f"{label}: {type(exc).__name__}: {exc}"[:400], flush=True)
            rows.append((label + ", failed", {"error": f"{type(exc).__name__}: {str(exc)[:400]}"}))
            continue
        rows.append((label + (", graphs" if row["graphs"] else ", eager"), row))
    return rows


def print_row(frac, r_spec, r_only, cost, label, row) -> None:
    print(f"{frac:>5.2f} {r_spec:>9} {r_only:>11} {cost:>7}  {label:<30}{row['resident']:>9}{row['tokens_per_s']:>9.2f}"
          f"{row['hit_rate']:>9.3f}{row['misses_per_token']:>9.1f}{row['uploads_per_token']:>8.1f}"
          f"{row['host_syncs_per_cycle']:>7.1f}{row['plan_gib']:>9.2f}{row.get('peak_gib', float('nan')):>9.2f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="toy shapes (a smoke test; use with --device cpu)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--fractions", default="1.0,0.5,0.25,0.1", help="resident fractions of the experts to sweep")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--tokens", type=int, default=64, help="tokens decoded per run")
    p.add_argument("--context", type=int, default=4096, help="max_context of the planned graph (sizes the KV cache)")
    p.add_argument("--alias-host-experts", action="store_true", help="one layer's host experts stand for every layer "
                   "(bench_models.py: pins 3 GB instead of 58; routing is random, timings are unchanged)")
    p.add_argument("--no-kernel-sweep", action="store_true", help="skip the full-residency kernel comparison")
    p.add_argument("--no-session", action="store_true", help="skip the executor (Session, CUDA graphs) rows")
    p.add_argument("--out", default=None, help="results JSON file (written after every row)")
    a = p.parse_args()
    from draftflow.plugins.dflash.config import DFlashConfig, kv_shape
    from draftflow.layers.config import TargetConfig
    from draftflow.layers.kv_cache import KVCache

    tcfg_d, dcfg_d = (TINY, TINY_DRAFTER) if a.tiny else (QWEN3_30B_A3B, DRAFTER)
    cfg, dcfg = TargetConfig.from_hf_dict(tcfg_d, "qwen3-30b-a3b-shape"), DFlashConfig.from_hf_dict(dcfg_d, "dflash-shape")
    dev = a.device
    with_taps, plain, drafter_m = plans(tcfg_d, dcfg_d, dev, a.context, dcfg.block_size - 1)
    free = predict({"target": with_taps, "drafter": drafter_m}, None, a.context)
    per, total = free.experts.bytes_per_expert, free.experts.total
    used = sum(r.total - r.experts for r in free.rows)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "torch": torch.__version__,
           "experts": total, "bytes_per_expert": per, "host_experts_aliased": a.alias_host_experts, "runs": []}
    began = time.monotonic()

    def save() -> None:
        res["elapsed_s"] = time.monotonic() - began
        if a.out:
            Path(a.out).write_text(json.dumps(res, indent=1))

    model = build(cfg, dev, seed=0, alias=a.alias_host_experts)
    drafter = bench_models.drafter(dcfg, dev, seed=1)
    dkv = KVCache.from_static(torch.zeros(kv_shape(dcfg, a.prompt + a.tokens + 64), dtype=DTYPE, device=dev))
    sync(dev)
    res["build_s"] = time.monotonic() - began
    print(f"MoE expert cache, {res['device']}, torch {res['torch']}: {total} experts of {per / 2**20:.2f} MiB, "
          f"{len(cfg.moe_layers)} MoE layers, top-{cfg.num_experts_per_tok}; random bf16 weights (built in "
          f"{res['build_s']:.1f} s{', host experts aliased' if a.alias_host_experts else ''}); prompt {a.prompt}, "
          f"{a.tokens} tokens per run", flush=True)
    head = f"{'frac':>5} {'plan spec':>9} {'plan t-only':>11} {'drafter':>7}  {'run':<30}{'resident':>9}{'tok/s':>9}" \
           f"{'hit rate':>9}{'miss/tok':>9}{'up/tok':>8}{'syncs':>7}{'plan GiB':>9}{'peak GiB':>9}"
    # Full residency: the device path, and the host-routed path's two kernels (one grouped GEMM per layer and
    # window, or one GEMM per routed expert; the faster one serves the host-routed rows below).
    kernels, grouped = {}, None
    for label, device_path, grouped in () if a.no_kernel_sweep else (
            ("device path", True, None), ("host-routed grouped", False, True), ("host-routed per-expert", False, False)):
        model.set_expert_cache(None, grouped).device_path = device_path and (dev == "cuda")
        decode(model, dcfg, None, dkv, dev, a.prompt, 4, seed=1)
        kernels[label] = decode(model, dcfg, None, dkv, dev, a.prompt, 16, seed=1)["tokens_per_s"]
    if kernels:
        grouped = kernels["host-routed grouped"] >= kernels["host-routed per-expert"]
        print("full residency, tokens/s: " + ", ".join(f"{k} {v:.2f}" for k, v in kernels.items()))
    res["kernel_tok_s"], res["grouped"] = kernels, grouped
    save()
    print(head)
    for frac in (float(f) for f in a.fractions.split(",")):
        # Never below top-k per MoE layer (the planner would reject it): tiny shapes clamp 0.1 up.
        budget = used + max(round(frac * total), len(cfg.moe_layers) * cfg.num_experts_per_tok) * per + per // 2
        spec_plan = predict({"target": with_taps, "drafter": drafter_m}, budget, a.context)
        only_plan = predict({"target": plain}, budget, a.context)
        r_spec, r_only = spec_plan.experts.resident, only_plan.experts.resident
        cost = dict(spec_plan.experts.costs).get("drafter", 0)
        common = {"fraction": frac, "plan_resident_spec": r_spec, "plan_resident_target_only": r_only,
                  "drafter_cost_experts": cost, "budget": budget}
        runs = [("target-only @spec", r_spec, None, spec_plan, True), ("dflash (random)", r_spec, drafter, spec_plan, True)]
        if r_only != r_spec:
            runs.append(("target-only autosized", r_only, None, only_plan, True))
        if dev == "cuda":
            runs.append(("t-only @spec host-routed", r_spec, None, spec_plan, False))
        for label, resident, dr, plan, device_path in runs:
            cache = model.set_expert_cache(resident, grouped)
            cache.device_path = cache.device_path and device_path
            decode(model, dcfg, dr, dkv, dev, a.prompt, 4, seed=1)  # warm-up: kernels, allocator, first uploads
            syncs = decode(model, dcfg, dr, dkv, dev, a.prompt, 6, seed=3, count_syncs=True)["host_syncs_per_cycle"]
            if dev == "cuda":
                torch.cuda.reset_peak_memory_stats()
            out = decode(model, dcfg, dr, dkv, dev, a.prompt, a.tokens, seed=2)
            peak = torch.cuda.max_memory_allocated() / 2**30 if dev == "cuda" else float("nan")
            row = {**common, "run": label, "resident": resident, "plan_gib": plan.total / 2**30, "peak_gib": peak,
                   "host_syncs_per_cycle": syncs, **out}
            res["runs"].append(row)
            print_row(frac, r_spec, r_only, cost, label, row)
            save()
        for label, row in [] if a.no_session else session_rows(model, drafter, tcfg_d, dcfg_d, dev, budget, a):
            res["runs"].append({**common, "run": label, **row})
            if "error" not in row:
                print_row(frac, r_spec, r_only, cost, label, row)
            save()
    model.set_expert_cache(max(total // 4, len(cfg.moe_layers) * cfg.num_experts_per_tok), grouped)  # a device-path cache
    res["miss"] = miss_costs(model, dev)
    m = res["miss"]
    print(f"one miss: upload {m['upload_ms']:.3f} ms ({m['upload_gb_s']:.1f} GB/s) vs CPU compute "
          f"{m['cpu_compute_1tok_ms']:.3f} ms (1 token) / {m['cpu_compute_16tok_ms']:.3f} ms (16 tokens)"
          + (f" vs read by the kernel from host memory {m['zero_copy_miss_ms']:.3f} ms ({m['zero_copy_gb_s']:.1f} GB/s)"
             if "zero_copy_miss_ms" in m else ""))
    save()
    print(f"elapsed {res['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()

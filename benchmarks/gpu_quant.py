"""GGUF weights kept quantized on one GPU at Qwen3-8B shapes: decode and verify against the weight-read floor.

    python benchmarks/gpu_quant.py --out DIR        # everything; DIR/results.json and a table (~5 min on an H200)
    python benchmarks/gpu_quant.py --quick --out DIR  # < 4 min: projections old vs repacked vs cuBLAS, QUICK decode
    python benchmarks/gpu_quant.py --tiny --out DIR # CPU smoke test through Triton's interpreter (measures nothing)

Configurations (issue 20): BF16 (the dequantized path: cuBLAS), Q8_0, Q6_K and Q4_K_M for every
attention and MLP projection, each with the file-layout kernels (quant_gemv) or, with a `+r` suffix,
repacked at load (quant_repack, quant_gemv_repacked: the same random bytes when `+r` follows its
base); Q4_K_M is Q4_K with Q6_K for attn_v and ffn_down in the layers
llama.cpp's `use_more_bits` picks (the first and last eighth and every third between: 18 of 36).
The embedding and LM head stay bf16 in all of them (the loader keeps them dequantized).

Weights are drawn on the GPU, not read from a GGUF file: bf16 N(0, 0.02) as benchmarks/gpu_target.py
draws them, then each projection is replaced by a `QuantLinear` of random bytes in its type's block
layout with small finite fp16 scales (values are sane, not a trained model's). Per configuration:
the bytes one decode step reads (every weight but the embedding table), the floor = those bytes
over the device copy bandwidth measured in this run (gpu_target.copy_bandwidth; quantized projections
counted at their GGUF file bytes, the issue's floor; `read_floor_ms` counts the repacked bytes), the 1-token step
and the 16-token verify window as CUDA-graph replays of the target's GraphRunner (the node's
default kernels), and a 512-token prefill. A per-projection table puts both GEMVs next to cuBLAS's
bf16 product at the four fused projection shapes (GB/s of the bytes each reads, and the repacked one's
also over the file's bytes; each a CUDA graph of 20 calls, so the device time, not Python's launch
overhead), with small sweeps of the tiles (old: BLOCK_N, warps; repacked at one row: BLOCK_N, units,
warps) for the lead to pick defaults from (benchmarks/quant_projections.py).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_target as gt  # noqa: E402  (timers, copy bandwidth, the random bf16 model, Results)
from quant_projections import best_repacked, best_tiles, projections, random_blocks  # noqa: E402

CONFIGS = ("bf16", "q8_0", "q8_0+r", "q6_k", "q6_k+r", "q4_k_m", "q4_k_m+r")  # each replaces the previous one's
QUICK = "bf16,q8_0+r,q6_k+r,q4_k_m,q4_k_m+r"  # projections (`+r` after its base: the same bytes, repacked)
TINY = {**gt.QWEN3_8B, "vocab_size": 512, "hidden_size": 256, "intermediate_size": 256, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 64}  # rows of 256: one K-quant block
PROJECTIONS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
               "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


def use_more_bits(layer: int, layers: int) -> bool:
    """The layers whose attn_v / ffn_down llama.cpp's Q4_K_M stores as Q6_K."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def qtype_of(config: str, layer: int, layers: int, name: str) -> str:
    config = config.partition("+")[0]
    if config == "q4_k_m":
        more = name in ("self_attn.v_proj", "mlp.down_proj") and use_more_bits(layer, layers)
        return "Q6_K" if more else "Q4_K"
    return config.upper()


def quantize_model(model, config: str, seed: int) -> None:
    """Replace every attention and MLP projection by a QuantLinear of random bytes in the configuration's types."""
    from draftflow.layers.quant_linear import QuantLinear

    gen = torch.Generator(device=gt.DEV).manual_seed(seed)
    layers = len(model.layers)
    for i in range(layers):
        for name in PROJECTIONS:
            owner, attr = model.get_submodule(f"layers.{i}.{name.split('.')[0]}"), name.split(".")[1]
            old = getattr(owner, attr)  # nn.Linear, or the previous configuration's QuantLinear
            lin = QuantLinear(qtype_of(config, i, layers, name), old.in_features, old.out_features, device="meta")
            lin.blocks = random_blocks(lin.qtype, lin.out_features, lin.in_features, gen)
            setattr(owner, attr, lin)
    if gt.DEV == "cuda":
        torch.cuda.empty_cache()


def read_bytes(model, file_layout: bool = False) -> int:
    """Bytes one decode step reads: every tensor but the embedding table (a row lookup) and the RoPE table;
    `file_layout`: repacked projections counted at their GGUF file bytes (the floor the issue measures against)."""
    from draftflow.layers.quant_linear import QuantLinear, row_bytes

    total = sum(t.nbytes for name, t in model.state_dict().items() if name not in ("embed_tokens.weight", "inv_freq"))
    if file_layout:
        for lin in (m for m in model.modules() if isinstance(m, QuantLinear) and m.packed is not None):
            total += lin.out_features * row_bytes(lin.qtype, lin.in_features) - lin.packed.nbytes
    return total


def measure(model, cfg, bw: float, a) -> dict:
    """Decode and verify as graph replays, a prefill, and the floor, for the model as it is now."""
    from draftflow.layers.kv_cache import KVCache, static_shape
    from draftflow.plugins.target.graphs import GraphRunner

    start, prefill = (160, 512) if not a.tiny else (8, 64)
    kv = KVCache.from_static(torch.zeros(static_shape(cfg, 1, 1024 if not a.tiny else 96), dtype=torch.bfloat16,
                                         device=gt.DEV))
    prompt = torch.randint(0, 100, (1, prefill), device=gt.DEV)
    with torch.inference_mode():
        model(prompt[:, :start], 0, kv)
        kv.commit(start)
        prefill_ms = None if a.quick else gt.cuda_ms(lambda: model(prompt, 0, kv, logit_rows=1), 1, a.rounds)
    runner = GraphRunner(model, kv, 16, capture=gt.DEV == "cuda", compiled=gt.DEV == "cuda")
    w1 = time_window(runner, start, 1, a)
    w16 = time_window(runner, start, 16, a)
    nbytes, file_bytes = read_bytes(model), read_bytes(model, file_layout=True)
    floor_ms, read_floor_ms = file_bytes / (bw * 1e12) * 1e3, nbytes / (bw * 1e12) * 1e3
    return {"weight_bytes_read": nbytes, "file_bytes": file_bytes, "floor_ms": floor_ms, "read_floor_ms": read_floor_ms,
            "w1_ms": w1, "tok_s": 1e3 / w1, "pct_of_floor": 100 * floor_ms / w1,
            "pct_of_read_floor": 100 * read_floor_ms / w1,
            "w16_ms": w16, "w16_over_w1": w16 / w1, "prefill_512_ms": prefill_ms}


def dflash_cycle(model, tcfg_d: dict, a) -> dict:
    """The DFlash cycle through the executor (spec_session.py: target with taps + a random drafter of the
    Qwen3-8B-DFlash-b16 shape + verifier, CUDA graphs, K = 15) on the target as it is now (bf16 or kept quantized).
    Random drafts are rejected, so every cycle is a whole cycle's work for one token."""
    import bench_models
    import spec_session as ss
    from gpu_dflash import DRAFTER_8B

    from draftflow.plugins.dflash.config import DFlashConfig

    dcfg_d = dict(DRAFTER_8B)
    if a.tiny:
        dcfg_d.update(vocab_size=TINY["vocab_size"], hidden_size=TINY["hidden_size"], intermediate_size=96,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      num_target_layers=TINY["num_hidden_layers"],
                      dflash_config={"mask_token_id": TINY["vocab_size"] - 1, "target_layer_ids": [0, 1]})
    drafter = bench_models.drafter(DFlashConfig.from_hf_dict(dcfg_d, "dflash-b16-shape"), gt.DEV, 1)
    prompt = torch.randint(0, 500, (32 if a.tiny else 256,), generator=torch.Generator().manual_seed(5)).tolist()
    session = ss.open_session(gt.DEV, model, tcfg_d, drafter, dcfg_d, max_context=1024 if not a.tiny else 96)
    try:
        return ss.cycles(session, prompt, 2 if a.tiny else 20, rounds=1 if a.tiny else 3, warm=1 if a.tiny else 3,
                         sync_cycles=1 if a.tiny else 2)
    finally:
        ss.close(session)


def time_window(runner, start: int, w: int, a) -> float:
    if not a.tiny:
        return gt.time_runner(runner, start, w, reps=a.reps)
    drafts = torch.randint(0, 100, (1, w - 1)) if w > 1 else None
    with torch.inference_mode():
        return gt.cuda_ms(lambda: runner(7, drafts, start), 1, a.rounds)


def check_product(model, config: str) -> float:
    """Relative max error of layer 0's gate GEMV (1 row, the layer's layout) against dequantize + matmul in float32."""
    lin = model.layers[0].mlp.gate_proj
    x = torch.randn(1, lin.in_features, device=gt.DEV, dtype=torch.bfloat16)
    got = lin.product(x, lin.data, None).float()
    want = x.float() @ lin.dequantized(torch.float32).T
    return float((got - want).abs().max() / want.abs().max())


def table(res: dict) -> str:
    lines = [f"copy bandwidth {res['copy_TBps']:.2f} TB/s; {res.get('device', '')}", "",
             f"{'config':<10} {'GB read':>8} {'floor ms':>9} {'1-tok ms':>9} {'tok/s':>7} {'% floor':>8} {'% read':>7} "
             f"{'16-tok ms':>10} {'16/1':>6} {'prefill512 ms':>14} {'GEMV err':>9}"]
    for name, r in res.get("configs", {}).items():
        if "error" in r:
            lines.append(f"{name:<10} error: {r['error']}")
            continue
        err = r.get("gemv_rel_err")
        if "tiles" in r or "tile" in r:
            lines.append(f"{name} with the sweep's best GEMV tile(s) {r.get('tiles') or r.get('tile')}:")
        lines.append(f"{name[:10]:<10} {r['weight_bytes_read'] / 1e9:>8.2f} {r['floor_ms']:>9.3f} {r['w1_ms']:>9.3f} "
                     f"{r['tok_s']:>7.1f} {r['pct_of_floor']:>7.1f}% {r['pct_of_read_floor']:>6.1f}% "
                     f"{r['w16_ms']:>10.3f} "
                     f"{r['w16_over_w1']:>6.2f} "
                     f"{'-' if r['prefill_512_ms'] is None else format(r['prefill_512_ms'], '.2f'):>14} "
                     f"{'-' if err is None else f'{err:.1e}':>9}")
    for name, r in res.get("configs", {}).items():
        d = r.get("dflash", {})
        if "cycle_ms" in d:
            lines.append(f"{name}: DFlash cycle (b16-shaped random drafter, K = 15, executor, graphs) {d['cycle_ms']:.3f} ms "
                         f"= {d['cycle_in_target_steps']:.2f} target 1-token steps, {d['host_syncs_per_cycle']:.1f} host "
                         "syncs/cycle")
        elif "error" in d:
            lines.append(f"{name}: DFlash cycle error: {d['error']}")
    bf16 = res.get("configs", {}).get("bf16", {}).get("tok_s")
    if bf16:
        lines.append("decode speed-up over bf16: " + ", ".join(
            f"{n} {r['tok_s'] / bf16:.2f}x" for n, r in res["configs"].items() if "tok_s" in r and n != "bf16"))
    for shape, row in res.get("projections", {}).items():
        if "error" in row:
            lines.append(f"{shape}: error: {row['error']}")
            continue
        lines.append("")
        lines.append(f"{shape}:")
        lines += [f"  {k:<32} {v['us']:>9.1f} us {v['GBps']:>8.0f} GB/s"
                  + (f" ({v['file_GBps']:.0f} of file bytes, {v['speedup']:.2f}x old)" if "file_GBps" in v else "")
                  + (f"  (BLOCK_N {v['block_n']}" + (f", {v['units']} units" if "units" in v else "")
                     + f", {v['warps']} warps, split {v.get('split')})" if v.get("block_n") else "")
                  for k, v in row.items()]
    return "\n".join(lines)


def run(a) -> dict:
    from draftflow.core.tracing import configure_logging
    from draftflow.layers.config import TargetConfig

    from draftflow.layers import quant_gemv as qk

    gt.DEV = "cpu" if a.tiny else "cuda"
    configure_logging(verbose=False)
    t0 = a.t0 = time.monotonic()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    res = gt.Results(out / "results.json")
    res.save("device", torch.cuda.get_device_name() if gt.DEV == "cuda" else "cpu (interpreter dry run)")
    from draftflow.layers import quant_gemv_repacked, quant_gemv_rows

    res.save("stages", {"rows kernel": quant_gemv_rows.STAGES, "split-K kernel": quant_gemv_repacked.STAGES})
    res.save("int8_terms", quant_gemv_rows.INT8_TERMS)
    bw = gt.copy_bandwidth()
    res.save("copy_TBps", bw)
    cfg = TargetConfig.from_hf_dict(TINY if a.tiny else gt.QWEN3_8B, "qwen3-8b-shapes")
    totals: dict = {}
    if a.projections:
        gt.guarded(res, "projections", lambda: projections(cfg, a, totals))  # first: its sweep stops at --sweep-until-s
    model = gt.build_model(cfg, seed=0)
    results: dict = {}
    last = "bf16"
    for config in a.configs.split(","):
        base, _, how = config.partition("+")
        if base != "bf16" and not (how and base == last):  # `q4_k_m+r` after `q4_k_m`: the same bytes, repacked
            gt.guarded(None, f"quantize {config}", lambda config=config: quantize_model(model, config, seed=1))
        if how:
            from draftflow.layers.quant_linear import repack_all

            gt.guarded(None, f"repack {config}", lambda: repack_all(model))
        last = base
        results[config] = gt.guarded(None, config, lambda: measure(model, cfg, bw, a))
        if config in a.dflash_configs.split(",") and "error" not in results[config]:
            row = gt.guarded(None, f"dflash {config}", lambda: dflash_cycle(model, TINY if a.tiny else gt.QWEN3_8B, a))
            if "cycle_ms" in row:
                row["cycle_in_target_steps"] = row["cycle_ms"] / results[config]["w1_ms"]
            results[config]["dflash"] = row
        if config != "bf16" and "error" not in results[config]:
            results[config]["gemv_rel_err"] = gt.guarded(None, "check", lambda config=config: check_product(model, config))
        res.save("configs", results)
        if config == "bf16" and a.gemv_all and not a.tiny and "error" not in results[config]:
            from draftflow.layers import gemv

            gemv.PREFER_ALL = True  # every one-row bf16 product through gemv.linear (PDL-chained), not only o_proj
            results["bf16 gemv-all"] = gt.guarded(None, "gemv-all", lambda: measure(model, cfg, bw, a))
            gemv.PREFER_ALL = False
            res.save("configs", results)
    tiles = best_tiles(totals)
    # the last configuration again with the sweep's tiles (the file-layout GEMV's)
    if tiles != qk.GEMV_TILES and config != "bf16" and "+" not in config and not a.tiny:
        qk.GEMV_TILES = tiles  # a benchmark-only override: the kernels read it per call
        results[f"{config} tuned"] = gt.guarded(None, "tuned", lambda: measure(model, cfg, bw, a))
        results[f"{config} tuned"]["tiles"] = {("tl.dot" if k else "FMA"): v for k, v in tiles.items()}
        res.save("configs", results)
    best = best_repacked(res.get("projections", {}))
    # the last configuration again with the best one-row repacked tile, if the sweep found another (time allowing)
    if best and "+" in config and not a.tiny and time.monotonic() - t0 < a.tuned_until_s:
        from draftflow.layers import quant_gemv_repacked as rg

        rg.TILES["fma"], rg.PREFETCH = best[:3], best[3]  # benchmark-only overrides: read per call
        results[f"{config} tuned"] = gt.guarded(None, "tuned", lambda: measure(model, cfg, bw, a))
        results[f"{config} tuned"]["tile"] = {"block_n": best[0], "units": best[1], "warps": best[2],
                                              "prefetch": best[3]}
        res.save("configs", results)
    res.save("elapsed_s", time.monotonic() - t0)
    return res


def stages_pair(text: str) -> tuple[int, int]:
    """--stages ROWS,WINDOW: two positive integers."""
    parts = text.split(",")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise argparse.ArgumentTypeError(f"{text!r}: give two positive integers, e.g. 1,1")
    return int(parts[0]), int(parts[1])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="results/gpu_quant", help="folder for results.json")
    p.add_argument("--tiny", action="store_true", help="a 2-layer 256-wide model on the CPU through Triton's interpreter")
    p.add_argument("--configs", default=",".join(CONFIGS), help="comma-separated, in order (bf16 first: the others "
                   "replace its projections): " + ", ".join(CONFIGS))
    p.add_argument("--reps", type=int, default=50, help="graph replays per timing round")
    p.add_argument("--rounds", type=int, default=5, help="timing rounds (the median is kept)")
    p.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the file-layout GEMV's tile sweep")
    p.add_argument("--no-repacked-sweep", dest="sweep_repacked", action="store_false",
                   help="skip the repacked GEMV's one-row tile sweep (Q4_K)")
    p.add_argument("--sweep-until-s", type=float, default=75, help="skip the sweep's remaining shapes past this time")
    p.add_argument("--tuned-until-s", type=float, default=190, help="skip the run with the best repacked tile past "
                   "this time")
    p.add_argument("--rows-sweep", action="store_true", help="also the one-row rows kernel (layers/quant_gemv_rows.py) "
                   "at each (rows a step, register cap) of quant_projections.ROWS_SWEEP")
    p.add_argument("--stages-sweep", action="store_true", help="also the rows kernel and the 16-row repacked GEMV "
                   "with loop steps in flight (quant_projections.STAGES_SWEEP, WINDOW_STAGES)")
    p.add_argument("--stages", type=stages_pair, help="ROWS,WINDOW: loop steps in flight of the one-row rows kernel and of the "
                   "repacked split-K kernel (windows) for this run's decode (defaults: the modules' STAGES)")
    p.add_argument("--int8-sweep", action="store_true", help="also the rows kernel at each (rows a step, int8 "
                   "terms) of quant_projections.INT8_SWEEP")
    p.add_argument("--int8", type=int, choices=(0, 1, 2), help="the one-row products' int8 activation terms for the "
                   "whole run (quant_gemv_rows.INT8_TERMS; 0: float multiply-adds)")
    p.add_argument("--gemv-all", action="store_true", help="also the bf16 step with every one-row product through "
                   "layers/gemv.py's kernel (q/k/v, gate/up, down too), chained by PDL")
    p.add_argument("--no-projections", dest="projections", action="store_false",
                   help="skip the per-projection GEMV table (decode rows only)")
    p.add_argument("--dflash-configs", default="bf16,q4_k_m+r", help="configs after which the DFlash cycle runs "
                   "through the executor (its cost in target steps at that quantization); '' for none")
    p.add_argument("--quick", action="store_true", help="< 4 min on an H200: the projection table (old, repacked with "
                   f"its one-row sweep, cuBLAS), then {QUICK} decode (1- and 16-token windows; no prefill)")
    a = p.parse_args()
    if a.quick:
        a.sweep, a.rounds, a.reps = False, 3, 30
        if a.configs == ",".join(CONFIGS):
            a.configs = QUICK
    if a.tiny:
        a.rounds = 1
    if a.stages:
        from draftflow.layers import quant_gemv_repacked, quant_gemv_rows

        rows_stages, window_stages = a.stages
        quant_gemv_rows.STAGES = dict.fromkeys(quant_gemv_rows.STAGES, rows_stages)
        quant_gemv_repacked.STAGES = window_stages
    if a.int8 is not None:
        from draftflow.layers import quant_gemv_rows

        quant_gemv_rows.INT8_TERMS = a.int8
    res = run(a)
    print(table(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A ~27B dense hybrid target (3 Gated DeltaNet : 1 gated attention, bf16): step, window, rollback, DFlash cycle, floors.

    python benchmarks/gpu_hybrid_verify.py --out DIR                          # H200, 64 layers, ~2 min (est.)
    python benchmarks/gpu_hybrid_verify.py --tiny --device cpu --out DIR      # CPU smoke run (Triton interpreter)

Shapes of the Qwen3.6-27B class (docs/HYBRID.md): hidden 5120, 64 layers (48 Gated DeltaNet,
16 gated full attention), 16 key / 48 value heads of 128 in the linear layers, 24 query / 4 KV
heads of 256 in the full ones, MLP 17408, vocabulary 248320; random bf16 weights drawn on the
GPU (bench_models.py: built on meta, materialised on the device, drawn there once; `--layers N`
scales the depth). After a `--context` prefill it times, at that position and never committed,
in this order (`--phases` picks some; the two baselines, torch loop and one layer alone, are
skipped, and say so, if they would start later than `--deadline-s` after the build):
- the 1-token step and the 16-token verify window through the target's graph runner (CUDA
  graphs), with the verify-window kernels (layers/gdn_kernels.py) and with the token-by-token
  torch loop they replace, and both eagerly;
- `select` rollback after a 16-token window (commit copies one state slot), n accepted;
- the DFlash cycle as the executor runs it (spec_session.py: target with taps + dflash drafter +
  verifier through Session / Executor.step, CUDA graphs, the cycle's one host sync), with a random
  drafter of the shape z-lab ships for Qwen3.6-27B (hidden 5120, 5 layers: 4 sliding-window (2048)
  + 1 full, MLP 17408, taps [1, 16, 31, 46, 61], block 16; its attention heads are assumed to be
  the target's, 24 / 4 of 256): its floor is the target's 16-token window floor plus the
  drafter's (its weights, the LM head over the block, its context K/V) at the measured bandwidth;
  random drafts are rejected, so every cycle is a whole cycle (one token);
- one Gated DeltaNet mixer alone, and the recurrence kernel's (block_v, warps) variants at
  T = 16 with the bandwidth its per-position state writes reach;
- the floor: bytes a window must move (weights but the embedding, the KV read, the committed
  state read, one state write per position) over the copy bandwidth measured in this run
  (benchmarks/gpu_target.py's), for T = 1 and T = 16.
Every timing is the median of `rounds` rounds; its spread ((max - min) / median) is printed.
Results go to DIR/results.json after every phase.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

QWEN36_27B = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=248320, hidden_size=5120,
                  intermediate_size=17408, num_hidden_layers=64, full_attention_interval=4, num_attention_heads=24,
                  num_key_value_heads=4, head_dim=256, linear_num_key_heads=16, linear_num_value_heads=48,
                  linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=0,
                  rms_norm_eps=1e-6, max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=False,
                  hidden_act="silu",
                  rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25})
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2, full_attention_interval=2,
            num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=16, linear_value_head_dim=16)
WINDOWS = (1, 4, 8, 16)
PHASES = ("kernels", "rollback", "dflash", "torch_loop", "mixer")  # in run order: the numbers first
OPTIONAL = ("torch_loop", "mixer")  # baselines: --deadline-s may skip them
# (block_v, num_warps) of the recurrence kernel: 32, 16 or 8 state elements per thread; more threads hide more
# latency, fewer repeat the q/k vectors less. The default is gdn_kernels.BLOCK_V / RECURRENCE_WARPS (16, 4).
VARIANTS = ((16, 4), (16, 2), (8, 1), (8, 2), (32, 4), (32, 8), (64, 8))


def drafter_config(cfg, tiny: bool) -> dict:
    """The DFlash drafter z-lab ships for Qwen3.6-27B (docs above), tapping this target's depth."""
    from draftflow.plugins.dflash.config import default_target_layer_ids

    h, layers = cfg.hidden_size, (2 if tiny else 5)
    return dict(architectures=["DFlashDraftModel"], model_type="qwen3", vocab_size=cfg.vocab_size, hidden_size=h,
                intermediate_size=cfg.intermediate_size, num_hidden_layers=layers, num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, rms_norm_eps=1e-6, rope_theta=1e7,
                max_position_embeddings=32768, tie_word_embeddings=False, attention_bias=False, hidden_act="silu",
                block_size=4 if tiny else 16, num_target_layers=cfg.num_layers,
                layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"], sliding_window=8 if tiny else 2048,
                dflash_config={"mask_token_id": cfg.vocab_size - 1 if tiny else 248070,  # Qwen3.5/3.6 drafters' id
                               "target_layer_ids": [0, 1] if tiny else list(default_target_layer_ids(cfg.num_layers,
                                                                                                    layers))})


def set_kernels(model, on: bool) -> None:
    """Route recorded windows through gdn_kernels (on; on the CPU too, interpreted) or the torch loop (off)."""
    for layer in model.layers:
        if layer.is_linear:
            layer.linear_attn.verify_kernel = on


def floor_bytes(cfg, context: int, tokens: int) -> dict:
    """Bytes a window of `tokens` must move at `context`: weights (but the embedding row lookup), KV read, state."""
    from draftflow.layers.config import kv_bytes_per_token, weight_bytes

    state = cfg.num_linear_layers * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
    parts = {"weights": weight_bytes(cfg, torch.bfloat16) - cfg.vocab_size * cfg.hidden_size * 2,
             "kv_read": context * kv_bytes_per_token(cfg, torch.bfloat16),
             "state_read": state, "state_writes": tokens * state}
    return {**parts, "total": sum(parts.values())}


def device_ms(gt, fn, reps: int, rounds: int, batch: int = 20) -> float:
    """GPU time of `fn`: on CUDA `batch` calls captured in one graph (so Python launch time is not what is timed)."""
    if gt.DEV != "cuda":
        return gt.cuda_ms(fn, reps, rounds)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn(), fn()  # compile, allocate
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(batch):
            fn()
    return gt.cuda_ms(graph.replay, reps, rounds) / batch


def mixer_times(gt, model, s, reps: int, rounds: int, variants, top: int = 16) -> dict:
    """One Gated DeltaNet layer's window alone (GPU time): kernels vs torch loop (T = 1, top), and the recurrence
    kernel's variants."""
    from draftflow.layers import gdn_kernels

    layer = next(layer.linear_attn for layer in model.layers if layer.is_linear)
    cfg, lin = model.config, s.linear
    x = torch.randn(1, top, cfg.hidden_size, dtype=layer.A_log.dtype, device=gt.DEV)
    out = {}
    s.rewind()  # back to the prefilled context (rollback timing committed past it)
    with torch.inference_mode():
        for on in (True, False):
            layer.verify_kernel = on
            for t in (1, top):
                lin.begin(s.context, t)
                step = lambda t=t: layer(x[:, :t], lin, 0, True)  # noqa: E731
                out[f"{'kernels' if on else 'torch loop'} T={t} ms"] = device_ms(gt, step, reps, rounds)
        layer.verify_kernel = None
        qkvz, ba = layer.in_proj_qkvz(x), layer.in_proj_ba(x)
        written = top * cfg.linear_num_value_heads * cfg.linear_key_head_dim * cfg.linear_value_head_dim * 4
        for bv, nw in variants:
            def run(bv=bv, nw=nw):
                gdn_kernels.window(qkvz, ba, lin.conv[0], layer.conv1d.weight, layer.A_log, layer.dt_bias, lin.rec[0],
                                   None, layer.hk, layer.dk, layer.dv, block_v=bv, num_warps=nw)
            ms = device_ms(gt, run, reps, rounds)
            out[f"window T={top} block_v={bv} warps={nw}"] = {"ms": ms, "state_write_TBps": written / (ms * 1e-3) / 1e12}
    return out


def timed(gt, fn, reps: int, rounds: int) -> tuple[float, float]:
    """(median over `rounds` of the mean ms of `reps` calls, spread = (max - min) / median)."""
    times = [gt.cuda_ms(fn, reps, 1) for _ in range(rounds)]
    mid = statistics.median(times)
    return mid, (max(times) - min(times)) / mid if mid else 0.0


def windows(gt, model, s, on: bool, capture: bool, window_sizes, reps: int, rounds: int) -> dict:
    """Graph replays (GraphRunner, CUDA graphs on CUDA) of every window size and eager T=1 / T=top, ms and spread."""
    from draftflow.plugins.target.graphs import GraphRunner

    set_kernels(model, on)
    s.rewind()  # back to the prefilled context (the rollback phase commits past it)
    runner = GraphRunner(model, s.cache, 16, linear=s.linear, capture=capture, compiled=capture)
    row, spread = {}, {}
    with torch.inference_mode():
        for t in window_sizes:
            drafts = torch.randint(0, 100, (1, t - 1), device=gt.DEV) if t > 1 else None
            runner(7, drafts, s.context)  # capture
            gt.sync()
            row[f"graph T={t}"], spread[f"graph T={t}"] = timed(gt, lambda d=drafts: runner(7, d, s.context), reps,
                                                                rounds)
    for t in (1, window_sizes[-1]):
        row[f"eager T={t}"], spread[f"eager T={t}"] = timed(gt, lambda t=t: s.verify(t), max(1, reps // 4), rounds)
    return {**row, "spread": spread}  # the runner and its graphs go with this frame


def dflash_cycle(a, gt, model, shapes: dict, context: int, bw: float, step_ms: float | None, dtype) -> dict:
    """The DFlash cycle through the executor (module docstring), against the target window's + drafter's floors."""
    import bench_models
    import spec_session as ss

    from draftflow.plugins.dflash.config import DFlashConfig

    cfg = model.config
    set_kernels(model, None)  # the node's default: kernels on CUDA, the torch loop on the CPU
    prompt = torch.randint(0, cfg.vocab_size, (context,), generator=torch.Generator().manual_seed(5)).tolist()
    dcfg_d, fallback = drafter_config(cfg, a.tiny), None
    for attempt in ("as shipped", "all full attention"):
        if attempt != "as shipped":  # a failure of the sliding-window layers must not cost the cycle's number
            dcfg_d = {**dcfg_d, "layer_types": ["full_attention"] * dcfg_d["num_hidden_layers"]}
            dcfg_d.pop("sliding_window")
        drafter = bench_models.drafter(DFlashConfig.from_hf_dict(dcfg_d, "qwen3.6-27b dflash shape"), a.device, 1, dtype)
        if a.device == "cuda":
            torch.cuda.reset_peak_memory_stats()
        try:
            session = ss.open_session(a.device, model, shapes, drafter, dcfg_d, max_context=context + 256,
                                      dtype=str(dtype).removeprefix("torch."))
            try:
                row = ss.plan_row(session)
                row.update(ss.cycles(session, prompt, 2 if a.tiny else 20, rounds=1 if a.tiny else 3,
                                     warm=1 if a.tiny else 3, sync_cycles=1 if a.tiny else 4))
            finally:
                ss.close(session)
            break
        except Exception as exc:  # noqa: BLE001 - retried once with full-attention layers, then raised
            if attempt != "as shipped" or "sliding_attention" not in dcfg_d.get("layer_types", ()):
                raise
            fallback = f"{type(exc).__name__}: {str(exc)[:300]}"
            traceback.print_exc()
    if fallback:
        row["sliding_window_failed"] = fallback  # the row is of 5 full-attention layers: say so
    ms = lambda b: b / (bw * 1e12) * 1e3  # noqa: E731
    target16, draft = floor_bytes(cfg, context, 16), ss.dflash_floor_bytes(drafter, model.head_weight(), context)
    summed = ms(target16["total"]) + ms(draft["total"])
    row.update(floor_target_window16_ms=ms(target16["total"]), floor_drafter_ms=ms(draft["total"]), drafter_bytes=draft,
               floors_ms=summed, cycle_over_floors=row["cycle_ms"] / summed,
               drafter={k: dcfg_d.get(k) for k in ("hidden_size", "num_hidden_layers", "intermediate_size", "block_size",
                                                   "num_attention_heads", "num_key_value_heads", "head_dim",
                                                   "layer_types", "sliding_window")}
               | {"taps": dcfg_d["dflash_config"]["target_layer_ids"]})
    if step_ms:
        row["cycle_in_target_steps"] = row["cycle_ms"] / step_ms
    return row


def run(a) -> dict:
    import bench_models
    import gpu_hybrid as gh
    import gpu_target as gt

    from draftflow.layers.config import TargetConfig

    gt.DEV = a.device
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    r = gt.Results(out / "results.json")
    shapes = {**QWEN36_27B, **(TINY if a.tiny else {})}
    if a.layers:
        shapes["num_hidden_layers"] = a.layers
    cfg = TargetConfig.from_hf_dict(shapes, "qwen3.6-27b-class shapes")
    context = a.context or (24 if a.tiny else 2048)
    reps = a.reps or (1 if a.tiny else 10)
    rounds = a.rounds or (1 if a.tiny else 5)
    sizes = (1, 4) if a.tiny else WINDOWS  # the interpreter takes ~0.1 s per token and layer
    phases = set(a.phases.split(",")) if a.phases else set(PHASES)
    r.save("env", {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu (Triton interpreter)",
                   "torch": torch.__version__, "layers": cfg.num_layers, "linear_layers": cfg.num_linear_layers,
                   "context": context, "windows": sizes, "reps": reps, "rounds": rounds})
    bw = gt.copy_bandwidth()
    floors = {t: floor_bytes(cfg, context, t) for t in (1, 16)}
    r.save("floor", {"copy_TBps": bw, **{f"T={t}": {**b, "floor_ms": b["total"] / (bw * 1e12) * 1e3,
                                                     "weights_floor_ms": b["weights"] / (bw * 1e12) * 1e3}
                                          for t, b in floors.items()}})
    began = time.monotonic()
    dtype = torch.float32 if a.tiny else torch.bfloat16  # the interpreter is faster in float32
    model, _ = bench_models.target(cfg, a.device, seed=0, dtype=dtype)
    gt.sync()
    built = time.monotonic()
    s = gh.Setup(model, context, "select", a.device, dtype)
    gt.sync()
    r.save("model", {"params": sum(p.numel() for p in model.parameters()), "build_s": built - began,
                     "prefill_s": time.monotonic() - built})
    capture = a.device == "cuda"

    def phase(name: str, key: str, fn) -> None:
        if name not in phases:
            return
        if name in OPTIONAL and time.monotonic() - began > a.deadline_s:
            r.save(key, {"skipped": f"past --deadline-s {a.deadline_s:.0f} s"})
            return
        t = time.monotonic()
        gt.guarded(r, key, fn)
        r.setdefault("phase_s", {})[name] = time.monotonic() - t

    phase("kernels", "windows, kernels", lambda: windows(gt, model, s, True, capture, sizes, reps, rounds))
    set_kernels(model, True if a.device != "cuda" else None)  # None: the default, kernels on CUDA
    phase("rollback", "select rollback ms", lambda: {n: gh.rollback_ms(s, n, reps, a.device) for n in (1, 4, 8, 16)})
    step_ms = r.get("windows, kernels", {}).get("graph T=1")
    phase("dflash", "dflash cycle", lambda: dflash_cycle(a, gt, model, shapes, context, bw, step_ms, dtype))
    phase("torch_loop", "windows, torch loop",  # the token-by-token loop the kernels replace, fewer reps
          lambda: windows(gt, model, s, False, capture, sizes, max(1, reps // 4), rounds))
    set_kernels(model, True if a.device != "cuda" else None)
    phase("mixer", "gdn mixer", lambda: mixer_times(gt, model, s, reps, rounds, VARIANTS[:1] if a.tiny else VARIANTS,
                                                    sizes[-1]))
    r.save("elapsed_s", time.monotonic() - began)
    return r


def report(r: dict) -> None:
    sizes = r["env"]["windows"]
    top = sizes[-1]
    f1, f16 = r["floor"]["T=1"], r["floor"]["T=16"]
    m = r["model"]
    print(f"\n{r['env']['device']}, {r['env']['layers']} layers ({r['env']['linear_layers']} Gated DeltaNet), "
          f"{m['params'] / 1e9:.2f}B params (built in {m['build_s']:.1f} s, prefilled in {m['prefill_s']:.1f} s), "
          f"context {r['env']['context']}, copy {r['floor']['copy_TBps']:.2f} TB/s")
    print(f"floor T=1: {f1['floor_ms']:.3f} ms (weights alone {f1['weights_floor_ms']:.3f});  "
          f"T=16: {f16['floor_ms']:.3f} ms (state writes {f16['state_writes'] / 2**20:.0f} MiB)")
    print(f"{'ms':<22}" + "".join(f"{f'T={t}':>10}" for t in sizes) + f"{f'{top}/1':>8}{'1/floor':>9}{'spread':>8}")
    for name in ("kernels", "torch loop"):
        row = r.get(f"windows, {name}")
        if row is None:
            continue
        if "error" in row or "skipped" in row:
            print(f"  {name}: {row.get('error') or row.get('skipped')}")
            continue
        for mode in ("graph", "eager"):
            cells = [row.get(f"{mode} T={t}") for t in sizes]
            text = "".join(f"{c:>10.3f}" if c is not None else f"{'':>10}" for c in cells)
            step, window = row.get(f"{mode} T=1"), row.get(f"{mode} T={top}")
            ratio = f"{window / step:>8.2f}{step / f1['floor_ms']:>9.2f}" if step and window else ""
            spread = max((v for k, v in row.get("spread", {}).items() if k.startswith(mode)), default=0.0)
            print(f"  {name + ', ' + mode:<20}{text}{ratio}{spread:>8.1%}")
    rb = r.get("select rollback ms", {})
    if rb and "error" not in rb and "skipped" not in rb:
        print("select rollback after a 16-token window, n accepted (ms): "
              + ", ".join(f"n={n} {v:.3f}" for n, v in rb.items()))
    report_dflash(r.get("dflash cycle"))
    for key, value in r.get("gdn mixer", {}).items():
        if key in ("error", "skipped"):
            print(f"  gdn mixer: {value}")
        elif isinstance(value, dict):
            print(f"  one layer, {key}: {value['ms']:.4f} ms, state writes {value['state_write_TBps']:.2f} TB/s")
        else:
            print(f"  one layer, {key}: {value:.4f}")
    print(f"elapsed {r.get('elapsed_s', 0):.0f} s; phases (s): "
          + ", ".join(f"{k} {v:.0f}" for k, v in r.get("phase_s", {}).items()))


def report_dflash(d: dict | None) -> None:
    if not d:
        return
    if "error" in d or "skipped" in d:
        print(f"DFlash cycle: {d.get('error') or d.get('skipped')}")
        return
    steps = f" = {d['cycle_in_target_steps']:.2f} target 1-token steps" if "cycle_in_target_steps" in d else ""
    if "sliding_window_failed" in d:
        print(f"DFlash drafter with sliding-window layers failed ({d['sliding_window_failed']}); this row is of "
              f"{d['drafter']['num_hidden_layers']} full-attention layers")
    print(f"DFlash cycle through the executor (target graphs: {'yes' if d['graphs'] else 'no'}): {d['cycle_ms']:.3f} ms "
          f"(spread {d['spread']:.1%}){steps}; floors: target 16-token window {d['floor_target_window16_ms']:.3f} + "
          f"drafter {d['floor_drafter_ms']:.3f} = {d['floors_ms']:.3f} ms -> {d['cycle_over_floors']:.2f}x (goal <= 1.8x); "
          f"{d['tokens_per_cycle']:.2f} tokens/cycle, {d['host_syncs_per_cycle']:.1f} host syncs/cycle")
    b = d["drafter_bytes"]
    print(f"  drafter floor bytes: weights {b['weights'] / 1e9:.2f} GB + LM head over the block {b['lm_head'] / 1e9:.2f} GB"
          f" + context K/V {b['kv_read'] / 1e6:.1f} MB; plan {d['plan_gib']:.2f} GiB"
          + (f", peak {d['peak_gib']:.2f} GiB (with this benchmark's own prefilled state)" if "peak_gib" in d else ""))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json")
    p.add_argument("--tiny", action="store_true", help="toy shapes (a CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 64; keep a multiple of 4)")
    p.add_argument("--context", type=int, default=None, help="prefilled tokens (default 2048; tiny: 24)")
    p.add_argument("--reps", type=int, default=None, help="calls per timed round (default 10)")
    p.add_argument("--rounds", type=int, default=None, help="timed rounds, median reported (default 5)")
    p.add_argument("--phases", default=None, help=f"comma-separated subset of {','.join(PHASES)} (default all)")
    p.add_argument("--deadline-s", type=float, default=1e9, help="skip the baselines (torch loop, one layer alone) if they would start later than this many "
                   "seconds after the build")
    a = p.parse_args(argv)
    if a.device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernels on CPU tensors; before Triton is imported
    elif not torch.cuda.is_available():
        print("error: --device cuda but no CUDA device is visible; run on the GPU machine or pass --tiny --device cpu")
        return 2
    report(run(a))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

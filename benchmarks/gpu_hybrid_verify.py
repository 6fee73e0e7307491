"""A ~27B dense hybrid target (3 Gated DeltaNet : 1 gated attention, bf16): step, verify window, rollback, floor.

    python benchmarks/gpu_hybrid_verify.py --out DIR                          # H200, < 3 min
    python benchmarks/gpu_hybrid_verify.py --tiny --device cpu --out DIR      # CPU smoke run (Triton interpreter)

Shapes of the Qwen3.6-27B class (docs/HYBRID.md): hidden 5120, 64 layers (48 Gated DeltaNet,
16 gated full attention), 16 key / 48 value heads of 128 in the linear layers, 24 query / 4 KV
heads of 256 in the full ones, MLP 17408, vocabulary 248320; random bf16 weights drawn on the
GPU (`--layers N` scales the depth if the weights must shrink). After a `--context` prefill it
times, at that position and never committed:
- the 1-token step and the 16-token verify window through the target's graph runner (CUDA
  graphs), with the verify-window kernels (layers/gdn_kernels.py) and with the token-by-token
  torch loop they replace, and both eagerly;
- `select` rollback after a 16-token window (commit copies one state slot), n accepted;
- one Gated DeltaNet mixer alone, and the recurrence kernel's (block_v, warps) variants at
  T = 16 with the bandwidth its per-position state writes reach;
- the floor: bytes a window must move (weights but the embedding, the KV read, the committed
  state read, one state write per position) over the copy bandwidth measured in this run
  (benchmarks/gpu_target.py's), for T = 1 and T = 16.
Results go to DIR/results.json after every phase.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
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
# (block_v, num_warps) of the recurrence kernel: 32, 16 or 8 state elements per thread; more threads hide more
# latency, fewer repeat the q/k vectors less. The default is gdn_kernels.BLOCK_V / RECURRENCE_WARPS (16, 4).
VARIANTS = ((16, 4), (16, 2), (8, 1), (8, 2), (32, 4), (32, 8), (64, 8))


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


def run(a) -> dict:
    import gpu_hybrid as gh
    import gpu_target as gt

    from draftflow.layers.config import TargetConfig
    from draftflow.plugins.target.graphs import GraphRunner

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
    rounds = 1 if a.tiny else 5
    windows = (1, 4) if a.tiny else WINDOWS  # the interpreter takes ~0.1 s per token and layer
    r.save("env", {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu (Triton interpreter)",
                   "torch": torch.__version__, "layers": cfg.num_layers, "linear_layers": cfg.num_linear_layers,
                   "context": context, "windows": windows})
    bw = gt.copy_bandwidth()
    floors = {t: floor_bytes(cfg, context, t) for t in (1, 16)}
    r.save("floor", {"copy_TBps": bw, **{f"T={t}": {**b, "floor_ms": b["total"] / (bw * 1e12) * 1e3,
                                                     "weights_floor_ms": b["weights"] / (bw * 1e12) * 1e3}
                                          for t, b in floors.items()}})
    began = time.monotonic()
    model = gt.build_model(cfg, seed=0)
    dtype = torch.float32 if a.tiny else torch.bfloat16
    if a.tiny:  # the interpreter is faster in float32 (a bf16 .to() would also round the RoPE table: tiny only)
        model = model.float()
    s = gh.Setup(model, context, "select", a.device, dtype)
    r.save("model", {"params": sum(p.numel() for p in model.parameters()), "build_and_prefill_s": time.monotonic() - began})
    capture = a.device == "cuda"
    for on in (True, False):  # kernels, then the token-by-token torch loop they replace
        name = "kernels" if on else "torch loop"
        set_kernels(model, on)

        def timings(on=on) -> dict:
            runner = GraphRunner(model, s.cache, 16, linear=s.linear, capture=capture, compiled=capture)
            row = {f"graph T={t}": gt.time_runner(runner, context, t, reps if on else max(1, reps // 4))
                   for t in windows}
            row.update({f"eager T={t}": gt.cuda_ms(lambda t=t: s.verify(t), max(1, reps // 4), rounds)
                        for t in (1, windows[-1])})
            del runner
            return row
        gt.guarded(r, f"windows, {name}", timings)
    set_kernels(model, True if a.device != "cuda" else None)  # None: the default, kernels on CUDA
    gt.guarded(r, "select rollback ms", lambda: {n: gh.rollback_ms(s, n, reps, a.device) for n in (1, 4, 8, 16)})
    gt.guarded(r, "gdn mixer", lambda: mixer_times(gt, model, s, reps, rounds, VARIANTS[:1] if a.tiny else VARIANTS,
                                                        windows[-1]))
    r.save("elapsed_s", time.monotonic() - began)
    return r


def report(r: dict) -> None:
    windows = r["env"]["windows"]
    top = windows[-1]
    f1, f16 = r["floor"]["T=1"], r["floor"]["T=16"]
    print(f"\n{r['env']['device']}, {r['env']['layers']} layers ({r['env']['linear_layers']} Gated DeltaNet), "
          f"{r['model']['params'] / 1e9:.2f}B params, context {r['env']['context']}, copy {r['floor']['copy_TBps']:.2f} TB/s")
    print(f"floor T=1: {f1['floor_ms']:.3f} ms (weights alone {f1['weights_floor_ms']:.3f});  "
          f"T=16: {f16['floor_ms']:.3f} ms (state writes {f16['state_writes'] / 2**20:.0f} MiB)")
    print(f"{'ms':<22}" + "".join(f"{f'T={t}':>10}" for t in windows) + f"{f'{top}/1':>8}{'1/floor':>9}")
    for name in ("kernels", "torch loop"):
        row = r.get(f"windows, {name}", {})
        if "error" in row:
            print(f"  {name}: {row['error']}")
            continue
        for mode in ("graph", "eager"):
            cells = [row.get(f"{mode} T={t}") for t in windows]
            text = "".join(f"{c:>10.3f}" if c is not None else f"{'':>10}" for c in cells)
            step, window = row.get(f"{mode} T=1"), row.get(f"{mode} T={top}")
            ratio = f"{window / step:>8.2f}{step / f1['floor_ms']:>9.2f}" if step and window else ""
            print(f"  {name + ', ' + mode:<20}{text}{ratio}")
    rb = r.get("select rollback ms", {})
    if "error" not in rb:
        print("select rollback after a 16-token window, n accepted (ms): "
              + ", ".join(f"n={n} {v:.3f}" for n, v in rb.items()))
    for key, value in r.get("gdn mixer", {}).items():
        if key == "error":
            print(f"  gdn mixer: {value}")
        elif isinstance(value, dict):
            print(f"  one layer, {key}: {value['ms']:.4f} ms, state writes {value['state_write_TBps']:.2f} TB/s")
        else:
            print(f"  one layer, {key}: {value:.4f}")
    print(f"elapsed {r.get('elapsed_s', 0):.0f} s")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for results.json")
    p.add_argument("--tiny", action="store_true", help="toy shapes (a CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 64; keep a multiple of 4)")
    p.add_argument("--context", type=int, default=None, help="prefilled tokens (default 2048; tiny: 24)")
    p.add_argument("--reps", type=int, default=None)
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

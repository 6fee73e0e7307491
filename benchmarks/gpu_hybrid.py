"""Hybrid (Qwen3-Next-style) target vs a dense Qwen3 of similar size: verify-window and rollback cost.

    python benchmarks/gpu_hybrid.py --out results.json                 # H200: ~2B-parameter shapes, bf16
    python benchmarks/gpu_hybrid.py --tiny --device cpu --out r.json   # CPU smoke run at toy shapes

Weights are random and built in memory. For each model a context of `--context` tokens is
prefilled, then a verify window of T in (1, 4, 8, 16) tokens is timed at that position (never
committed, so every repetition sees the same state), eagerly and through the target's graph
runner (CUDA graphs on CUDA; dense and hybrid-select). Rollback after a window of 16 with n
accepted tokens is timed for the hybrid's two modes: `select` (the state after every window
position was kept; commit copies one slot) and `replay` (the window journaled k, v, g, beta;
commit re-runs n recurrence steps), plus the naive alternative, snapshot + re-forward of the
n accepted tokens through the whole model. The dense model's rollback is setting an integer.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from draftflow.layers.config import TargetConfig
from draftflow.layers.kv_cache import KVCache, static_shape
from draftflow.layers.linear_state import LinearState
from draftflow.plugins.target.model import TargetModel

BASE = dict(vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=16,
            num_key_value_heads=4, head_dim=128, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=8192,
            tie_word_embeddings=False, attention_bias=False, hidden_act="silu")
HYBRID = dict(architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", full_attention_interval=4,
              head_dim=256, num_key_value_heads=2, linear_num_key_heads=16, linear_num_value_heads=32,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4, num_experts=0,
              rope_parameters={"rope_type": "default", "rope_theta": 1e6, "partial_rotary_factor": 0.25})
# A wider MLP gives the dense model the hybrid's parameter count (Gated DeltaNet mixers are ~3x attention's).
DENSE = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", intermediate_size=9728)
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
            head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
            linear_value_head_dim=16)
WINDOWS = (1, 4, 8, 16)
MAX_WINDOW = 16


def build(kind: str, tiny: bool, device: str, dtype: torch.dtype) -> TargetModel:
    d = {**BASE, **(HYBRID if kind == "hybrid" else DENSE), **(TINY if tiny else {})}
    if kind == "dense" and tiny:
        d.pop("linear_num_key_heads")
    cfg = TargetConfig.from_hf_dict(d, f"{kind} config")
    model = TargetModel(cfg, dtype, device)
    gen = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand(p.shape, generator=gen, device=device))
            elif p.dim() == 1:
                p.copy_(0.1 * torch.randn(p.shape, generator=gen, device=device) + (0 if cfg.norm_offset else 1))
            else:
                p.copy_(torch.randn(p.shape, generator=gen, device=device) / p[0].numel() ** 0.5)
    return model


def timer(device: str):
    def ms(fn, reps: int) -> float:
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            fn()
        if device == "cuda":
            torch.cuda.synchronize()
        return (time.perf_counter() - t) * 1000 / reps
    return ms


class Setup:
    """A model with `context` tokens prefilled and committed; windows run at that position."""

    def __init__(self, model: TargetModel, context: int, mode: str, device: str, dtype: torch.dtype):
        cfg = model.config
        self.model, self.context = model, context
        self.cache = KVCache.from_static(torch.zeros(static_shape(cfg, 1, context + MAX_WINDOW + 1), dtype=dtype,
                                                     device=device))
        self.linear = LinearState.allocate(cfg, 1, MAX_WINDOW, dtype, device, mode) if cfg.is_hybrid else None
        ids = torch.randint(0, cfg.vocab_size, (1, context + MAX_WINDOW), device=device)
        self.prompt, self.window = ids[:, :context], ids[:, context:]
        with torch.inference_mode():
            for start in range(0, context, 512):
                model(self.prompt[:, start:start + 512], start, self.cache, logit_rows=1, linear=self.linear)
                self.commit(min(start + 512, context))
        if self.linear is not None:
            self.saved = (self.linear.conv.clone(), self.linear.rec[:, 0].clone())

    def commit(self, length: int) -> None:
        self.cache.commit(length)
        if self.linear is not None:
            self.linear.commit(length)

    @torch.inference_mode()
    def verify(self, t: int) -> None:
        self.model(self.window[:, :t], self.context, self.cache, linear=self.linear)

    @torch.inference_mode()
    def verify_graph(self, runner, t: int) -> None:
        """The same window through the target's graph runner (a CUDA graph replay per (T, bucket) on CUDA)."""
        runner(7, self.window[:, 1:t] if t > 1 else None, self.context)

    def rewind(self) -> None:
        """Back to the prefilled context (not timed): committed state restored, last window still open."""
        self.cache.commit(self.context)
        if self.linear is not None:
            self.linear.conv[..., :self.linear.kernel_tail] = self.saved[0][..., :self.linear.kernel_tail]
            self.linear.rec[:, 0] = self.saved[1]
            self.linear.length = self.context
            self.linear.begin(self.context, MAX_WINDOW)


def rollback_ms(s: Setup, accepted: int, reps: int, device: str, reforward: bool = False) -> float:
    """Mean time of commit(context + accepted) after a 16-token window (rewinds are not timed)."""
    with torch.inference_mode():
        s.rewind()
        s.verify(MAX_WINDOW)
        total = 0.0
        for _ in range(reps + 1):
            s.rewind()
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            if reforward:  # snapshot + replay through the model: re-run the accepted tokens from the committed state
                s.linear._window = None
                s.model(s.window[:, :accepted], s.context, s.cache, linear=s.linear)
            s.commit(s.context + accepted)
            if device == "cuda":
                torch.cuda.synchronize()
            total += (time.perf_counter() - t) * 1000 if _ else 0.0  # the first round warms up
        return total / reps


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="toy shapes (a CPU smoke run)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--context", type=int, default=None, help="prefilled tokens (default 2048; tiny: 40)")
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--out", type=Path, default=None)
    a = p.parse_args(argv)
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    context = a.context or (40 if a.tiny else 2048)
    reps = a.reps or (3 if a.tiny else 50)
    ms = timer(a.device)
    results = {"device": torch.cuda.get_device_name() if a.device == "cuda" else "cpu", "dtype": str(dtype),
               "context": context, "verify_ms": {}, "verify_graph_ms": {}, "rollback_ms": {}, "params": {}, "state_bytes": {}}
    for kind in ("dense", "hybrid"):
        model = build(kind, a.tiny, a.device, dtype)
        results["params"][kind] = sum(p.numel() for p in model.parameters())
        modes = ("select", "replay") if kind == "hybrid" else ("kv",)
        for mode in modes:
            s = Setup(model, context, "select" if mode == "kv" else mode, a.device, dtype)
            name = kind if mode == "kv" else f"{kind}-{mode}"
            results["verify_ms"][name] = {t: round(ms(lambda t=t: s.verify(t), reps), 4) for t in WINDOWS}
            if mode in ("kv", "select"):  # captured windows: the same forward, replayed as CUDA graphs
                from draftflow.plugins.target.graphs import GraphRunner

                runner = GraphRunner(model, s.cache, MAX_WINDOW, linear=s.linear, capture=a.device == "cuda")
                # on the CPU the runner compiles per width (no graphs to time): a smoke run takes two widths
                widths = WINDOWS if a.device == "cuda" else (1, MAX_WINDOW)
                results["verify_graph_ms"][name] = {t: round(ms(lambda t=t: s.verify_graph(runner, t), reps), 4)
                                                    for t in widths}
                del runner
            if s.linear is not None:
                results["state_bytes"][name] = sum(x.numel() * x.element_size() for x in
                                                   (s.linear.conv, s.linear.rec, s.linear.journal) if x is not None)
                results["rollback_ms"][name] = {n: round(rollback_ms(s, n, reps, a.device), 4) for n in (1, 4, 8, 16)}
                if mode == "select":
                    results["rollback_ms"]["hybrid-reforward"] = {
                        n: round(rollback_ms(s, n, reps, a.device, reforward=True), 4) for n in (1, 4, 8, 16)}
            else:
                results["rollback_ms"][name] = {n: round(ms(lambda n=n: s.cache.commit(context + n), reps), 4)
                                                for n in (1, 4, 8, 16)}
        del model
    print(f"device {results['device']}, {dtype}, context {context}; params dense {results['params']['dense']:,} "
          f"hybrid {results['params']['hybrid']:,}")
    print("verify window (ms)     " + "".join(f"{f'T={t}':>10}" for t in WINDOWS))
    for name, row in results["verify_ms"].items():
        print(f"  {name:<21}" + "".join(f"{row[t]:>10.3f}" for t in WINDOWS))
    for name, row in results["verify_graph_ms"].items():
        print(f"  {name + ', graph':<21}" + "".join(f"{row[t]:>10.3f}" if t in row else f"{'-':>10}" for t in WINDOWS))
    print("rollback, 16-token window (ms)" + "".join(f"{f'n={n}':>10}" for n in (1, 4, 8, 16)))
    for name, row in results["rollback_ms"].items():
        print(f"  {name:<28}" + "".join(f"{row[n]:>10.3f}" for n in (1, 4, 8, 16)))
    for name, b in results["state_bytes"].items():
        print(f"  recurrent + conv state, {name}: {b / 2**20:.2f} MiB")
    if a.out:
        a.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

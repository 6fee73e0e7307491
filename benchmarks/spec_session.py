"""A real draftflow graph over in-memory random-weight models, stepped cycle by cycle through the executor.

`open_session` hands the models to the target and dflash nodes (their loaders are replaced for
this process) and opens the graph as `draftflow generate` does: planned (core/budget.py: KV cache,
linear states, the expert cache's resident count from `vram_budget`), built, warmed up, CUDA
graphs on CUDA. `cycles` starts one request and steps it (`Executor.step`: draft, verify, accept,
commit, the cycle's one host sync): wall ms per cycle over `rounds` rounds (median and spread),
tokens per cycle, host synchronisations per cycle (a separate short pass under torch's sync debug
mode), and on MoE targets the expert cache's hits, misses and uploads per token; on CUDA the peak
memory next to the plan's bytes. With random weights a drafter's drafts are almost never accepted,
so every cycle does a whole cycle's work (one token per cycle).
"""

from __future__ import annotations

import collections
import json
import statistics
import tempfile
import time
import warnings
from pathlib import Path

import torch


class SyncCounter:
    """Counts host synchronisations inside the block, by torch's CUDA sync debug mode (0 on the CPU)."""

    def __enter__(self):
        self.count, self._caught, self.sites = 0, None, collections.Counter()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        if self._caught is not None:
            torch.cuda.set_sync_debug_mode("default")
            caught = [w for w in self._caught if "synchroniz" in str(w.message)]
            self.count = len(caught)
            # where they came from (the Python line that synchronised), to find the next one to remove
            self.sites = collections.Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught)
            self._warnings.__exit__(*exc)
        return False


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def open_session(device: str, target, tcfg_d: dict, drafter=None, dcfg_d: dict | None = None, *, max_context: int,
                 budget: int | None = None, dtype: str = "bfloat16", cuda_graphs: bool = True):
    """A Session of target (+ dflash drafter) + verifier over the in-memory models; configs are written for the plan.
    `cuda_graphs` False: both nodes run eagerly (their `cuda_graphs: false`)."""
    from draftflow.core.session import Session
    from draftflow.core.tracing import configure_logging
    from draftflow.plugins.dflash import plugin as dflash_plugin
    from draftflow.plugins.target import hf_loader

    configure_logging(verbose=False)  # warnings only: no event line per cycle
    root = Path(tempfile.mkdtemp(prefix="spec_session_"))
    for name, d in (("target", tcfg_d), ("drafter", dcfg_d)):
        if d is not None:
            (root / name).mkdir()
            (root / name / "config.json").write_text(json.dumps(d))
    # The loaders hand the nodes our models while the graph is built, and only then (restored below).
    from draftflow.layers import quant_experts

    # The models are already in memory (experts possibly aliased: bench_models), so the host-memory rule, which
    # sizes a load from the config, does not apply: it would refuse the 80B shape that these benchmarks alias.
    available = quant_experts.available_host_memory
    quant_experts.available_host_memory = lambda: None
    loaders = (hf_loader.load_hf, dflash_plugin.load_drafter)
    hf_loader.load_hf = lambda path, device, dtype, tp=None: hf_loader.LoadedTarget(target, target.config, None, (),
                                                                                    "random")
    # warmup_tokens 0: graphs are captured on first use, only for the bucket the run needs (a 64-layer capture is slow)
    params = {"path": str(root / "target"), "warmup_tokens": 0, "cuda_graphs": cuda_graphs}
    nodes = {"target": {"plugin": "target", "params": params}, "verify": {"plugin": "verifier"}}
    graph = {"device": device, "dtype": dtype, "max_context": max_context, "max_batch": 1, "nodes": nodes}
    if drafter is not None:
        dflash_plugin.load_drafter = lambda path, device, dtype: (drafter, drafter.config)
        params["tap_layers"] = list(drafter.config.target_layer_ids)
        nodes["drafter"] = {"plugin": "dflash", "params": {"path": str(root / "drafter"), "cuda_graphs": cuda_graphs}}
        graph["num_draft"] = drafter.config.block_size - 1
    if budget is not None:
        graph["vram_budget"] = int(budget)
    try:
        return Session.open(graph_dict=graph)
    finally:
        hf_loader.load_hf, dflash_plugin.load_drafter = loaders
        quant_experts.available_host_memory = available


def plan_row(session) -> dict:
    """The plan's bytes and resident experts (what `draftflow check` prints for this graph)."""
    vram = session.plan.vram
    row = {"plan_bytes": vram.total, "plan_gib": vram.total / 2**30, "kv_tokens": vram.kv_tokens}
    if vram.experts is not None:
        row.update(resident=vram.experts.resident, experts=vram.experts.total, resident_reason=vram.experts.reason,
                   expert_costs=dict(vram.experts.costs))
    ex = session.executor
    node = ex.nodes[ex.target]
    row["graphs"] = getattr(node, "runner", None) is not None  # the target's windows are CUDA graphs
    cache = getattr(node.model, "expert_cache", None)
    if cache is not None:  # why a MoE target's windows are (not) graphs: docs/MOE.md
        row.update(device_path=cache.device_path, capturable=cache.capturable(session.plan.spec.num_draft + 1))
    return row


def cycles(session, prompt: list[int], n: int, rounds: int = 3, warm: int = 3, sync_cycles: int = 4,
           temperature: float = 0.0, seed: int = 0) -> dict:
    """Step one request: `warm` cycles (captures), `rounds` x `n` timed cycles, `sync_cycles` counted for syncs."""
    from draftflow.core.node import SamplingParams

    ex = session.executor
    device = ex.device
    model = ex.nodes[ex.target].model
    cache = getattr(model, "expert_cache", None)
    per_cycle = session.plan.spec.num_draft + 1  # most tokens one cycle can emit
    budget = min(per_cycle * (warm + rounds * n + sync_cycles) + 16, session.plan.vram.kv_tokens - len(prompt) - 16)
    sp = SamplingParams(max_new_tokens=max(budget, 1), ignore_eos=True, temperature=temperature,
                        seed=seed if temperature else None)
    state = ex.start(prompt, sp)

    def step(k: int) -> int:
        done = 0
        while done < k and state.finish_reason is None:
            ex.step([state])
            done += 1
        return done

    step(warm)
    sync(device)
    before = cache.counters() if cache is not None else None
    tokens0, times, stepped = len(state.generated), [], 0
    began = time.perf_counter()
    for _ in range(rounds):
        t = time.perf_counter()
        k = step(n)
        sync(device)
        if k:
            times.append((time.perf_counter() - t) * 1e3 / k)
        stepped += k
    elapsed = time.perf_counter() - began
    tokens = len(state.generated) - tokens0
    out = {"cycle_ms": statistics.median(times) if times else float("nan"),
           "spread": (max(times) - min(times)) / statistics.median(times) if times else float("nan"),
           "cycles": stepped, "tokens": tokens, "tokens_per_cycle": tokens / max(stepped, 1),
           "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0}
    if cache is not None:
        after = cache.counters()
        hits, misses = (after[k] - before[k] for k in ("expert_hits", "expert_misses"))
        uploaded = after["expert_upload_bytes"] - before["expert_upload_bytes"]
        out.update(hit_rate=hits / max(hits + misses, 1), misses_per_token=misses / max(tokens, 1),
                   uploads_per_token=uploaded / cache.bytes_per_expert / max(tokens, 1), device_path=cache.device_path,
                   resident_now=cache.resident)
    if device.type == "cuda":  # the peak since the caller's reset (before open_session: build, warm-up, cycles)
        out["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["allocated_gib"] = torch.cuda.memory_allocated() / 2**30
    with SyncCounter() as counter:
        counted = step(sync_cycles)
    out["host_syncs_per_cycle"] = counter.count / counted if counted else float("nan")
    out["sync_sites"] = dict(counter.sites.most_common(8))
    if state.finish_reason is None:
        ex.finish(state, "cancelled")
    else:
        ex.finish(state)
    return out


def close(session) -> None:
    """Close and drop a session's buffers, graphs and expert slots before the next one is opened."""
    import gc

    session.close()
    ex = session.executor
    for node in ex.nodes.values():
        model = getattr(node, "model", None)
        if getattr(model, "expert_cache", None) is not None:
            model.expert_cache.release()
    ex.nodes.clear()
    ex.owned.clear()
    ex.handle = None  # it holds the target's feature buffer
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def dflash_floor_bytes(drafter, head: torch.Tensor, context: int) -> dict:
    """Bytes one DFlash proposal must read: its weights, the LM head over the block, its context K/V."""
    cfg = drafter.config
    per_cell = 2 * cfg.num_kv_heads * cfg.head_dim * head.element_size()  # K and V of one position, one layer
    kv = sum(per_cell * (min(context, cfg.sliding_window) if cfg.layer_type(i) == "sliding_attention" else context)
             for i in range(cfg.num_layers))
    parts = {"weights": sum(p.numel() * p.element_size() for p in drafter.parameters()),
             "lm_head": head.numel() * head.element_size(), "kv_read": kv}
    return {**parts, "total": sum(parts.values())}

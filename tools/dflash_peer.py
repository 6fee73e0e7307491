"""Peer rows for the HumanEval benchmark: the `dflash` package's own decode loop on the demo pair.

    python -m draftflow.tools.bench_humaneval --device cuda --peer

The demo target (a Qwen3 HF directory) loads in `transformers`, the demo DFlash (and, when
present, DFlash2) drafter loads as z-lab's `DFlashDraftModel` / `DFlash2DraftModel`, and
`dflash.model.dflash_generate` decodes each prompt with block size K + 1 (the same K as
draftflow's rows). tau, acceptance and per-position acceptance come from the loop's own
acceptance lengths, replayed into draftflow's `RequestStats` (the draft count of a cycle is
`min(B, max_length - start) - 1`, as in that loop); tokens/s is timed around the whole call
(prefill included), as draftflow's rows are. The loop takes its first token from the
prefill, while draftflow's cycle 0 already drafts it (anchor = the last prompt token), so
the two loops' cycles are aligned differently: their counts differ by about one per prompt,
and acceptance is close but not identical even where the drafts are.

This module is a benchmark-only oracle: `dflash` and `transformers` are test extras, and
nothing in core/ or plugins/ imports this file. `dflash_generate` times itself only with
CUDA (`torch.cuda.synchronize`); on a CPU its timer is swapped for `time.perf_counter` so
the rows still run (for tests), and the rows say so.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from unittest import mock

import torch

from draftflow.core.tracing import RequestStats


def unavailable() -> str | None:
    """Why the peer rows cannot run here (None when they can)."""
    try:
        import dflash.model  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as exc:
        return f"dflash reference rows skipped: {exc.name} is not importable (pip install 'dflash==0.1.0' transformers)"
    return None


class PeerPair:
    """The demo target and one z-lab drafter, loaded by transformers / dflash on `device` in float32."""

    def __init__(self, target_dir: Path, drafter_dir: Path, device: str) -> None:
        from dflash.model import DFlash2DraftModel, DFlashDraftModel
        from transformers import AutoModelForCausalLM

        from draftflow.plugins.dflash.dflash2_loader import is_dflash2

        cls = DFlash2DraftModel if is_dflash2(drafter_dir) else DFlashDraftModel
        self.device = device
        self.target = AutoModelForCausalLM.from_pretrained(str(target_dir), dtype=torch.float32).to(device).eval()
        self.drafter = cls.from_pretrained(str(drafter_dir), dtype=torch.float32).to(device).eval()

    def generate(self, ids: list[int], new: int, temperature: float, k: int, seed: int):
        """One `dflash_generate` call; returns (new token ids, acceptance lengths, seconds)."""
        import dflash.model as ref

        torch.manual_seed(seed)
        prompt = torch.tensor([ids], device=self.device)
        timer = contextlib.nullcontext() if self.device.startswith("cuda") else \
            mock.patch.object(ref, "_cuda_time", time.perf_counter)
        with timer:
            if self.device.startswith("cuda"):
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = ref.dflash_generate(self.drafter, self.target, prompt, new, None, temperature=temperature,
                                      block_size=k + 1, return_stats=True)
            seconds = time.perf_counter() - t  # return_stats synchronises before returning
        return out.output_ids[0, len(ids):].tolist(), out.acceptance_lengths, seconds


def replay(stats: RequestStats, prompt_len: int, new: int, block_size: int, acceptance_lengths: list[int]) -> None:
    """Add the loop's cycles to `stats`: drafts = min(B, max_length - start) - 1, accepted = produced - 1."""
    start, max_length = prompt_len, prompt_len + new
    for produced in acceptance_lengths:
        drafted = min(block_size, max_length - start) - 1
        stats.add(drafted, min(drafted, produced - 1), produced)
        start += produced


def run_peer(pair: PeerPair, prompts: list[list[int]], temperature: float, new: int, k: int) -> dict:
    """The benchmark row of one drafter through `dflash_generate` (seed = prompt index, as draftflow's rows)."""
    stats, tokens, seconds = RequestStats(), 0, 0.0
    pair.generate(prompts[0], new, temperature, k, seed=0)  # untimed warm-up, as draftflow's rows get
    for i, ids in enumerate(prompts):
        out, lengths, dt = pair.generate(ids, new, temperature, k, seed=i)
        replay(stats, len(ids), new, k + 1, lengths)
        tokens, seconds = tokens + len(out), seconds + dt
    row = stats.summary()
    row["tokens_per_s"] = round(tokens / seconds, 2)
    if not pair.device.startswith("cuda"):
        row["note"] = "CPU: dflash's CUDA timer replaced by time.perf_counter"
    return row


def peer_pairs(demo: Path, device: str) -> dict[str, PeerPair]:
    """Row name -> loaded pair for each demo drafter present (DFlash, DFlash2)."""
    pairs = {}
    for name, folder in (("dflash ref: DFlash", "dflash"), ("dflash ref: DFlash2", "dflash2")):
        if (demo / folder / "config.json").exists():
            pairs[name] = PeerPair(demo / "target", demo / folder, device)
    return pairs

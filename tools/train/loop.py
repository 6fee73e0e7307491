"""The training loop every recipe shares: AdamW, cosine warm-up, clipping, checkpoints, progress.

A recipe is an object with
- `module`: the trainable `nn.Module` (only its parameters with `requires_grad` are optimised);
- `loss(tokens [B, S], first_anchor=None) -> scalar tensor`: the sampler's `batch(n)` returns tokens, or
  `(tokens, first_anchor [B])` (regenerated windows: the first position whose continuation the target wrote);
- `evaluate(windows: list[Tensor], loss_windows=None) -> dict[str, float]` (held-out numbers, printed as
  training goes; `loss_windows` = the sampler's `held_out_loss(n)` when it has one: `(tokens [N, S],
  first_anchor [N])` to take the held-out loss on, instead of the raw `windows`); with
  `TrainOptions.eval_decode_tokens` > 0 the final evaluation passes `decode_tokens=N` too, for
  `estimate_acceptance`'s decoded estimate (`tau_decode`);
and optionally
- `loss_parts: dict[str, Tensor]`: named parts of the last loss, recorded every step (`TrainResult.parts`);
- `progress: float`: set to the run's completed share before each `loss` (for loss-weight schedules);
- `no_weight_decay: set[str]`: parameter names AdamW must not decay (e.g. identity-initialised kernels).
Writing the finished artifact is the caller's (`cli.py`) business.

The learning rate warms up linearly and then follows a cosine to zero over the run; with a
time budget, "the run" ends at whichever comes first, `steps` or `time_budget_s`, so a
CPU run bounded in wall time still finishes its schedule. The budget counts the held-out
evaluations and checkpoint writes too (wall time of the loop), so a run with frequent
evaluations still ends on time. Checkpoints hold the step, the
elapsed time, the module, the optimizer and every random state, so `resume` continues the
same run.

SIGTERM or SIGINT (Ctrl-C, a scheduler's or `timeout`'s stop) ends the run after its current step as the
end of a time budget does: checkpoint, held-out evaluation, and the caller writes the drafter trained so
far (`TrainResult.stopped_by` names the signal). A second signal acts as it would have.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import attrs
import torch
from torch import nn

from draftflow.core.errors import DraftflowError
from draftflow.layers.kv_cache import KVCache, static_shape
from draftflow.plugins.target.model import TargetModel
from draftflow.tools.train.output import write_file


class WindowKV:
    """Duck-typed `KVCache` for training forwards over whole windows from position 0.

    Each layer's keys/values are kept as the autograd graph's own tensors (no in-place
    writes into a shared buffer, which autograd would reject), so the target's and the
    MTP block's inference code runs unchanged under gradient.
    """

    length = 0

    def __init__(self) -> None:
        self._kv: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def ensure(self, total_tokens: int) -> None:
        pass

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # k, v: [B, T, KVH, D]; training windows always start at 0
        self._kv[layer] = (k, v)

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._kv[layer]


def init_weights(module: nn.Module, std: float = 0.02, seed: int = 0) -> None:
    """Fresh weights: N(0, std) matrices, unit norm gains; then mark every parameter trainable."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(module.named_parameters()):
            if p.dim() == 1:
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=gen) * std)
    module.requires_grad_(True)


def lr_factor(progress: float, warmup: float) -> float:
    """Linear warm-up over the first `warmup` share of the run, then cosine decay to zero."""
    if progress < warmup:
        return progress / warmup
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (progress - warmup) / max(1e-9, 1.0 - warmup))))


@attrs.frozen
class TrainOptions:
    steps: int
    batch_size: int = 8
    lr: float = 6e-4
    warmup: float = 0.04
    weight_decay: float = 0.01
    clip: float = 1.0
    bf16: bool = False  # autocast the forward to bfloat16 (the recipe's default on CUDA)
    eval_every: int = 100
    eval_windows: int = 16
    eval_decode_tokens: int = 0  # > 0: the final evaluation also decodes this many tokens per window (tau_decode)
    save_every: int = 100
    checkpoint: Path | None = None
    resume: bool = False
    time_budget_s: float | None = None
    device: str = "cpu"


@attrs.define
class TrainResult:
    start_step: int
    steps: int
    elapsed_s: float
    losses: list[tuple[int, float]]
    evaluations: list[tuple[int, dict]]
    parts: list[tuple[int, dict]] = attrs.Factory(list)  # (step, {name: value}) when the recipe has loss_parts
    stopped_by: str | None = None  # "SIGTERM" / "SIGINT" when a signal ended the run early


class StopSignals:
    """While entered (main thread only), the first SIGTERM / SIGINT is recorded in `name` instead of acting;
    a second one is handed to the handler that was there before (so it stops the process as usual)."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.name: str | None = None
        self._before: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._before = {sig: signal.signal(sig, self._record) for sig in self.SIGNALS}
        return self

    def _record(self, signum, frame) -> None:
        if self.name is None:
            self.name = signal.Signals(signum).name
            return
        signal.signal(signum, self._before[signum])
        signal.raise_signal(signum)

    def __exit__(self, *exc) -> None:
        for sig, handler in self._before.items():
            signal.signal(sig, handler)


class Progress:
    """One stderr line rewritten in place on a terminal; otherwise a plain line every ~5% or 30 s."""

    def __init__(self, total: int, label: str, stream=None) -> None:
        self.total, self.label = total, label
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.every = max(1, total // 20)
        self.last = time.perf_counter()

    def update(self, step: int, loss: float, lr: float, rate: float, eta_s: float) -> None:
        now = time.perf_counter()
        if not self.tty and step % self.every and step != self.total and now - self.last < 30:
            return
        self.last = now
        frac = min(1.0, step / self.total)
        bar = "#" * int(24 * frac)
        line = (f"{self.label} [{bar:<24}] {step}/{self.total} loss {loss:.4f} lr {lr:.2e} "
                f"{rate:.2f} step/s eta {eta_s / 60:.1f} min")
        self.stream.write(("\r" + line) if self.tty else line + "\n")
        self.stream.flush()

    def note(self, text: str) -> None:
        self.stream.write(("\n" if self.tty else "") + text + "\n")
        self.stream.flush()


def _autocast(opts: TrainOptions):
    if not opts.bf16:
        return torch.autocast(device_type=torch.device(opts.device).type, enabled=False)
    return torch.autocast(device_type=torch.device(opts.device).type, dtype=torch.bfloat16)


def train(recipe, sampler, opts: TrainOptions, label: str = "train", log: Callable[[str], None] | None = None,
          stream=None, intro: str | None = None) -> TrainResult:
    """Run (or resume) the optimisation; write checkpoints; return the loss and evaluation history.

    `intro` is printed once the run is set up (after a resumed checkpoint is read, which may fail).
    """
    named = [(n, p) for n, p in recipe.module.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    keep = set(getattr(recipe, "no_weight_decay", ()))
    decay = [p for n, p in named if p.dim() >= 2 and n not in keep]
    no_decay = [p for n, p in named if p.dim() < 2 or n in keep]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": opts.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=opts.lr, betas=(0.9, 0.95))
    step, elapsed, losses, evaluations, parts = 0, 0.0, [], [], []
    if opts.resume and opts.checkpoint and Path(opts.checkpoint).exists():
        state = _load_checkpoint(opts.checkpoint, opts.device)
        try:
            recipe.module.load_state_dict(state["module"])
            opt.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"].cpu())  # map_location moved it to the device
            sampler.generator.set_state(state["sampler_rng"].cpu())
            if state.get("recipe_rng") is not None and hasattr(recipe, "generator"):
                recipe.generator.set_state(state["recipe_rng"].cpu())
            step, elapsed, losses, evaluations = state["step"], state["elapsed"], state["losses"], state["evaluations"]
        except (KeyError, RuntimeError, ValueError, TypeError) as exc:
            first = str(exc).strip().splitlines()[0][:160] if str(exc).strip() else type(exc).__name__
            raise DraftflowError(f"--checkpoint {opts.checkpoint}: saved by another run; it does not fit this {label} "
                                 f"drafter and settings ({first}); pass that run's --checkpoint, or drop --resume to "
                                 "start afresh") from None
        parts = state.get("parts", [])
    start_step, start_elapsed = step, elapsed
    if intro:
        (stream or sys.stderr).write(intro + "\n")
    progress = Progress(opts.steps, label, stream)
    say = log or progress.note
    if start_step:
        say(f"{label}: resumed from {opts.checkpoint} at step {start_step}")
    held_out = sampler.held_out(opts.eval_windows)
    loss_windows = sampler.held_out_loss(opts.eval_windows) if hasattr(sampler, "held_out_loss") else None

    def fraction() -> float:
        f = step / opts.steps
        return max(f, elapsed / opts.time_budget_s) if opts.time_budget_s else f

    def evaluate(final: bool = False) -> None:
        recipe.module.eval()
        extra = {"decode_tokens": opts.eval_decode_tokens} if final and opts.eval_decode_tokens else {}
        with torch.no_grad():
            result = recipe.evaluate(held_out, **extra) if loss_windows is None \
                else recipe.evaluate(held_out, loss_windows, **extra)
        recipe.module.train()
        if evaluations and evaluations[-1][0] == step:  # the final evaluation replaces one at the same step
            evaluations.pop()
        evaluations.append((step, result))
        say(f"{label} step {step}: held-out " + ", ".join(f"{k} {v:.4g}" for k, v in result.items()))

    def save() -> None:
        if opts.checkpoint is None:
            return
        state = {"step": step, "elapsed": elapsed, "module": recipe.module.state_dict(), "optimizer": opt.state_dict(),
                 "rng": torch.get_rng_state(), "sampler_rng": sampler.generator.get_state(),
                 "recipe_rng": recipe.generator.get_state() if hasattr(recipe, "generator") else None, "losses": losses,
                 "evaluations": evaluations, "parts": parts}
        write_file(Path(opts.checkpoint), lambda tmp: torch.save(state, tmp))  # a crash mid-save keeps the last one

    recipe.module.train()
    smooth = None
    with StopSignals() as stop:
        while fraction() < 1.0 and stop.name is None:
            t0 = time.perf_counter()
            factor = lr_factor(fraction(), opts.warmup)
            for g in opt.param_groups:
                g["lr"] = opts.lr * factor
            batch = sampler.batch(opts.batch_size)
            tokens, first = batch if isinstance(batch, tuple) else (batch, None)  # [B, S], [B] or None
            tokens = tokens.to(opts.device)
            if hasattr(recipe, "progress"):
                recipe.progress = fraction()
            with _autocast(opts):
                loss = recipe.loss(tokens) if first is None else recipe.loss(tokens, first_anchor=first)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, opts.clip)
            opt.step()
            step += 1
            value = float(loss.detach())
            losses.append((step, value))
            if getattr(recipe, "loss_parts", None):
                parts.append((step, {k: float(v) for k, v in recipe.loss_parts.items()}))
            smooth = value if smooth is None else 0.9 * smooth + 0.1 * value
            rate = (step - start_step) / max(1e-9, elapsed + time.perf_counter() - t0 - start_elapsed)
            left = min((opts.steps - step) / max(rate, 1e-9), (opts.time_budget_s - elapsed) if opts.time_budget_s else math.inf)
            progress.update(step, smooth, opts.lr * factor, rate, max(0.0, left))
            if opts.eval_every and step % opts.eval_every == 0:
                evaluate()
            if opts.save_every and step % opts.save_every == 0:
                save()
            elapsed += time.perf_counter() - t0  # evaluations and checkpoints count: the budget is wall time
    if stop.name:
        save()  # first: a scheduler's hard kill may follow its stop signal
        say(f"{label}: {stop.name} at step {step} of {opts.steps}: the run ends here")
    if not evaluations or evaluations[-1][0] != step or opts.eval_decode_tokens:
        evaluate(final=True)
    save()
    return TrainResult(start_step, step, elapsed, losses, evaluations, parts, stop.name)


def _load_checkpoint(path, device) -> dict:
    """A training state written by `train`; a file that is not one is the user's to fix, not a traceback."""
    try:
        state = torch.load(path, map_location=device, weights_only=False)
    except Exception as exc:  # noqa: BLE001 - unpickling arbitrary bytes raises any kind of exception
        raise DraftflowError(f"--checkpoint {path}: not a readable training checkpoint ({type(exc).__name__}); "
                             "delete it or drop --resume to start afresh") from None
    if not isinstance(state, dict) or "module" not in state:
        raise DraftflowError(f"--checkpoint {path}: not a draftflow training checkpoint; drop --resume or pass the "
                             "run's own checkpoint")
    return state


# --- held-out acceptance -------------------------------------------------------------------------
def greedy_continuation(target: TargetModel, prefix: torch.Tensor, n: int, taps: tuple[int, ...]):
    """The target's greedy `n` tokens after `prefix`, and its taps over the prefix (inference code path)."""
    # prefix: [1, P]; returns ([n] int64, [1, P, n_taps*H])
    tokens, feats = greedy_continuations(target, prefix, n, taps)
    return tokens[0], feats


def greedy_continuations(target: TargetModel, prefixes: torch.Tensor, n: int, taps: tuple[int, ...]):
    """`greedy_continuation` for a batch of equal-length prefixes [B, P]: ([B, n] int64, [B, P, n_taps*H])."""
    cache = KVCache.from_static(torch.empty(static_shape(target.config, prefixes.shape[0], prefixes.shape[1] + n),
                                            dtype=target.norm.weight.dtype, device=prefixes.device))
    logits, feats = target(prefixes, 0, cache, logit_rows=1, tap_layers=taps)
    cache.commit(prefixes.shape[1])
    out = []
    for _ in range(n):
        tok = logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        out.append(tok)
        logits, _ = target(tok, cache.length, cache, logit_rows=1)
        cache.commit(cache.length + 1)
    return torch.cat(out, dim=1), feats


def _batched_prefixes(target: TargetModel, windows: list[torch.Tensor], n: int, taps: tuple[int, ...], rows: int = 32):
    """Per window (in order): its midpoint prefix [1, P], the target's greedy `n` tokens after it [n] and the taps over
    the prefix [1, P, *]; windows of one length run as batches of up to `rows` (one decode loop per batch)."""
    device = target.norm.weight.device
    out: list = [None] * len(windows)
    by_len: dict[int, list[int]] = {}
    for i, w in enumerate(windows):
        by_len.setdefault(w.numel(), []).append(i)
    for length, idx in by_len.items():
        p = max(2, length // 2)
        for lo in range(0, len(idx), rows):
            part = idx[lo:lo + rows]
            prefixes = torch.stack([windows[i][:p] for i in part]).to(device)  # [b, P]
            truth, feats = greedy_continuations(target, prefixes, n, taps)
            for j, i in enumerate(part):
                out[i] = (prefixes[j:j + 1], truth[j], feats[j:j + 1])
    return out


def estimate_acceptance(target: TargetModel, windows: list[torch.Tensor], taps: tuple[int, ...], num_draft: int,
                        propose: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor | dict[str, torch.Tensor]],
                        decode_tokens: int = 0) -> dict[str, float]:
    """Greedy agreement of drafts with the target's own continuation, one cycle per held-out window.

    The prefix ends at the window's midpoint (the anchor); `propose(prefix [1, P], taps [1, P, *], K)` returns
    the drafter's K tokens exactly as its graph node would. tau = 1 + mean accepted prefix length. `propose`
    may instead return several named draft sets from one forward (`{"": drafts, "top1": other}`); the numbers
    of a named set get its name as a suffix (`tau_top1`). `decode_tokens` > 0 adds `decode_acceptance`'s
    numbers (`tau_decode`, `acceptance_decode`).
    """
    accepted: dict[str, list[int]] = {}
    for prefix, truth, feats in _batched_prefixes(target, windows, num_draft, taps):
        drafted = propose(prefix, feats, num_draft)  # [K] or {name: [K]}
        for name, drafts in (drafted if isinstance(drafted, dict) else {"": drafted}).items():
            accepted.setdefault(name, []).append(_agreed(drafts, truth, num_draft))
    out = {}
    for name, counts in accepted.items():
        mean, suffix = sum(counts) / max(1, len(counts)), f"_{name}" if name else ""
        out |= {f"tau{suffix}": 1.0 + mean, f"acceptance{suffix}": mean / num_draft,
                f"first_token{suffix}": sum(a > 0 for a in counts) / max(1, len(counts))}
    out = out or {"tau": 1.0, "acceptance": 0.0, "first_token": 0.0}
    if decode_tokens:
        out |= decode_acceptance(target, windows, taps, num_draft, propose, decode_tokens)
    return out


def decode_acceptance(target: TargetModel, windows: list[torch.Tensor], taps: tuple[int, ...], num_draft: int,
                      propose: Callable, new_tokens: int) -> dict[str, float]:
    """tau as the runtime measures it: greedy speculative decoding of `new_tokens` from each window's midpoint.

    The one-cycle estimate drafts once per window, right after held-out text. A decode drafts again
    after every verdict, from anchors the target wrote, as `bench_humaneval` runs at T = 0 with a fixed
    K: each cycle offers min(K, tokens left - 1) drafts, accepts the longest prefix that matches the
    target's greedy continuation and emits one more token. tau = tokens / cycles over all windows;
    `acceptance_decode` = accepted drafts / offered drafts. A drafter returning named sets is decoded
    with its main set (`""`). The target's continuations are computed in batches (windows of one length).
    """
    device = target.norm.weight.device
    tokens = cycles = accepted = offered = 0
    for prefix, truth, _ in _batched_prefixes(target, windows, new_tokens + num_draft, taps):
        p = prefix.shape[1]
        seq = torch.cat([prefix, truth[None]], dim=1)  # [1, P + new_tokens + K]: what verification emits
        cache = KVCache.from_static(torch.empty(static_shape(target.config, 1, seq.shape[1]),
                                                dtype=target.norm.weight.dtype, device=device))
        _, feats = target(seq, 0, cache, logit_rows=1, tap_layers=taps)  # [1, len, n_taps * H]
        emitted = 0
        while emitted < new_tokens:
            anchor = p - 1 + emitted
            k = min(num_draft, new_tokens - emitted - 1)
            n = 0
            if k > 0:
                drafted = propose(seq[:, :anchor + 1], feats[:, :anchor + 1], num_draft)
                drafts = drafted[""] if isinstance(drafted, dict) else drafted
                n = _agreed(drafts, seq[0, anchor + 1:], k)
            emitted, cycles, accepted, offered = emitted + n + 1, cycles + 1, accepted + n, offered + k
        tokens += emitted
    return {"tau_decode": tokens / max(1, cycles), "acceptance_decode": accepted / max(1, offered)}


def _agreed(drafts: torch.Tensor, truth: torch.Tensor, k: int) -> int:
    """How many of the first `k` drafts match `truth` before the first mismatch."""
    n = 0
    while n < k and int(drafts[n]) == int(truth[n]):
        n += 1
    return n

"""Training windows the target wrote itself: `--labels regenerate`.

A drafter is scored at inference against the target's *own* continuation. Trained on raw
text with the target's greedy prediction at every position (`--labels target`), a block
row k >= 2 learns "what the target predicts after the text's token a+k-1", a context the
drafter never sees and that differs from the target's own chain wherever the target
disagrees with the text. Regenerated windows remove that mismatch (the DFlash paper trains
on target-regenerated responses): each window keeps its first P tokens of text and the
rest is the target's greedy continuation (or, with `--regen-temperature T`, a continuation
sampled at T: labels for drafters that will draft at T > 0), so every block anchored at or
after the last prompt token (`first_anchor` = P-1) has labels that are exactly the target's
chain from its anchor. P is drawn per generation batch from a range, so blocks see both long real
contexts (as right after a user's prompt) and long self-written ones (later in a reply).

With `body_share` > 0 that share of the windows start so that their prompt ends where a body
starts (`data.body_starts`: after a `def` / `class` header or a docstring), as a HumanEval prompt
ends, so the target writes a new body and the drafter trains on drafting one
(`--regen-body-share`; the shipped drafters decode such prompts at tau 2.0-2.9 against 3.6 on
packed file text, docs/TRAINING.md).

The pool is generated once, before training (batched greedy decoding through the target's
inference path), from seeded random starts in the training stream; held-out windows stay
raw text for the acceptance estimate (it computes the target's continuation itself); the
held-out *loss* is taken on held-out windows regenerated the same way (`held_out_loss`), so
it measures the objective being trained.

Generating the pool costs target decode steps (95 s for 65,536 demo windows on an H200; hours
for a large target), so `cache=FILE` keeps it: written once generated, and (with `reuse`) read back instead of
regenerating when its key still matches (window length, prompt lengths, window count, seed,
temperature, a fingerprint of the training stream and of the target's weights). The CLI keeps
it as `CHECKPOINT.regen.pt` and reads it under `--resume`, so a resumed run trains on the very
windows it started on without generating them again.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftflow.core.errors import DraftflowError
from draftflow.layers.kv_cache import KVCache, static_shape
from draftflow.plugins.target.model import TargetModel
from draftflow.tools.train.data import WindowSampler, body_starts


@torch.no_grad()
def regenerate(target: TargetModel, prompts: torch.Tensor, length: int, batch_size: int = 512,
               temperature: float = 0.0, seed: int = 0, prompt_lens: torch.Tensor | None = None) -> torch.Tensor:
    """`prompts` [N, P] followed by the target's tokens up to `length` positions: [N, length] int64.

    temperature 0: greedy; > 0: sampled from softmax(logits / temperature) with a generator seeded by `seed`
    (sampled labels, for drafters that will draft at T > 0). `prompt_lens` [N]: row i's prompt is only its first
    `prompt_lens[i]` tokens (ragged prompts in one batch: a row is fed its own prompt tokens until they run out,
    then the target's)."""
    n, p = prompts.shape
    lens = torch.full((n,), p, dtype=torch.long) if prompt_lens is None else prompt_lens.long().cpu()
    dev = target.norm.weight.device
    gen = torch.Generator(device=dev).manual_seed(seed) if temperature > 0 else None
    out = torch.empty(n, length, dtype=torch.long)
    out[:, :p] = prompts
    for lo in range(0, n, batch_size):
        rows, row_lens = prompts[lo:lo + batch_size].to(dev), lens[lo:lo + batch_size]  # [b, P], [b]
        start = int(row_lens.min())
        own = row_lens.to(dev)[:, None]  # [b, 1]
        cache = KVCache.from_static(torch.empty(static_shape(target.config, rows.shape[0], length),
                                                dtype=target.norm.weight.dtype, device=dev))
        logits, _ = target(rows[:, :start], 0, cache, logit_rows=1)
        cache.commit(start)
        written = []
        for pos in range(start, length):
            last = logits[:, -1].float()  # [b, V]
            if gen is None:
                tok = last.argmax(-1, keepdim=True)  # [b, 1]
            else:
                tok = torch.multinomial(torch.softmax(last / temperature, -1), 1, generator=gen)  # [b, 1]
            if pos < p:  # rows whose prompt is longer are fed their own token
                tok = torch.where(own > pos, rows[:, pos:pos + 1], tok)
            written.append(tok)
            if pos == length - 1:
                break
            logits, _ = target(tok, cache.length, cache, logit_rows=1)
            cache.commit(cache.length + 1)
        if written:
            out[lo:lo + rows.shape[0], start:] = torch.cat(written, dim=1).cpu()
    return out


class RegeneratedSampler:
    """Training batches `(tokens [B, S], first_anchor [B])` from a pool of regenerated windows; held-out windows
    from the raw text."""

    def __init__(self, base: WindowSampler, target: TargetModel, prompt_len: tuple[int, int], windows: int,
                 seed: int = 0, batch_size: int = 512, temperature: float = 0.0, cache: Path | None = None,
                 reuse: bool = True, body_share: float = 0.0, token_text: list[str] | None = None) -> None:
        # body_share: the share of windows whose prompt ends at a body start (needs token_text: each id's text)
        seq, (lo, hi) = base.seq_len, prompt_len
        if not 1 <= lo <= hi < seq:
            raise ValueError(f"prompt lengths {lo}..{hi} must lie in [1, {seq}) (the window length)")
        if body_share and token_text is None:
            raise ValueError("body_share needs token_text (the decoded text of every token id)")
        self.base, self.seq_len, self.target, self.prompt_len, self.seed = base, seq, target, (lo, hi), seed
        self.temperature, self.body_share, self.token_text = temperature, body_share, token_text
        self.generator = torch.Generator().manual_seed(seed)
        key = {"seq_len": seq, "prompt_len": [lo, hi], "windows": windows, "seed": seed, "temperature": temperature,
               "stream": _fingerprint([base.data.train]), "target": _fingerprint(target.parameters())}
        if body_share:  # (absent at 0: pools kept before this option still match)
            key["body_share"] = body_share
        note = _load(self, Path(cache), key) if cache is not None and reuse else ""
        self.reused, self.cache_note = note is None, note or ""  # cache_note: why a kept pool was not read back
        if self.reused:
            return
        self._generate(windows, batch_size)
        if cache is not None:
            from draftflow.tools.train.output import write_file

            state = {"key": key, "pool": self.pool.to(torch.int32), "first_anchor": self.first_anchor}
            write_file(Path(cache), lambda tmp: torch.save(state, tmp))

    def _generate(self, windows: int, batch_size: int) -> None:
        seq, (lo, hi), seed, temperature = self.seq_len, self.prompt_len, self.seed, self.temperature
        base, target = self.base, self.target
        pick = torch.Generator().manual_seed(seed + 29)
        stream = base.data.train
        bodies = torch.tensor(body_starts(stream, self.token_text) if self.body_share else [], dtype=torch.long)
        rows, firsts = [], []
        for start in range(0, windows, batch_size):
            n = min(batch_size, windows - start)
            p = int(torch.randint(lo, hi + 1, (1,), generator=pick))
            starts = torch.randint(0, stream.numel() - seq, (n,), generator=pick)
            if self.body_share:  # the first share of the rows: prompts ending at a body start
                ends = bodies[(bodies >= p - 1) & (bodies - p + 1 < stream.numel() - seq)]  # [E]
                if ends.numel() == 0:
                    raise DraftflowError(f"--regen-body-share {self.body_share:g}: the training text has no function "
                                         f"or class body start with {p - 1} tokens before it and a {seq}-token window "
                                         "after; give --data with Python sources, or drop --regen-body-share")
                m = round(self.body_share * n)
                starts[:m] = ends[torch.randint(0, ends.numel(), (m,), generator=pick)] - p + 1
            prompts = torch.stack([stream[s:s + p] for s in starts.tolist()])  # [n, P]
            rows.append(regenerate(target, prompts, seq, batch_size, temperature,
                                   seed=(seed * 1_000_003 + start) % 2**63))
            firsts.append(torch.full((n,), p - 1, dtype=torch.long))
        self.pool, self.first_anchor = torch.cat(rows), torch.cat(firsts)  # [N, S], [N]

    def batch(self, batch_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        # returns: [batch_size, seq_len] tokens, [batch_size] first anchor positions
        rows = torch.randint(0, self.pool.shape[0], (batch_size,), generator=self.generator)
        return self.pool[rows], self.first_anchor[rows]

    def held_out(self, count: int, length: int | None = None) -> list[torch.Tensor]:
        return self.base.held_out(count, length)

    def held_out_loss(self, count: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The held-out windows regenerated like the pool (held-out text prompts, the target's continuations) and
        their first anchors: `([N, S], [N])`; None when the held-out text is shorter than one window."""
        pick = torch.Generator().manual_seed(self.seed + 31)
        windows = [w for w in self.base.held_out(count) if w.numel() == self.seq_len]
        if not windows:
            return None
        lo, hi = self.prompt_len
        lens = torch.randint(lo, hi + 1, (len(windows),), generator=pick)  # [N]
        rows = regenerate(self.target, torch.stack(windows), self.seq_len, temperature=self.temperature,
                          seed=(self.seed + 37) % 2**63, prompt_lens=lens)  # one batch: ragged prompts
        return rows, lens - 1


def _fingerprint(tensors) -> list[float]:
    """A cheap identity of some tensors: per tensor, its size and the float64 sum of ~1000 strided elements (a
    different checkpoint or text stream changes it; equal ones give equal numbers)."""
    out = []
    for t in tensors:
        flat = t.detach().reshape(-1)
        out += [float(flat.numel()), float(flat[:: max(1, flat.numel() // 1000)].double().sum())]
    return out


def _load(sampler: RegeneratedSampler, cache: Path, key: dict) -> str | None:
    """Fill the sampler's pool from `cache` when the file holds one made under `key` (None); else why not ("" when
    there is no file)."""
    if not cache.is_file():
        return ""  # nothing kept yet: nothing to say
    try:
        state = torch.load(cache, map_location="cpu", weights_only=True)
        if state.get("key") != key:
            return f"{cache} was made another way"
        sampler.pool, sampler.first_anchor = state["pool"].long(), state["first_anchor"]
    except Exception as exc:  # noqa: BLE001  (a truncated or foreign file: generate again and rewrite it)
        return f"{cache} is unreadable ({type(exc).__name__})"
    return None

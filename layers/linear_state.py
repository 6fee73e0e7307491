"""Recurrent state of the Gated DeltaNet layers, with rollback by selection.

A KV cache rolls back by forgetting cells; a recurrent state cannot: after a partially
accepted verify window it must be exactly the state after the last accepted token. So a
verify window of T <= `max_window` tokens records the state after *every* window position
and `commit(n)` selects one (vLLM's and SGLang's scheme, see docs/HYBRID.md):

- recurrent: `rec[layer, 0]` is the committed state; a window writes the state after
  its position t into `rec[layer, t + 1]`; committing n tokens copies slot n to slot 0.
- conv: a tape `conv[layer, :, :, :K-1]` holds the last K-1 committed conv inputs; a
  window appends its T inputs after them, so the causal conv reads one contiguous slice,
  and committing n tokens keeps the K-1 inputs ending at window position n.

Longer windows (prefill chunks) keep only their final state in slot 1 and must be
committed whole. Forward passes never touch slot 0 or the tape's committed part, so a
window that is never committed (a probe, a rejected window) leaves no trace.

Every tensor has a batch dimension, one row per request slot, with its own committed
length and open window; `rows(a, b)` views a range of slots (a prefill, a batched step).
A pad row of a batch writes only candidate slots and the tape past the committed inputs,
so like a rejected window it leaves its slot's committed state as it was.

`mode="replay"` is the measured alternative (docs/HYBRID.md has the numbers): windows
journal the per-token recurrence inputs (k, v, g, beta) instead of states, and commit
re-runs the n accepted steps from slot 0. It keeps 2 state slots instead of 1+W.
"""

from __future__ import annotations

import torch

from draftflow.layers.config import TargetConfig
from draftflow.core.errors import CacheCapacityError

MODES = ("select", "replay")


def conv_shape(cfg: TargetConfig, batch: int, max_window: int) -> tuple[int, int, int, int]:
    """[linear layers, B, conv channels, K-1 + max(W, K-1)]: committed inputs, then one window's."""
    k = cfg.linear_conv_kernel - 1
    return (cfg.num_linear_layers, batch, cfg.linear_conv_dim, k + max(max_window, k))


def recurrent_shape(cfg: TargetConfig, batch: int, max_window: int, mode: str = "select") -> tuple[int, ...]:
    """[linear layers, slots, B, value heads, Dk, Dv] float32; slots = 1 + W (select) or 2 (replay).

    Slot 1 also receives a prefill chunk's final state, so replay keeps two slots, not one.
    """
    slots = 1 + max_window if mode == "select" else 2
    return (cfg.num_linear_layers, slots, batch, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
            cfg.linear_value_head_dim)


def journal_shape(cfg: TargetConfig, batch: int, max_window: int) -> tuple[int, ...]:
    """[linear layers, W, B, value heads, Dk + Dv + 2] float32: k, v, g, beta per window token (replay mode)."""
    return (cfg.num_linear_layers, max_window, batch, cfg.linear_num_value_heads,
            cfg.linear_key_head_dim + cfg.linear_value_head_dim + 2)


def state_bytes(cfg: TargetConfig, max_window: int, dtype: torch.dtype, mode: str = "select") -> int:
    """Bytes of every buffer a batch-1 LinearState holds (what the manifest declares)."""
    n = _numel(conv_shape(cfg, 1, max_window)) * dtype.itemsize + _numel(recurrent_shape(cfg, 1, max_window, mode)) * 4
    if mode == "replay":
        n += _numel(journal_shape(cfg, 1, max_window)) * 4
    return n


class LinearState:
    """Conv tapes and recurrent states of all linear-attention layers, one row per request slot.

    `lengths[b]` tokens are committed in row b. `rows(a, b)` is a view of rows [a, b) sharing
    the tensors and the per-row bookkeeping: a prefill runs on one slot's view, a batched
    step on `rows(0, n)`, and every method acts on the view's rows only.
    """

    def __init__(self, conv: torch.Tensor, rec: torch.Tensor, max_window: int, kernel_tail: int,
                 mode: str = "select", journal: torch.Tensor | None = None) -> None:
        # conv: [NL, B, C, K-1 + max(W, K-1)]; rec: [NL, 1+W or 2, B, Hv, Dk, Dv] float32
        # journal (replay mode): [NL, W, B, Hv, Dk + Dv + 2] float32
        if mode not in MODES:
            raise ValueError(f"linear-state mode {mode!r} is not one of {MODES}; pick one of them")
        self.conv, self.rec, self.journal = conv, rec, journal
        self.max_window, self.mode = max_window, mode
        self.kernel_tail = kernel_tail  # K-1 conv inputs carried between windows
        b = conv.shape[1]
        self._lo, self._hi = 0, b
        # Per row, shared by every view: committed length, (start, T) of the last forward, whether it recorded.
        self._lengths, self._windows, self._recorded = [0] * b, [None] * b, [False] * b
        self._root, self._views = self, {}

    @classmethod
    def allocate(cls, cfg: TargetConfig, batch: int, max_window: int, dtype: torch.dtype,
                 device: torch.device | str, mode: str = "select") -> LinearState:
        """A zeroed state for `batch` sequences and windows of up to `max_window` tokens."""
        conv = torch.zeros(conv_shape(cfg, batch, max_window), dtype=dtype, device=device)
        rec = torch.zeros(recurrent_shape(cfg, batch, max_window, mode), dtype=torch.float32, device=device)
        journal = torch.zeros(journal_shape(cfg, batch, max_window), device=device) if mode == "replay" else None
        return cls(conv, rec, max_window, cfg.linear_conv_kernel - 1, mode, journal)

    def rows(self, lo: int, hi: int) -> LinearState:
        """A view of rows [lo, hi) (slots) sharing tensors and bookkeeping; row 0 of the view = slot `lo`."""
        if not 0 <= lo < hi <= self.batch:
            raise ValueError(f"linear-state rows [{lo}, {hi}) are outside [0, {self.batch})")
        if (lo, hi) == (0, self.batch):
            return self
        root = self._root
        lo, hi = self._lo + lo, self._lo + hi
        view = root._views.get((lo, hi))
        if view is None:
            view = object.__new__(LinearState)
            view.conv, view.rec = root.conv[:, lo:hi], root.rec[:, :, lo:hi]
            view.journal = root.journal[:, :, lo:hi] if root.journal is not None else None
            view.max_window, view.mode, view.kernel_tail = root.max_window, root.mode, root.kernel_tail
            view._lo, view._hi, view._root, view._views = lo, hi, root, {}
            view._lengths, view._windows, view._recorded = root._lengths, root._windows, root._recorded
            root._views[(lo, hi)] = view
        return view

    @property
    def batch(self) -> int:
        return self._hi - self._lo

    @property
    def lengths(self) -> list[int]:
        """Committed tokens of each row (a copy)."""
        return self._lengths[self._lo:self._hi]

    @property
    def length(self) -> int:
        """The committed length, when every row has the same one (always so for one row)."""
        first = self._lengths[self._lo]
        if any(n != first for n in self._lengths[self._lo + 1:self._hi]):
            raise ValueError(f"the linear-state rows have different committed lengths {self.lengths}; read lengths[row]")
        return first

    @length.setter
    def length(self, value: int) -> None:  # benchmarks that fake a committed context
        for r in range(self._lo, self._hi):
            self._lengths[r] = value

    def reset(self) -> None:
        """Back to the empty prefix (zero conv inputs, zero recurrent state) in every row of this view."""
        self.conv[..., :self.kernel_tail].zero_()
        self.rec[:, 0].zero_()
        for r in range(self._lo, self._hi):
            self._lengths[r], self._windows[r] = 0, None

    def begin(self, start: int | list[int], tokens: int) -> bool:
        """Open a forward window of `tokens` at `start` (one per row, or one for all); return whether per-position
        states are recorded."""
        starts = [start] * self.batch if isinstance(start, int) else list(start)
        recorded = tokens <= self.max_window
        for r, s in zip(range(self._lo, self._hi), starts, strict=True):
            if s != self._lengths[r]:
                raise CacheCapacityError(
                    f"linear-attention forward at start_pos={s} but the recurrent state holds {self._lengths[r]} tokens; "
                    "a recurrent state cannot attend to an arbitrary prefix, so commit (or reset) to start_pos first"
                )
        for r, s in zip(range(self._lo, self._hi), starts):
            self._windows[r], self._recorded[r] = (s, tokens), recorded
        return recorded

    def commit(self, new_length: int, row: int | None = None) -> None:
        """Make `row` (None: every row of the view) describe its first `new_length` tokens: select (or replay)
        inside the last window."""
        rows = range(self.batch) if row is None else (row,)
        for r in rows:
            self._commit_row(r, new_length)

    def _commit_row(self, row: int, new_length: int) -> None:
        r = self._lo + row
        n = new_length - self._lengths[r]
        if n == 0:
            return
        start, tokens = self._windows[r] or (self._lengths[r], 0)
        recorded = self._recorded[r]
        if start != self._lengths[r] or not 0 < n <= tokens or (not recorded and n != tokens):
            raise CacheCapacityError(
                f"linear-state commit({new_length}) does not fall inside the last window "
                f"[{start}, {start + tokens}] (whole prefill chunks only); commit only positions a forward has computed"
            )
        k = self.kernel_tail
        conv, rec = self.conv[:, row], self.rec[:, :, row]  # [NL, C, ...], [NL, slots, Hv, Dk, Dv]
        if recorded:
            conv[..., :k] = conv[..., n:n + k].clone()
            if self.mode == "select":
                rec[:, 0] = rec[:, n]
            else:
                replay(rec[:, 0].unsqueeze(1), self.journal[:, :n, row:row + 1])
        else:  # prefill chunk: the forward left the final K-1 inputs right after the committed ones
            conv[..., :k] = conv[..., k:2 * k].clone()
            rec[:, 0] = rec[:, 1]
        self._lengths[r], self._windows[r] = new_length, None


def replay(state: torch.Tensor, journal: torch.Tensor) -> None:
    """Advance `state` in place through journaled steps, exactly as the window's recurrence did."""
    # state: [NL, B, Hv, Dk, Dv] float32; journal: [NL, n, B, Hv, Dk + Dv + 2]
    dk = state.shape[-2]
    s = state
    for t in range(journal.shape[1]):
        step = journal[:, t]
        s = delta_step(s, step[..., :dk], step[..., dk:-2], step[..., -2].exp(), step[..., -1])
    state.copy_(s)


def delta_step(s: torch.Tensor, k: torch.Tensor, v: torch.Tensor, decay: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """One gated delta-rule update: S <- a S + k (beta (v - a S^T k))^T."""
    # s: [..., Dk, Dv]; k: [..., Dk]; v: [..., Dv]; decay, beta: [...]
    s = s * decay[..., None, None]
    remembered = (k.unsqueeze(-2) @ s).squeeze(-2)  # [..., Dv]
    delta = (v - remembered) * beta[..., None]
    return s + k.unsqueeze(-1) * delta.unsqueeze(-2)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n

"""Per-layer key/value cache addressed by absolute token position, one row per request slot.

One tensor holds every layer: `[num_layers, 2, B, capacity, num_kv_heads, head_dim]`
(index 0 of dim 1 is K, 1 is V; row b of dim 2 is request slot b). Keeping positions on
dim 3 lets a window write be one slice assignment and lets attention read `[:, :end]`
without a copy.

`lengths[b]` is row b's committed prefix. Forward passes may write cells past it (a verify
window, or a pad row of a batch); rejecting drafted tokens is then just `crop` (or a
smaller `commit`), since cells past a row's length are never read before they are rewritten.
`rows(a, b)` is a view of rows [a, b) sharing the storage and the lengths: a prefill runs
on `rows(s, s + 1)` (one slot), a batched step on `rows(0, n)`.
"""

from __future__ import annotations

import torch

from draftflow.layers.config import TargetConfig
from draftflow.core.errors import CacheCapacityError


def static_shape(cfg: TargetConfig, batch: int, capacity: int) -> tuple[int, int, int, int, int, int]:
    """Shape of the one preallocated buffer a static cache wraps (full-attention layers only)."""
    return (cfg.num_kv_layers, 2, batch, capacity, cfg.num_kv_heads, cfg.head_dim)


class KVCache:
    """K/V storage for all layers, in `static` or `grow` mode.

    static: wraps a caller-owned buffer, never reallocates (shapes stay fixed for
    CUDA graphs / torch.compile). grow: allocates in `chunk_tokens` steps on demand up
    to `max_tokens`, for interactive use where the final length is unknown.
    """

    def __init__(self, buffer: torch.Tensor, mode: str, max_tokens: int, chunk_tokens: int) -> None:
        # buffer: [num_layers, 2, B, capacity, num_kv_heads, head_dim]
        self._buf = buffer
        self.mode = mode
        self.max_tokens = max_tokens
        self.chunk_tokens = chunk_tokens
        self._lengths = [0] * buffer.shape[2]  # committed length per row (shared with every view)
        self._root, self._lo, self._hi = self, 0, buffer.shape[2]
        self._views: dict[tuple[int, int], KVCache] = {}

    @classmethod
    def from_static(cls, buffer: torch.Tensor) -> KVCache:
        """Wrap one preallocated `[L, 2, B, capacity, KVH, D]` buffer (see `static_shape`)."""
        if buffer.dim() != 6 or buffer.shape[1] != 2:
            raise CacheCapacityError(
                f"static KV buffer has shape {tuple(buffer.shape)}; expected [num_layers, 2, batch, "
                "capacity, num_kv_heads, head_dim]; allocate it with static_shape(cfg, batch, capacity)"
            )
        return cls(buffer, "static", buffer.shape[3], buffer.shape[3])

    @classmethod
    def growing(
        cls,
        cfg: TargetConfig,
        batch: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
        chunk_tokens: int = 256,
    ) -> KVCache:
        """An empty cache that allocates `chunk_tokens` positions at a time, up to `max_tokens`."""
        empty = torch.empty(static_shape(cfg, batch, 0), dtype=dtype, device=device)
        return cls(empty, "grow", max_tokens, chunk_tokens)

    def rows(self, lo: int, hi: int) -> KVCache:
        """A view of rows [lo, hi) (slots): same storage, same committed lengths, row 0 of the view = slot `lo`."""
        if not 0 <= lo < hi <= self.batch:
            raise ValueError(f"KV cache rows [{lo}, {hi}) are outside [0, {self.batch}); the cache has {self.batch} rows")
        if (lo, hi) == (0, self.batch):
            return self
        root, lo, hi = self._root, self._lo + lo, self._lo + hi
        view = root._views.get((lo, hi))
        if view is None:
            view = object.__new__(KVCache)
            view.mode, view.max_tokens, view.chunk_tokens = root.mode, root.max_tokens, root.chunk_tokens
            view._root, view._lo, view._hi, view._views = root, lo, hi, {}
            view._buf = root._buf[:, :, lo:hi]
            root._views[(lo, hi)] = view
        return view

    @property
    def batch(self) -> int:
        return self._hi - self._lo

    @property
    def capacity(self) -> int:
        """Positions allocated right now (static: fixed; grow: a multiple of chunk_tokens)."""
        return self._root._buf.shape[3]

    @property
    def buffer(self) -> torch.Tensor:
        """The whole storage of these rows: [num_layers, 2, B, capacity, num_kv_heads, head_dim]."""
        root = self._root
        if root is not self and self._buf.shape[3] != root._buf.shape[3]:  # a grow-mode cache reallocated
            self._buf = root._buf[:, :, self._lo:self._hi]
        return self._buf

    @property
    def lengths(self) -> list[int]:
        """Committed length of each row (a copy)."""
        return self._root._lengths[self._lo:self._hi]

    @property
    def length(self) -> int:
        """The committed length, when every row has the same one (always so for one row)."""
        lengths = self._root._lengths
        first = lengths[self._lo]
        if self._hi - self._lo > 1 and any(n != first for n in lengths[self._lo + 1:self._hi]):
            raise ValueError(f"the KV cache rows have different committed lengths {self.lengths}; read lengths[row]")
        return first

    def ensure(self, total_tokens: int) -> None:
        """Make positions [0, total_tokens) writable, growing if allowed; raise past capacity."""
        root = self._root
        if total_tokens <= root.capacity:
            return
        if total_tokens > root.max_tokens:
            raise CacheCapacityError(
                f"KV cache ({root.mode}) needs {total_tokens} positions but holds at most "
                f"{root.max_tokens}; raise the cache capacity or shorten prompt + max_new_tokens"
            )
        # Round up to whole chunks so growth happens rarely; never pass max_tokens.
        chunks = -(-total_tokens // root.chunk_tokens)
        new_cap = min(chunks * root.chunk_tokens, root.max_tokens)
        shape = list(root._buf.shape)
        shape[3] = new_cap
        # zeros, not empty: a shorter row of a batch attends over the grown cells with weight 0, and 0 * NaN garbage
        # would be NaN
        grown = torch.zeros(shape, dtype=root._buf.dtype, device=root._buf.device)
        grown[:, :, :, : root.capacity] = root._buf
        root._buf = grown

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a window's keys and values at positions [start, start+T) of one layer, every row."""
        # k, v: [B, T, num_kv_heads, head_dim]
        end = start + k.shape[1]
        buf = self.buffer
        buf[layer, 0, :, start:end] = k
        buf[layer, 1, :, start:end] = v

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of keys and values at positions [0, end) of one layer (no copy)."""
        # returns k, v: [B, end, num_kv_heads, head_dim]
        buf = self.buffer
        return buf[layer, 0, :, :end], buf[layer, 1, :, :end]

    def commit(self, new_length: int, row: int | None = None) -> None:
        """Declare positions [0, new_length) valid in `row` (None: every row), e.g. after accepting a verify window."""
        if not 0 <= new_length <= self.capacity:
            raise CacheCapacityError(
                f"KV cache commit({new_length}) is outside [0, {self.capacity}]; "
                "commit only positions a forward pass has written"
            )
        for r in self._row_range(row):
            self._root._lengths[r] = new_length

    def crop(self, length: int, row: int | None = None) -> None:
        """Roll `row` (None: every row) back to its first `length` positions; cells past it are simply ignored."""
        rows = self._row_range(row)
        for r in rows:
            if not 0 <= length <= self._root._lengths[r]:
                raise CacheCapacityError(
                    f"KV cache crop({length}) is outside [0, {self._root._lengths[r]}] (the committed length); "
                    "crop can only shorten the cache"
                )
        for r in rows:
            self._root._lengths[r] = length

    def _row_range(self, row: int | None) -> range:
        if row is None:
            return range(self._lo, self._hi)
        if not 0 <= row < self.batch:
            raise ValueError(f"KV cache row {row} is outside [0, {self.batch})")
        return range(self._lo + row, self._lo + row + 1)

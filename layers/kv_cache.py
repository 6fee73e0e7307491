"""Per-layer key/value cache addressed by absolute token position.

One tensor holds every layer: `[num_layers, 2, B, capacity, num_kv_heads, head_dim]`
(index 0 of dim 1 is K, 1 is V). Keeping positions on dim 3 lets a window write be
one slice assignment and lets attention read `[:, :end]` without a copy.

`length` is the committed prefix. Forward passes may write cells past it (a verify
window); rejecting drafted tokens is then just `crop` (or a smaller `commit`), since
cells past `length` are never read before they are rewritten.
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
        self.length = 0

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

    @property
    def capacity(self) -> int:
        """Positions allocated right now (static: fixed; grow: a multiple of chunk_tokens)."""
        return self._buf.shape[3]

    @property
    def buffer(self) -> torch.Tensor:
        """The whole storage: [num_layers, 2, B, capacity, num_kv_heads, head_dim]."""
        return self._buf

    def ensure(self, total_tokens: int) -> None:
        """Make positions [0, total_tokens) writable, growing if allowed; raise past capacity."""
        if total_tokens <= self.capacity:
            return
        if total_tokens > self.max_tokens:
            raise CacheCapacityError(
                f"KV cache ({self.mode}) needs {total_tokens} positions but holds at most "
                f"{self.max_tokens}; raise the cache capacity or shorten prompt + max_new_tokens"
            )
        # Round up to whole chunks so growth happens rarely; never pass max_tokens.
        chunks = -(-total_tokens // self.chunk_tokens)
        new_cap = min(chunks * self.chunk_tokens, self.max_tokens)
        shape = list(self._buf.shape)
        shape[3] = new_cap
        grown = torch.empty(shape, dtype=self._buf.dtype, device=self._buf.device)
        grown[:, :, :, : self.capacity] = self._buf
        self._buf = grown

    def write(self, layer: int, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store a window's keys and values at positions [start, start+T) of one layer."""
        # k, v: [B, T, num_kv_heads, head_dim]
        end = start + k.shape[1]
        self._buf[layer, 0, :, start:end] = k
        self._buf[layer, 1, :, start:end] = v

    def read(self, layer: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Views of keys and values at positions [0, end) of one layer (no copy)."""
        # returns k, v: [B, end, num_kv_heads, head_dim]
        return self._buf[layer, 0, :, :end], self._buf[layer, 1, :, :end]

    def commit(self, new_length: int) -> None:
        """Declare positions [0, new_length) valid, e.g. after accepting a verify window."""
        if not 0 <= new_length <= self.capacity:
            raise CacheCapacityError(
                f"KV cache commit({new_length}) is outside [0, {self.capacity}]; "
                "commit only positions a forward pass has written"
            )
        self.length = new_length

    def crop(self, length: int) -> None:
        """Roll back to the first `length` positions; cells past it are simply ignored."""
        if not 0 <= length <= self.length:
            raise CacheCapacityError(
                f"KV cache crop({length}) is outside [0, {self.length}] (the committed length); "
                "crop can only shorten the cache"
            )
        self.length = length

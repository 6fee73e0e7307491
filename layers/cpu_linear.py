"""`F.linear` for float32 CPU tensors, through oneDNN with each weight packed once: one product, one fixed rule.

torch's CPU `F.linear` runs MKL's sgemm. On AMD EPYC CPUs MKL is slow at the shapes a
decode step and a verify window have: a one-row `[1, 384] x [384, 8192]` LM head took 791
µs against oneDNN's 156, a 16-row window 1.4-3x longer (`benchmarks/cpu_linear_backends.py`,
docs/BENCHMARKS.md). oneDNN (`torch.ops.mkldnn._linear_pointwise`) is faster still with its
weight already in oneDNN's blocked layout: called with a plain weight it reorders it on
every call. So an inference float32 CPU product packs its weight once
(`torch.ops.mkldnn._reorder_linear_weight`) and multiplies by the packed copy from then on,
one row too: small one-row products are a few µs slower than MKL's, but the whole decode step
measured faster, and at every demo target shape a packed product gives a row the same bits at
one row and in a 16-row window (MKL and plain oneDNN do not), so a verify window's products
repeat a step's.

The packed copies cost memory (as much again as the float32 weights they copy), so they stop
at `PACK_LIMIT_BYTES` per process; a product whose weight is not packed follows the rule of
before: oneDNN with the plain weight for a window or at least `ONEDNN_WEIGHTS` weights, else
`F.linear`. A packed copy is dropped when its weight is freed and rebuilt when the weight is
written in place (its version counter moves; a weight made under `torch.inference_mode` has none
and counts as never written).

The rule is fixed, not timed: a timed choice could differ between two runs and round one
prompt two ways. Autograd, other devices and dtypes go to `F.linear` unchanged. Without
oneDNN in the torch build everything goes to `F.linear`.

oneDNN builds a kernel for each (row count, weight shape) at its first product: about 0.5 ms
on a 2-core EPYC, against ~0.05-0.15 ms for the product itself once built. A speculative
request meets a new row count at every new verify width and context length, so its first run
paid ~30 ms more than the next (the demo pair, 64 tokens). Warm-ups therefore note the products
they run (`noting`) and build the kernels of the row counts a request will bring
(`build_kernels`): the target every verify width, the DFlash drafters every context length.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.nn.functional as F
from torch import nn

ONEDNN_WEIGHTS = 512 * 1024  # unpacked: one-row products with at least this many weights go to oneDNN
PACK_LIMIT_BYTES = 2 << 30  # packed copies per process, at most
BUILD_MAX_BYTES = 16 << 20  # build_kernels: weights up to this size (a larger one's product outweighs its kernel build)
HAS_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
HAS_PACKING = HAS_ONEDNN and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def takes_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` can take oneDNN: float32 on the CPU outside autograd, a contiguous weight, some rows."""
    return (HAS_ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32
            and weight.is_contiguous() and x.numel() > 0 and not (x.requires_grad or weight.requires_grad))


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether an unpacked `linear(x, weight)` takes oneDNN: a window or a large weight."""
    return takes_onednn(x, weight) and _window_or_large(x, weight)


def _window_or_large(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return x.numel() > x.shape[-1] or weight.numel() >= ONEDNN_WEIGHTS


def _version(weight: torch.Tensor) -> int | None:
    # An inference tensor (made under torch.inference_mode) has no version counter: taken as never written
    return None if weight.is_inference() else weight._version


class _Packs:
    """Packed copies, per base tensor (a parameter, or the storage owner of row-slice views) and view geometry."""

    def __init__(self) -> None:
        self.lock = threading.RLock()  # a weight freed by a collection inside `get` runs its drop callback here
        self.by_base: dict[int, tuple[weakref.ref, dict]] = {}
        self.bytes = 0

    def get(self, weight: torch.Tensor) -> torch.Tensor | None:
        base = weight if weight._base is None else weight._base
        key = (weight.storage_offset(), tuple(weight.shape))
        with self.lock:
            slot = self.by_base.get(id(base))
            if slot is not None and slot[0]() is not base:
                slot = None  # a dead base's id reused before its callback ran
            entry = None if slot is None else slot[1].get(key)
            version = _version(weight)
            if entry is not None and entry[0] == version:
                return entry[1]
            size = weight.numel() * weight.element_size()
            if entry is None and self.bytes + size > PACK_LIMIT_BYTES:
                return None
            if slot is None:
                slot = self.by_base[id(base)] = (weakref.ref(base, self._dropper(id(base))), {})
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            if entry is None:
                self.bytes += size
            slot[1][key] = (version, packed, size)
            return packed

    def _dropper(self, ident: int):
        def drop(ref: weakref.ref) -> None:
            with self.lock:
                slot = self.by_base.get(ident)
                if slot is not None and slot[0] is ref:
                    del self.by_base[ident]
                    self.bytes -= sum(entry[2] for entry in slot[1].values())
        return drop


PACKS = _Packs()


def packed_bytes() -> int:
    """Bytes of packed weight copies this process holds now."""
    return PACKS.bytes


_noted: dict | None = None  # while `noting`: the oneDNN products run, for `build_kernels`


def _onednn(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    # rows: [M, K]; weight: [N, K], plain or packed; returns [M, N]
    return torch.ops.mkldnn._linear_pointwise(rows, weight, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear(x, weight, bias)`: x [..., K], weight [N, K]; returns [..., N]."""
    if not takes_onednn(x, weight):
        return F.linear(x, weight, bias)
    packed = PACKS.get(weight) if HAS_PACKING else None
    if packed is None and not _window_or_large(x, weight):
        return F.linear(x, weight, bias)
    rows = x.reshape(-1, x.shape[-1])
    operand = weight if packed is None else packed
    if _noted is not None:
        key = (tuple(weight.shape), packed is not None, bias is not None)
        _noted.setdefault(key, (operand, bias, set()))[2].add(rows.shape[0])
    return _onednn(rows, operand, bias).view(*x.shape[:-1], weight.shape[0])


@contextlib.contextmanager
def noting() -> Iterator[dict]:
    """Note the oneDNN products run inside: yields {(weight shape, packed, biased): (weight operand, bias, {row
    counts})}, one entry per kernel kind (products with weights of one shape share oneDNN's kernels)."""
    global _noted
    outer, _noted = _noted, {}
    try:
        yield _noted
    finally:
        _noted = outer


def build_kernels(noted: dict, rows: Callable[[int], Iterable[int]]) -> int:
    """Build oneDNN's kernels now for the row counts a request will bring: each noted product runs once, on zeros, at
    every row count in `rows(m)` for each row count m it was noted at, but those it already ran at. Writes nothing
    a forward reads. Returns how many products ran.

    Only weights of at most BUILD_MAX_BYTES: the build (~0.5 ms) is worth moving out of a request where the product
    costs as much (the demo's 12.6 MB LM head: ~0.35 ms a row), not before a 600 MB head's ~30 ms products."""
    built = 0
    for (shape, _, _), (operand, bias, seen) in noted.items():
        if shape[0] * shape[1] * 4 > BUILD_MAX_BYTES:
            continue
        wanted = {int(r) for m in seen for r in rows(m) if r >= 1} - seen
        for r in sorted(wanted):
            _onednn(torch.zeros(r, shape[1], dtype=torch.float32), operand, bias)
            built += 1
        seen |= wanted
    return built


class Linear(nn.Linear):
    """`nn.Linear` whose forward is `linear`: same parameters and names, and still a module (forward hooks see it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)

"""Manifests: what a node declares about itself before anything is allocated.

A manifest is frozen attrs data computed from the node's parameters and the graph's
device/dtype. The static checks (``draftflow.core.checks``) read only manifests, so every
problem in a graph is found before a tensor exists.
"""

from __future__ import annotations

import math
import re
from typing import Any

import attrs
import torch

from draftflow.core.ports import PORT_TYPES

ROLES = ("target", "drafter", "selector", "verifier", "policy", "other")
LIFETIMES = ("persistent", "request", "cycle")
DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
}
# Symbolic dimensions resolved by the VRAM planner: the KV capacity in tokens per request ("kv_tokens", or
# "kv_tokens+N" for N cells of slack past it, e.g. a verify window's padding), and the request slots ("batch").
KV_TOKENS = "kv_tokens"
BATCH = "batch"
_KV_DIM = re.compile(r"^kv_tokens(?:\+(\d+))?$")


def kv_slack(dim) -> int | None:
    """N for a "kv_tokens+N" dimension (0 for "kv_tokens"); None when `dim` is not a KV dimension."""
    m = _KV_DIM.match(dim) if isinstance(dim, str) else None
    return None if m is None else int(m.group(1) or 0)


def kv_dim(slack: int = 0) -> str:
    """The shape entry for the planned KV capacity plus `slack` cells: "kv_tokens" or "kv_tokens+N"."""
    return KV_TOKENS if slack == 0 else f"{KV_TOKENS}+{slack}"
_NAME = re.compile(r"^[a-z_][a-z0-9_]*$")
_CAPABILITY = re.compile(r"^[a-z0-9_.>=<-]+$")


def _identifier(_inst, attribute, value):
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"{attribute.name} {value!r} must be a lowercase identifier like 'kv_cache'")


def _capabilities(_inst, attribute, value):
    for cap in value:
        if not isinstance(cap, str) or not _CAPABILITY.match(cap):
            raise ValueError(f"{attribute.name} entry {cap!r} is not a capability name like 'kv.grow'")


def _non_negative(_inst, attribute, value):
    if value is not None and (not isinstance(value, int) or value < 0):
        raise ValueError(f"{attribute.name} must be a non-negative integer of bytes, got {value!r}")


@attrs.frozen
class Port:
    """An input or output of a node. ``carried`` inputs read the previous cycle's value.

    ``auto`` (inputs): the planner wires the input from the one output of its type when the
    graph has exactly one. False on an optional input: only an explicit edge feeds it (one that
    most graphs leave open, like a block drafter's ``defer``, which auto-wiring would tie to any
    proposal, even the drafter's own mixer); a required input is always wired.
    """

    name: str = attrs.field(validator=_identifier)
    type: str = attrs.field(validator=attrs.validators.in_(tuple(PORT_TYPES)))
    required: bool = True
    carried: bool = False
    doc: str = ""
    auto: bool = True


@attrs.frozen
class BufferSpec:
    """A tensor a node owns: allocated by the executor from this description.

    ``shape`` entries are ints or symbols the planner resolves: ``"kv_tokens"`` (the KV capacity per
    request; ``"kv_tokens+N"`` adds N cells, ``kv_dim(N)``) and ``"batch"`` (the request slots,
    ``max_batch``: a per-request buffer puts it first and request r owns row ``r.slot``).
    ``preallocate=False`` marks a buffer the node grows itself (counted at its maximum).
    ``of_weights=True`` marks a view of the node's own weights (the target's embedding and LM
    head): declared so that readers and writers are checked, never allocated by the executor,
    its bytes already counted in ``Vram.weights``. The node puts the tensor into
    ``ctx.buffers`` under this name when it has loaded.
    """

    name: str = attrs.field(validator=_identifier)
    shape: tuple = attrs.field(converter=tuple)
    dtype: str = attrs.field(validator=attrs.validators.in_(tuple(DTYPES)))
    lifetime: str = attrs.field(default="persistent", validator=attrs.validators.in_(LIFETIMES))
    preallocate: bool = True
    doc: str = ""
    of_weights: bool = False

    @shape.validator
    def _check_shape(self, attribute, value):
        for dim in value:
            if not (dim == BATCH or kv_slack(dim) is not None or (isinstance(dim, int) and dim >= 0)):
                raise ValueError(f"buffer {self.name!r} dimension {dim!r} must be an int >= 0, {KV_TOKENS!r}, "
                                 f"'{KV_TOKENS}+N' or {BATCH!r}")

    @property
    def per_token(self) -> bool:
        """True when the buffer has a KV dimension (its size follows the planned capacity)."""
        return any(kv_slack(d) is not None for d in self.shape)

    def resolved_shape(self, kv_tokens: int | None, batch: int = 1) -> tuple[int, ...]:
        if self.per_token and kv_tokens is None:
            raise ValueError(f"buffer {self.name!r} needs a KV capacity that was not planned")
        out = []
        for d in self.shape:
            slack = kv_slack(d)
            out.append(batch if d == BATCH else d if slack is None else kv_tokens + slack)
        return tuple(out)

    def bytes_per_kv_token(self, batch: int = 1) -> int:
        """Bytes this buffer adds per token of KV capacity (0 if it has no kv_tokens dim)."""
        if not self.per_token:
            return 0
        dims = [batch if d == BATCH else 1 if kv_slack(d) is not None else d for d in self.shape]
        return math.prod(dims) * _itemsize(self.dtype)

    def nbytes(self, kv_tokens: int | None, batch: int = 1) -> int:
        return math.prod(self.resolved_shape(kv_tokens, batch)) * _itemsize(self.dtype)

    def fixed_bytes(self, batch: int = 1) -> int:
        """Bytes independent of the KV capacity: the whole buffer without a KV dim, else its slack cells."""
        return self.nbytes(0, batch) if self.per_token else self.nbytes(None, batch)


def _itemsize(dtype: str) -> int:
    return torch.empty((), dtype=DTYPES[dtype]).element_size()


@attrs.frozen
class Incompatibility:
    """This node cannot run in a graph where some node provides ``capability``."""

    capability: str
    reason: str


def _positive(_inst, attribute, value):
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen
class ExpertPool:
    """An elastic pool of equal-size experts (MoE) that the planner sizes from what the budget leaves.

    ``total`` experts exist (on the host); the planner makes ``resident`` of them device
    resident: ``pinned`` if given, else as many as fit after every node's weights, KV and
    scratch, capped by ``total``. Fewer than ``minimum`` is a plan error.
    """

    bytes_per_expert: int = attrs.field(validator=_positive)
    total: int = attrs.field(validator=_positive)
    minimum: int = attrs.field(default=1, validator=_positive)
    pinned: int | None = attrs.field(default=None, validator=_non_negative)


@attrs.frozen
class Vram:
    """Declared device memory. KV bytes come from buffers with a ``kv_tokens`` dimension.

    ``experts``: an elastic expert pool (MoE targets); its bytes are not in ``weights``.
    """

    weights: int = attrs.field(default=0, validator=_non_negative)
    scratch: int = attrs.field(default=0, validator=_non_negative)
    experts: ExpertPool | None = None


@attrs.frozen
class Manifest:
    """Everything the graph checks need to know about one node, before allocation."""

    role: str = attrs.field(validator=attrs.validators.in_(ROLES))
    inputs: tuple[Port, ...] = attrs.field(default=(), converter=tuple)
    outputs: tuple[Port, ...] = attrs.field(default=(), converter=tuple)
    owns: tuple[BufferSpec, ...] = attrs.field(default=(), converter=tuple)
    reads: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    writes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    vram: Vram = attrs.field(factory=Vram)
    provides: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset, validator=_capabilities)
    requires: frozenset[str] = attrs.field(default=frozenset(), converter=frozenset, validator=_capabilities)
    incompatible: tuple[Incompatibility, ...] = attrs.field(default=(), converter=tuple)
    # Upper bound of tokens the node can hold (target: context limit); None = unbounded.
    max_tokens: int | None = None
    # Role target: what checks may know of it before loading (draftflow.core.target.TargetInfo).
    target: Any = None

    def __attrs_post_init__(self):
        for group in ("inputs", "outputs", "owns"):
            names = [item.name for item in getattr(self, group)]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"{group} declares {', '.join(dup)} more than once")

    def input(self, name: str) -> Port | None:
        return next((p for p in self.inputs if p.name == name), None)

    def output(self, name: str) -> Port | None:
        return next((p for p in self.outputs if p.name == name), None)

    def kv_bytes_per_token(self, batch: int = 1) -> int:
        return sum(b.bytes_per_kv_token(batch) for b in self.owns if not b.of_weights)

    def fixed_buffer_bytes(self, batch: int = 1) -> int:
        return sum(b.fixed_bytes(batch) for b in self.owns if not b.of_weights)

"""The runtime side of a node: what the executor calls on each plugin's object.

The executor builds one ``Node`` per graph node (``NodeType.factory(ctx)``), then per
request calls ``prefill`` once and, per cycle, ``step`` in topological order followed by
``commit`` on every node. Values on ports are the classes in ``draftflow.core.ports``.
"""

from __future__ import annotations

from typing import Any, Iterable

import attrs
import torch

from draftflow.core.manifest import DTYPES, Manifest


@attrs.define
class NodeContext:
    """Everything a node is built from: validated params, its manifest and its buffers."""

    name: str
    params: dict
    manifest: Manifest
    device: torch.device
    dtype: torch.dtype
    num_draft: int
    kv_tokens: int | None
    buffers: dict[str, torch.Tensor]  # buffers this node owns, allocated from its manifest
    shared: dict[str, torch.Tensor]  # buffers it declared under ``reads`` (owned by others)
    graph_nodes: dict[str, Any] = attrs.field(factory=dict)  # name -> Node built so far (for binding, e.g. embeddings)
    resident_experts: int | None = None  # planned expert-cache size, for a node that declared Vram.experts


@attrs.define
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False


@attrs.define
class RequestState:
    """One request as the nodes see it. ``tokens`` = prompt + committed output; its last entry is the anchor."""

    request_id: str
    prompt_len: int
    tokens: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    num_draft: int = 0  # drafts wanted this cycle (already capped by the remaining budget)
    cycle: int = 0

    @property
    def position(self) -> int:
        """Sequence index of the anchor (the last committed token)."""
        return len(self.tokens) - 1

    @property
    def anchor(self) -> int:
        return self.tokens[-1]


@attrs.frozen
class CommitInfo:
    """What a cycle committed. After it, every node's state must describe ``req.tokens[:-1]`` plus the anchor."""

    position: int  # anchor position before the cycle
    num_draft: int
    accepted: int  # draft tokens accepted by the verifier
    emitted: tuple[int, ...]  # tokens appended to req.tokens (may be cut by EOS / max tokens)


class Node:
    """Base class for runtime nodes. Override what your node needs; defaults do nothing."""

    def __init__(self, ctx: NodeContext):
        self.ctx = ctx

    @property
    def name(self) -> str:
        return self.ctx.name

    def prefill(self, req: RequestState) -> dict[str, Any]:
        """Process the prompt (``req.tokens``); return values for carried output ports."""
        return {}

    def step(self, req: RequestState, inputs: dict[str, Any]) -> dict[str, Any]:
        """Run this node's part of one cycle; return values for its output ports."""
        return {}

    def commit(self, req: RequestState, info: CommitInfo) -> dict[str, Any]:
        """Roll state forward/back to ``req.tokens``; return new values for carried output ports."""
        return {}

    def tensors(self) -> Iterable[torch.Tensor]:
        """Tensors this node holds besides its owned buffers (for the memory check)."""
        return ()

    def cycle_fields(self) -> dict[str, Any]:
        """Extra fields for this cycle's ``draft_cycle`` event (JSON-able scalars), read after commit.

        Called once per cycle, outside the timed part; return what happened since the last
        call (e.g. the MoE target's expert-cache hits). Names must not repeat the core fields.
        """
        return {}


def torch_dtype(name: str) -> torch.dtype:
    return DTYPES[name]

"""The runtime side of a node: what the executor calls on each plugin's object.

The executor builds one ``Node`` per graph node (``NodeType.factory(ctx)``), then per
request calls ``prefill`` once and, per cycle, ``step`` in topological order followed by
``commit`` on every node. Values on ports are the classes in ``draftflow.core.ports``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Iterable

import attrs

from draftflow.core.errors import RequestError

if TYPE_CHECKING:  # torch stays unimported until a node is built: `generate` validates its flags first
    import torch

    from draftflow.core.manifest import Manifest


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
    resident_experts: int | None = None  # planned expert-cache size, for a node that declared Vram.experts
    # The loaded target (draftflow.core.target.TargetHandle), for a node whose manifest requires
    # "target.handle"; None otherwise. Targets are built first, so it is set at construction.
    target: Any = None
    # Request slots: at most this many requests are live at once; request `r` owns row `r.slot` of every
    # per-request buffer (a manifest dimension "batch" is allocated with this many rows).
    max_batch: int = 1
    # Ranks the target is sharded over (graph key tensor_parallel); a target plugin that shards joins the
    # process group through draftflow.layers.tensor_parallel.group(tensor_parallel, device).
    tensor_parallel: int = 1


MAX_SEED = 2**63 - 1  # torch.Generator.manual_seed takes a signed 64-bit integer
MAX_NEW_TOKENS = 2**31 - 1


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _check(ok, expected: str):
    """An attrs validator raising RequestError that names the field, its value and the valid range."""

    def validate(inst, attribute, value):
        if not ok(value):
            raise RequestError(f"sampling field '{attribute.name}' is {value!r}; it must be {expected}")

    return validate


def _is_number(value) -> bool:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    # An int past float range (10**400) is not a usable number; math.isfinite would raise OverflowError on it.
    return abs(value) < 1e308 if isinstance(value, int) else math.isfinite(value)


GRAMMAR_KINDS = ("json_object", "json_schema", "regex", "lark")
MAX_LOGPROBS = 20  # top alternatives per position, as the OpenAI API allows


@attrs.frozen
class GrammarSpec:
    """A constraint on the output: ``kind`` json_object (any JSON object), json_schema (``source``
    is the schema as JSON text), regex or lark (``source`` is the pattern / grammar text)."""

    kind: str = attrs.field(validator=_check(lambda v: v in GRAMMAR_KINDS, f"one of {', '.join(GRAMMAR_KINDS)}"))
    source: str = attrs.field(default="", validator=_check(lambda v: isinstance(v, str), "a string"))


def _logit_bias(value) -> tuple[tuple[int, float], ...]:
    """dict {token id: bias} (or pairs) -> sorted pairs; validated by the field's validator."""
    if isinstance(value, dict):
        value = value.items()
    try:
        return tuple(sorted((k, v) for k, v in value))
    except TypeError:
        raise RequestError(f"sampling field 'logit_bias' is {value!r}; it must map token ids to numbers") from None


@attrs.define
class SamplingParams:
    """How one request samples; every field is validated on construction and assignment (RequestError)."""

    temperature: float = attrs.field(default=0.0, validator=_check(lambda v: _is_number(v) and v >= 0,
                                                                   "a finite number >= 0 (0 = greedy)"))
    top_k: int = attrs.field(default=0, validator=_check(lambda v: _is_int(v) and v >= 0, "an integer >= 0 (0 = off)"))
    top_p: float = attrs.field(default=1.0, validator=_check(lambda v: _is_number(v) and 0 < v <= 1,
                                                             "a number in (0, 1] (1 = off)"))
    seed: int | None = attrs.field(default=None, validator=_check(lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_SEED),
                                                                  f"an integer in [0, {MAX_SEED}] or unset"))
    max_new_tokens: int = attrs.field(default=64, validator=_check(lambda v: _is_int(v) and 1 <= v <= MAX_NEW_TOKENS,
                                                                   f"an integer in [1, {MAX_NEW_TOKENS}]"))
    stop_token_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple,
                                                  validator=_check(lambda v: all(_is_int(t) and t >= 0 for t in v),
                                                                   "a list of token ids >= 0"))
    ignore_eos: bool = attrs.field(default=False, validator=_check(lambda v: isinstance(v, bool), "true or false"))
    # Logit processors, applied to the target's logits at every verified position given the prefix up to it
    # (drafts before it included); presence/frequency count output tokens (OpenAI), repetition prompt + output
    # (transformers/vLLM: positive logits divided by it, negative multiplied).
    presence_penalty: float = attrs.field(default=0.0, validator=_check(lambda v: _is_number(v) and -2 <= v <= 2,
                                                                        "a number in [-2, 2] (0 = off)"))
    frequency_penalty: float = attrs.field(default=0.0, validator=_check(lambda v: _is_number(v) and -2 <= v <= 2,
                                                                         "a number in [-2, 2] (0 = off)"))
    repetition_penalty: float = attrs.field(default=1.0, validator=_check(lambda v: _is_number(v) and 0 < v <= 100,
                                                                          "a number in (0, 100] (1 = off)"))
    logit_bias: tuple[tuple[int, float], ...] = attrs.field(
        default=(), converter=_logit_bias,
        validator=_check(lambda v: all(_is_int(k) and k >= 0 and _is_number(b) and -100 <= b <= 100 for k, b in v),
                         "a map of token ids >= 0 to numbers in [-100, 100]"))
    min_p: float = attrs.field(default=0.0, validator=_check(lambda v: _is_number(v) and 0 <= v <= 1,
                                                             "a number in [0, 1] (0 = off)"))
    logprobs: int | None = attrs.field(default=None, validator=_check(
        lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_LOGPROBS),
        f"an integer in [0, {MAX_LOGPROBS}] (alternatives per token) or unset (no logprobs)"))
    grammar: GrammarSpec | None = attrs.field(default=None, validator=_check(
        lambda v: v is None or isinstance(v, GrammarSpec), "a GrammarSpec or unset"))

    @property
    def has_processors(self) -> bool:
        """True when any logit processor besides temperature / top-k / top-p is on."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_p or self.grammar is not None)


@attrs.define
class RequestState:
    """One request as the nodes see it. ``tokens`` = prompt + committed output; its last entry is the anchor."""

    request_id: str
    prompt_len: int
    tokens: list[int]
    sampling: SamplingParams
    generator: torch.Generator
    num_draft: int = 0  # drafts wanted this cycle (already capped by the remaining budget and the cycle's K)
    cycle: int = 0
    slot: int = 0  # the row this request owns in every per-request buffer, in [0, max_batch)

    @property
    def position(self) -> int:
        """Sequence index of the anchor (the last committed token)."""
        return len(self.tokens) - 1

    @property
    def anchor(self) -> int:
        return self.tokens[-1]


@attrs.frozen(eq=False)
class Batch:
    """The requests one cycle steps. Row i of every ``[B, ...]`` tensor of the cycle is slot i.

    ``rows[i]`` is the request in slot i, or None for a slot this cycle does not step (free, or
    holding a request the caller left out): a node computes anything valid for such a row (a pad
    row; its output is ignored) and must not change that slot's committed state. ``size`` is
    the highest stepped slot + 1, so row i and slot i always agree and per-slot buffers are
    read as the view ``buffer[:size]`` (no gather). ``num_draft`` is this cycle's K: drafters
    return ``[size, K']`` proposals with K' <= K; row i wants ``rows[i].num_draft <= K`` drafts.
    """

    rows: tuple[RequestState | None, ...] = attrs.field(converter=tuple)
    num_draft: int = 0

    @property
    def size(self) -> int:
        return len(self.rows)

    def active(self) -> list[tuple[int, RequestState]]:
        """(row, request) for every stepped row, in slot order."""
        return [(i, r) for i, r in enumerate(self.rows) if r is not None]

    def draft_lengths(self) -> list[int]:
        """Drafts each row wants this cycle (0 for pad rows)."""
        return [r.num_draft if r is not None else 0 for r in self.rows]


@attrs.frozen
class CycleCost:
    """What one cycle cost, as a draft-length policy sees it (``Node.observe``; role "policy")."""

    batch: int  # requests stepped together
    num_draft: int  # the cycle's K
    draft_ms: float  # drafter and selector nodes (GPU time on CUDA)
    verify_ms: float  # target and verifier nodes
    cycle_ms: float  # wall time of the whole cycle: every node, the host sync, the commits
    emitted: int  # tokens emitted over all rows


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
        """Process a joining request's prompt (``req.tokens``) into slot ``req.slot``; return values for
        carried output ports (this request's)."""
        return {}

    def prefill_batch(self, reqs: list[RequestState]) -> list[dict[str, Any]]:
        """Several joining requests' ``prefill`` at once (a scheduler admitting many short prompts); one dict of
        carried values per request, in order. Default: ``prefill`` on each; the built-in target runs them as
        one batched forward."""
        return [self.prefill(req) for req in reqs]

    def prefill_chunk(self, req: RequestState, end: int) -> None:
        """Optional, for a node whose prefill is long (the target's forward over the prompt): bring slot
        ``req.slot`` to the prompt's first ``end`` tokens now, so that a long prompt joins a running batch
        in chunks between cycles. Called with growing ``end`` (< ``len(req.tokens) - 1``), then ``prefill(req)``
        does the rest and returns as usual. A node that ignores it does all its work in ``prefill``."""

    def step(self, batch: Batch, inputs: dict[str, Any]) -> dict[str, Any]:
        """Run this node's part of one cycle for every row of ``batch``; return values for its output ports.

        Values on ports are batched: row i of each tensor is ``batch.rows[i]`` (slot i). A carried
        input arrives as a list with one value per row (the value that row's request carried, None
        for pad rows).
        """
        return {}

    def commit(self, req: RequestState, info: CommitInfo) -> dict[str, Any]:
        """Roll slot ``req.slot`` forward/back to ``req.tokens``; return this request's new carried values.

        Called once per stepped request, after the cycle's one host sync."""
        return {}

    def release(self, req: RequestState) -> None:
        """The request left (finished, cancelled or replaced): drop what the node keeps for it. Its slot
        may be handed to a new request, whose ``prefill`` comes next."""

    def choose_draft(self, batch: Batch) -> int:
        """Role "policy" only: K for this cycle, in [0, batch.num_draft] (the most any row may draft now).

        Called before any node steps; the rows' ``num_draft`` are then capped at the answer (0: no
        drafting this cycle). The policy learns acceptance from ``commit`` and cost from ``observe``.
        """
        return batch.num_draft

    def observe(self, cost: CycleCost) -> None:
        """Role "policy" only: what the cycle just committed cost (after every row's ``commit``)."""

    def warmup(self) -> None:
        """Pay once, at load, what the first request would otherwise pay: compile kernels, capture the
        CUDA graphs a request will need. Called by ``Executor.warmup`` after every node is built,
        outside any request and before timing starts; must leave no request state behind."""

    def target_handle(self):
        """Role target only: the ``draftflow.core.target.TargetHandle`` for the loaded model."""
        return None

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
    from draftflow.core.manifest import DTYPES

    return DTYPES[name]

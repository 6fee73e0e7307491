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

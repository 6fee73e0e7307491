"""One decision per cycle on a tensor-parallel target: rank 0 runs the requests, every other rank mirrors it.

Every rank builds the same plan and executor: the target sharded (draftflow.layers.tensor_parallel),
drafters, verifier and policy replicated. Rank 0's executor is a ``Leader``: each public call
(``start``, ``prefill_step``, ``prefill_many``, ``step``, ``finish``) is broadcast to the other ranks
before it runs, so ``generate``, ``serve`` and library callers drive rank 0 exactly as they drive a
plain executor. The other ranks run ``follow``: the same calls in the same order, so every collective
inside the target meets its peers with the same shapes.

Within a cycle, three things are rank 0's on every rank, broadcast where they arise:

1. the policy's K (a policy may time the cycle, and timings differ per rank), in ``Executor.step``;
2. the drafts the target verifies, in the target's ``step`` (a replicated drafter's float results may
   differ in the last bit between GPUs, and a sampled draft uses a rank's own generator);
3. the packed verdicts (accepted counts, emitted tokens, logprobs) before the host reads them
   (``read_verdicts``), so every rank commits exactly the tokens rank 0 emitted.

Everything else a rank decides on the host follows from its calls and the committed tokens, which are
now the same everywhere; so the ranks cannot diverge, and a follower's own draws never reach the output.
"""

from __future__ import annotations

import functools
import itertools
from typing import Any

import attrs
import structlog

from draftflow.core.errors import FollowerDone  # noqa: F401 (raised by Session.open on followers)
from draftflow.core.executor import Executor
from draftflow.core.request import ActiveRequest

log = structlog.get_logger("draftflow")
MIRRORED = ("start", "prefill_step", "prefill_many", "step", "finish")
CLOSE = "close"


@attrs.frozen
class Ref:
    """A request in a mirrored call: the n-th ``start`` of the session (the same count on every rank)."""

    serial: int


def _encode(value: Any, refs: dict[int, tuple[int, ActiveRequest]]) -> Any:
    if isinstance(value, ActiveRequest):
        return Ref(refs[id(value)][0])
    if isinstance(value, (list, tuple)):
        return type(value)(_encode(v, refs) for v in value)
    return value


def _decode(value: Any, states: dict[int, ActiveRequest]) -> Any:
    if isinstance(value, Ref):
        return states[value.serial]
    if isinstance(value, (list, tuple)):
        return type(value)(_decode(v, states) for v in value)
    return value


def _mirrored(name: str):
    base = getattr(Executor, name)

    @functools.wraps(base)
    def call(self: Leader, *args, **kwargs):
        if self._inside:  # a call made by another mirrored call (start -> prefill_step): the followers make it too
            return base(self, *args, **kwargs)
        serial = next(self._serials) if name == "start" else None
        self.tp.broadcast_object((name, _encode(args, self._refs), _encode(kwargs, self._refs)))
        self._inside = True
        try:
            out = base(self, *args, **kwargs)
        finally:
            self._inside = False
            if name == "finish":
                self._refs.pop(id(args[0] if args else kwargs["state"]), None)
        if serial is not None:
            self._refs[id(out)] = (serial, out)
        return out

    return call


class Leader(Executor):
    """Rank 0's executor: every public call is mirrored to the other ranks before it runs (see the module doc)."""

    def __init__(self, plan, hook=None, debug: bool | None = None):
        super().__init__(plan, hook, debug)
        self._inside = False
        self._serials = itertools.count()
        self._refs: dict[int, tuple[int, ActiveRequest]] = {}  # id(state) -> (serial, state) of live requests
        self._closed = False

    start = _mirrored("start")
    prefill_step = _mirrored("prefill_step")
    prefill_many = _mirrored("prefill_many")
    step = _mirrored("step")
    finish = _mirrored("finish")

    def close(self) -> None:
        """Release the followers (their ``Session.open`` raises FollowerDone). Idempotent."""
        if not self._closed:
            self._closed = True
            self.tp.broadcast_object((CLOSE, (), {}))


def make_executor(plan, hook=None) -> Executor:
    """The executor of this rank: a ``Leader`` on rank 0 of a tensor-parallel plan, else a plain one."""
    if plan.spec.tensor_parallel == 1:
        return Executor(plan, hook=hook)
    from draftflow.layers.tensor_parallel import group

    leader = group(plan.spec.tensor_parallel, plan.spec.device).is_leader
    return Leader(plan, hook=hook) if leader else Executor(plan, hook=hook)


def follow(executor: Executor) -> None:
    """Run rank 0's calls on this rank until rank 0 closes its session.

    A call that fails here failed on rank 0 too (same call, same state): rank 0 reports it; the follower
    goes on with the next call, as rank 0's caller does.
    """
    states: dict[int, ActiveRequest] = {}
    serials = itertools.count()
    while True:
        name, args, kwargs = executor.tp.broadcast_object()
        if name == CLOSE:
            return
        serial = next(serials) if name == "start" else None
        try:
            args, kwargs = _decode(args, states), _decode(kwargs, states)
            out = getattr(executor, name)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - rank 0 raised it as well and reports it
            log.debug("mirrored_call_failed", call=name, error=f"{type(exc).__name__}: {exc}")
            out = None
        if name == "finish":
            done = args[0] if args else kwargs.get("state")
            states = {k: v for k, v in states.items() if v is not done}
        elif serial is not None and out is not None:
            states[serial] = out


def rank_spec(spec):
    """The graph as this rank runs it: the process group joined (from torchrun's or ``--tp``'s environment; one
    line naming the launcher when there is none) and a CUDA device made this rank's local GPU."""
    from draftflow.layers.tensor_parallel import group, rank_device

    device = rank_device(spec.device)
    group(spec.tensor_parallel, device)
    return attrs.evolve(spec, device=device)

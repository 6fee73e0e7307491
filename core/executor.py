"""The executor: allocates owned buffers from manifests, then runs draft -> verify -> commit cycles.

The schedule is the plan's topological order over non-carried edges; nothing here knows
what a drafter or a target is beyond its role (used only to attribute timings).
Per cycle there is one host synchronisation: reading the verifier's verdict together
with the drafts, packed into a single transfer.

A request runs through the step API: ``start`` (validate, seed, take a free request slot,
prefill every node), ``step`` (one cycle for any set of live requests, batched: row i of
every tensor is slot i, ``Batch``; a ``CycleResult`` each) until a result has a ``finish``,
then ``finish`` (the ``Result``, the ``request_done`` event, the slot freed). ``generate``
is that loop for one request; the server steps every live request together, admits new
ones between cycles, streams, cuts at stop strings and cancels. Trace sinks only observe
the events.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import structlog
import torch

from draftflow.core.errors import ModelFormatError
from draftflow.core.manifest import DTYPES
from draftflow.core.node import Batch, CommitInfo, CycleCost, Node, NodeContext, SamplingParams
from draftflow.core.plan import GraphPlan
from draftflow.core.request import ActiveRequest, CycleResult, CycleTimer, Result, TokenLogprob, active_processors
from draftflow.core.request_checks import buffer_versions, check_finite, check_writes, validate_request
from draftflow.core.verdicts import cut_at_stop, read_verdicts
from draftflow.core.target import TARGET_HANDLE, TargetHandle
from draftflow.core.tracing import emit_cycle, emit_request

__all__ = ["ActiveRequest", "CycleResult", "Executor", "Result", "TokenLogprob"]
log = structlog.get_logger("draftflow")
MEMORY_TOLERANCE = 1.10  # measured more than 10% over the declared estimate -> warning
DRAFT_ROLES = ("drafter", "selector")


class Executor:
    """Runs requests through a checked plan. Build once (``load_s``), ``warmup`` once, then run many requests."""

    def __init__(self, plan: GraphPlan, hook=None, debug: bool | None = None):
        plan.raise_if_problems()
        self.plan = plan
        self.hook = hook
        self.debug = plan.spec.debug if debug is None else debug
        self.device = torch.device(plan.spec.device)
        self.dtype = DTYPES[plan.spec.dtype]
        self.order = list(plan.order)
        self.roles = {n: plan.nodes[n].manifest.role for n in self.order}
        self.verifier = next(n for n in self.order if self.roles[n] == "verifier")
        self.target = next(n for n in self.order if self.roles[n] == "target")
        self.policy = next((n for n in self.order if self.roles[n] == "policy"), None)  # chooses each cycle's K
        self.tp = None  # tensor_parallel > 1: the rank group; rank 0's decisions are every rank's (core/mirror.py)
        if plan.spec.tensor_parallel > 1:
            from draftflow.layers.tensor_parallel import group

            self.tp = group(plan.spec.tensor_parallel, plan.spec.device)
        self.kv_tokens = plan.vram.kv_tokens if plan.vram else None
        self.max_batch = plan.vram.batch if plan.vram else 1  # request slots
        self.owned: dict[str, dict[str, torch.Tensor]] = {}
        self.nodes: dict[str, Any] = {}
        self.measured: dict[str, int] = {}
        self.warnings: list[str] = []
        began = time.perf_counter()
        self._allocate()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # weights uploaded, not merely queued
        self.load_s = round(time.perf_counter() - began, 6)  # building every node: weights, buffers
        self.warmup_s: float | None = None  # set by warmup()
        self._timer = CycleTimer(self.device)
        self._slots: list[ActiveRequest | None] = [None] * self.max_batch  # slot -> its live request
        # Nodes that add fields to the cycle event (override Node.cycle_fields): asked once per cycle.
        self.field_nodes = [n for n in self.order if type(self.nodes[n]).cycle_fields is not Node.cycle_fields]

    # --- allocation ---------------------------------------------------------------------
    def _allocate(self) -> None:
        # Every owned buffer first, so a node may read a buffer whose owner runs after it.
        for name in self.order:
            m = self.plan.nodes[name].manifest
            self.owned[name] = {b.name: torch.zeros(b.resolved_shape(self.kv_tokens, self.max_batch), dtype=DTYPES[b.dtype], device=self.device)
                                for b in m.owns if b.preallocate and not b.of_weights}
        # The target is built first: its handle and weight buffers (embedding, LM head) exist for every other node.
        self.handle = None
        counted: set[int] = set()  # storages already charged to a node (a drafter reading the target's head is not charged)
        for name in sorted(self.order, key=lambda n: self.roles[n] != "target"):
            resolved = self.plan.nodes[name]
            m = resolved.manifest
            owned = self.owned[name]
            all_buffers = {b: t for bufs in self.owned.values() for b, t in bufs.items()}
            before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
            experts = self.plan.vram.experts if self.plan.vram is not None else None
            ctx = NodeContext(name=name, params=resolved.params, manifest=m, device=self.device, dtype=self.dtype,
                              num_draft=self.plan.spec.num_draft, kv_tokens=self.kv_tokens, buffers=owned,
                              shared={b: all_buffers[b] for b in m.reads if b in all_buffers},
                              resident_experts=experts.resident if experts is not None and experts.node == name else None,
                              target=self.handle if TARGET_HANDLE in m.requires else None, max_batch=self.max_batch,
                              tensor_parallel=self.plan.spec.tensor_parallel)
            self.nodes[name] = resolved.node_type.factory(ctx)
            if name == self.target:
                self.handle = self._target_handle(name)
            seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in owned.values()}
            if self.device.type == "cuda":
                measured = sum(seen.values()) + torch.cuda.memory_allocated(self.device) - before
            else:
                for t in self.nodes[name].tensors():
                    if t.untyped_storage().data_ptr() not in counted:
                        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                measured = sum(seen.values())
            counted.update(seen)
            self.measured[name] = measured
            declared = next(r for r in self.plan.vram.rows if r.node == name).total
            if measured > declared * MEMORY_TOLERANCE and measured - declared > 1 << 20:
                msg = (f"node '{name}' ({resolved.node_type.name}) uses {measured} bytes, "
                       f"{measured / max(declared, 1):.2f}x its declared {declared}; fix the plugin's VRAM estimate")
                self.warnings.append(msg)
                log.warning("vram_estimate_exceeded", node=name, plugin=resolved.node_type.name, measured=measured, declared=declared)

    def warmup(self) -> float:
        """Pay once, before any request, what the first one would: ``Node.warmup`` on every node, targets first.

        Idempotent (the second call returns the recorded time). Returns ``warmup_s``.
        """
        if self.warmup_s is None:
            self._drop_all()  # a node may use its request state to warm up
            began = time.perf_counter()
            for name in sorted(self.order, key=lambda n: self.roles[n] != "target"):
                self.nodes[name].warmup()
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            self.warmup_s = round(time.perf_counter() - began, 6)
        return self.warmup_s

    def _target_handle(self, name: str) -> TargetHandle:
        handle = self.nodes[name].target_handle()
        if not isinstance(handle, TargetHandle):
            plugin = self.plan.nodes[name].node_type.name
            raise ModelFormatError(f"node '{name}' ({plugin}) is the graph's target but its target_handle() returned "
                                   f"{type(handle).__name__}; a target plugin must return a draftflow.plugin.TargetHandle")
        missing = [b.name for b in self.plan.nodes[name].manifest.owns if b.of_weights and b.name not in self.owned[name]]
        if missing:
            raise ModelFormatError(f"node '{name}' declared weight buffers {missing} but did not put them into ctx.buffers; "
                                   "fix the target plugin")
        return handle

    # --- request ------------------------------------------------------------------------
    # Up to max_batch requests are live at once, one per slot; `start` prefills a free slot (the others are
    # untouched) and `finish` frees it. A failed cycle invalidates every live request (the nodes hold a
    # half-run cycle); a failed prefill only the joining one.
    @property
    def free_slots(self) -> int:
        """Request slots a `start` may take now."""
        return self._slots.count(None)

    def live(self) -> list[ActiveRequest]:
        """The started, unfinished requests, in slot order."""
        return [r for r in self._slots if r is not None]

    def start(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
              request_id: str | None = None, defer_prefill: bool = False) -> ActiveRequest:
        """Validate and seed a request, take a free slot and prefill every node with its prompt; `step` drafts from there.

        ``defer_prefill``: take the slot but leave the prompt to ``prefill_step``, which a scheduler calls
        between cycles with a token budget, so that a long prompt does not stall the running requests.
        """
        sampling = sampling or SamplingParams()
        prompt_ids = list(prompt_ids)
        validate_request(prompt_ids, sampling, self.handle.vocab_size, self.kv_tokens)
        if None not in self._slots:
            raise RuntimeError(f"all {self.max_batch} request slots are busy; finish a request first (free_slots is 0) "
                               "or raise the graph's max_batch")
        gen = torch.Generator(device=self.device)
        gen.manual_seed(sampling.seed if sampling.seed is not None else int(torch.seed() % (2**63)))
        eos = () if sampling.ignore_eos else self.handle.eos_ids
        state = ActiveRequest(request_id or uuid.uuid4().hex[:12], len(prompt_ids), list(prompt_ids), sampling, gen,
                              stops=frozenset(eos) | frozenset(sampling.stop_token_ids), started=time.perf_counter())
        state.slot = self._slots.index(None)
        state.ready = False
        self._slots[state.slot] = state
        if not defer_prefill:
            self.prefill_step(state)
        return state

    def prefill_step(self, state: ActiveRequest, budget: int | None = None) -> int:
        """Prefill up to ``budget`` more prompt tokens of a request (None: all); returns how many it processed.

        Every node's ``prefill_chunk`` takes the pieces; once the rest fits the budget, every node's
        ``prefill`` runs and the request is ready (``state.ready``; ``step`` takes it). A failure frees
        the slot (the running requests keep theirs) and propagates.
        """
        self._check_prefilling(state)
        left = len(state.tokens) - 1 - state.prefilled
        if budget is None or left <= budget:
            self._prefill_group([state])
            return left
        if state.prefilled == 0:
            state.prefill_marks = (self._timer.start(), None)
        end = state.prefilled + max(budget, 1)
        try:
            for name in self.order:
                self.nodes[name].prefill_chunk(state, end)
        except BaseException:
            self._release(state)
            raise
        done, state.prefilled = end - state.prefilled, end
        return done

    def prefill_many(self, states: list[ActiveRequest], budget: int | None = None) -> int:
        """Prefill joining requests in order within ``budget`` prompt tokens (None: all); returns how many.

        Those whose rest fits go together, one ``prefill_batch`` per node (the target: one batched
        forward); the first that does not fit gets a ``prefill_step`` chunk of what is left of the
        budget, and the rest wait. A failure frees every slot of the group and propagates.
        """
        group, used = [], 0
        for state in states:
            left = len(state.tokens) - 1 - state.prefilled
            if budget is not None and used + left > budget:
                if used < budget:
                    used += self.prefill_step(state, budget - used)
                break
            group.append(state)
            used += left
        if len(group) == 1:
            self.prefill_step(group[0])
        elif group:
            self._prefill_group(group)
        return used

    def _check_prefilling(self, state: ActiveRequest) -> None:
        if state.ready or self._slots[state.slot] is not state:
            raise ValueError(f"request {state.request_id!r} is not waiting for its prefill; step it or start it again")

    def _prefill_group(self, group: list[ActiveRequest]) -> None:
        """The rest of each request's prompt: one ``prefill_batch`` per node; the requests are then ready."""
        for state in group:
            self._check_prefilling(state)
            if state.prefilled == 0:
                state.prefill_marks = (self._timer.start(), None)
        try:
            for name in self.order:
                for state, values in zip(group, self.nodes[name].prefill_batch(group), strict=True):
                    for port, value in (values or {}).items():
                        state.carried[(name, port)] = value
        except BaseException:
            for state in group:
                self._release(state)
            raise
        end = self._timer.start()
        for state in group:
            state.prefill_marks = (state.prefill_marks[0], end)
            state.prefilled, state.ready = len(state.tokens) - 1, True

    def step(self, states: list[ActiveRequest]) -> list[CycleResult]:
        """Run one draft -> verify -> accept -> commit cycle for all ``states`` at once; one host sync in all.

        Emits one ``draft_cycle`` event per state after every state has committed. A trace sink
        only observes: an exception it raises propagates, but the cycle is already committed, so
        the requests stay consistent and may be stepped on or finished.
        """
        self._check_states(states)
        began = time.perf_counter()
        k = self.plan.spec.num_draft
        for req in states:  # never draft past the token budget: a cycle emits at most num_draft + 1 tokens
            req.num_draft = max(0, min(k, req.sampling.max_new_tokens - len(req.generated) - 1))
        rows: list[ActiveRequest | None] = [None] * (max(r.slot for r in states) + 1)
        for req in states:
            rows[req.slot] = req
        batch = Batch(rows, max(r.num_draft for r in states))
        if self.policy is not None and batch.num_draft:
            chosen = self.nodes[self.policy].choose_draft(batch)
            if self.tp is not None:  # a policy may time the cycle, which differs per rank: rank 0 decides
                chosen = self.tp.broadcast_object(chosen)
            if not isinstance(chosen, int) or isinstance(chosen, bool) or not 0 <= chosen <= batch.num_draft:
                node = self.plan.nodes[self.policy].node_type.name
                raise ModelFormatError(f"node '{self.policy}' ({node}) chose K={chosen!r}; a policy's choose_draft must "
                                       f"return an integer in [0, {batch.num_draft}]")
            for req in states:  # a seeded sampled request keeps the graph's K: its draws never depend on the load
                if req.sampling.seed is None or req.sampling.temperature == 0:
                    req.num_draft = min(req.num_draft, chosen)
            batch = Batch(rows, max(r.num_draft for r in states))
        try:
            values = self._run_nodes(batch)
            agree = self.tp.broadcast if self.tp is not None else None  # every rank commits rank 0's verdicts
            verdicts = read_verdicts(self.plan, self.verifier, batch, values, agree)  # the cycle's one host sync
        except BaseException:
            self._drop_all()  # the nodes hold a half-run cycle: only new starts may follow
            raise
        times = self._timer.totals_ms()  # node timings of the whole cycle (CUDA events are complete after the sync)
        draft_ms = round(sum(times.get(r, 0.0) for r in DRAFT_ROLES), 4)
        verify_ms = round(times.get("target", 0.0) + times.get("verifier", 0.0), 4)
        fields: dict[str, Any] = {}
        for name in self.field_nodes:  # node-contributed fields (docs/TRACING.md), once per cycle
            for key, value in self.nodes[name].cycle_fields().items():
                fields.setdefault(key, value)
        results = []
        for req in states:
            accepted, emitted, draft, logprobs = verdicts[req.slot]
            position, anchor = req.position, req.anchor
            cut = cut_at_stop(req, emitted)
            req.tokens.extend(cut)
            req.generated.extend(cut)
            if logprobs is not None:
                logprobs = tuple(logprobs[:len(cut)])
                req.logprobs.extend(logprobs)
            t0 = time.perf_counter()
            info = CommitInfo(position, len(draft), accepted, tuple(cut))
            try:
                for name in self.order:
                    for port, value in (self.nodes[name].commit(req, info) or {}).items():
                        req.carried[(name, port)] = value
            except BaseException:
                self._drop_all()
                raise
            commit_ms = (time.perf_counter() - t0) * 1000
            if req.ttft_s is None:
                req.ttft_s = time.perf_counter() - req.started
            req.stats.add(len(draft), accepted, len(cut))
            results.append(CycleResult(
                req.request_id, req.cycle, position, anchor, tuple(draft), accepted, tuple(cut),
                draft_ms=draft_ms, verify_ms=verify_ms, commit_ms=round(commit_ms, 4), fields=fields,
                finish=req.finish_reason, logprobs=logprobs, processors=active_processors(req.sampling),
                batch=len(states), num_draft=batch.num_draft))
            req.cycle += 1
        if self.policy is not None:
            self.nodes[self.policy].observe(CycleCost(len(states), batch.num_draft, draft_ms, verify_ms,
                                                      (time.perf_counter() - began) * 1000,
                                                      sum(len(r.emitted) for r in results)))
        if self.hook is not None:  # after every state is committed: a raising sink leaves them consistent
            for result in results:
                emit_cycle(self.hook, result.event())
        return results

    def finish(self, state: ActiveRequest, reason: str | None = None, kept: int | None = None) -> Result:
        """End a request and free its slot: its Result and summary stats, and the ``request_done`` event.

        ``reason`` ends it early (e.g. "stop" for a stop string found in the text, "cancelled");
        None takes the reason its last step finished with. ``kept``: how many generated tokens
        the caller keeps (all by default); the Result, ``tokens`` and ``tokens_per_s`` count those.
        """
        reason = reason or state.finish_reason
        if reason is None:
            raise ValueError(f"request {state.request_id!r} has not finished; step it until a CycleResult has a finish, "
                             "or pass a reason (e.g. 'cancelled') to end it early")
        kept = len(state.generated) if kept is None else kept
        if not 0 <= kept <= len(state.generated):
            raise ValueError(f"kept={kept} is outside [0, {len(state.generated)}] (the tokens request {state.request_id!r} generated)")
        elapsed = time.perf_counter() - state.started
        state.finish_reason, state.done = reason, True
        if self._slots[state.slot] is state:
            self._release(state)
        marks = state.prefill_marks
        prefill_ms = round(self._timer.elapsed_ms(*marks), 4) if marks[1] is not None else 0.0  # None: never prefilled
        summary = {**state.stats.summary(), "tokens_per_s": round(kept / elapsed, 3) if elapsed > 0 else 0.0,
                   "ttft_s": round(state.ttft_s or 0.0, 6), "prefill_ms": prefill_ms,
                   "load_s": self.load_s, "warmup_s": self.warmup_s}
        tokens = state.generated[:kept]
        tokenizer = self.handle.tokenizer
        result = Result(tuple(tokens), tuple(state.tokens[:state.prompt_len]), reason, summary,
                        tokenizer.decode(tokens) if tokenizer is not None else None,
                        tuple(state.logprobs[:kept]) if state.sampling.logprobs is not None else None)
        if self.hook is not None:
            emit_request(self.hook, {"request_id": state.request_id, "tokens": kept, **summary, "finish_reason": reason})
        return result

    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None, request_id: str | None = None) -> Result:
        """Run one request to its end (EOS, stop token or max_new_tokens): ``start``, ``step`` until finished, ``finish``."""
        state = self.start(prompt_ids, sampling, request_id)
        while state.finish_reason is None:
            self.step([state])
        return self.finish(state)

    def _release(self, state: ActiveRequest) -> None:
        """Free the request's slot; every node drops what it keeps for it."""
        if self._slots[state.slot] is state:
            self._slots[state.slot] = None
        for name in self.order:
            self.nodes[name].release(state)

    def _drop_all(self) -> None:
        """After a failed cycle: no live request may step again (each must be started anew)."""
        for state in self.live():
            self._release(state)

    def _check_states(self, states: list[ActiveRequest]) -> None:
        if not states:
            raise ValueError("step got no requests; pass the live requests to step (Executor.live())")
        if len({id(r) for r in states}) != len(states):
            raise ValueError("step got the same request twice; pass each live request once")
        for req in states:
            if req.done or req.finish_reason is not None:
                raise ValueError(f"request {req.request_id!r} has finished ({req.finish_reason}); start a new one")
            if not 0 <= req.slot < self.max_batch or self._slots[req.slot] is not req:
                raise ValueError(f"request {req.request_id!r} is no longer live: a cycle failed after it started "
                                 "or it belongs to another executor; start it again")
            if not req.ready:
                raise ValueError(f"request {req.request_id!r} is still prefilling ({req.prefilled} of "
                                 f"{len(req.tokens) - 1} prompt tokens); call prefill_step until state.ready")

    def _run_nodes(self, batch: Batch) -> dict[tuple[str, str], Any]:
        """Every node's step in schedule order; returns the values on their output ports.

        A carried input is the list of what each row's request carried (None for pad rows).
        """
        values: dict[tuple[str, str], Any] = {}
        first = [i for i, r in batch.active() if r.cycle == 0]
        mark = self._timer.start()  # each node's end mark starts the next node's interval
        for name in self.order:
            inputs = {e.dst_port: ([r.carried.get((e.src, e.src_port)) if r is not None else None for r in batch.rows]
                                   if e.carried else values.get((e.src, e.src_port)))
                      for e in self.plan.inputs_of(name)}
            versions = buffer_versions(self.owned, name) if self.debug else None
            out = self.nodes[name].step(batch, inputs) or {}
            mark = self._timer.stop(self.roles[name], mark)
            if first and name == self.target:
                check_finite(self.plan, self.target, out, first)
            if versions is not None:
                check_writes(self.plan, self.owned, name, versions)
            for port, value in out.items():
                values[(name, port)] = value
        return values

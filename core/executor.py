"""The executor: allocates owned buffers from manifests, then runs draft -> verify -> commit cycles.

The schedule is the plan's topological order over non-carried edges; nothing here knows
what a drafter or a target is beyond its role (used only to attribute timings).
Per cycle there is one host synchronisation: reading the verifier's verdict together
with the drafts, packed into a single transfer.

A request runs through the step API: ``start`` (validate, seed, prefill every node),
``step`` (one cycle per state, returning a ``CycleResult`` each) until a result has a
``finish``, then ``finish`` (the ``Result`` and the ``request_done`` event). ``generate``
is that loop; the server drives it itself to stream, cut at stop strings and cancel
between cycles. Trace sinks only observe the events.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import structlog
import torch

from draftflow.core.errors import ModelFormatError, OwnershipError, RequestError
from draftflow.core.manifest import DTYPES
from draftflow.core.node import CommitInfo, Node, NodeContext, SamplingParams
from draftflow.core.plan import GraphPlan
from draftflow.core.ports import TargetOutput, Verdict
from draftflow.core.request import ActiveRequest, CycleResult, CycleTimer, Result, TokenLogprob, active_processors
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
        self.kv_tokens = plan.vram.kv_tokens if plan.vram else None
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
        self._live: ActiveRequest | None = None  # the one request whose state the nodes hold
        # Nodes that add fields to the cycle event (override Node.cycle_fields): asked once per cycle.
        self.field_nodes = [n for n in self.order if type(self.nodes[n]).cycle_fields is not Node.cycle_fields]

    # --- allocation ---------------------------------------------------------------------
    def _allocate(self) -> None:
        # Every owned buffer first, so a node may read a buffer whose owner runs after it.
        for name in self.order:
            m = self.plan.nodes[name].manifest
            self.owned[name] = {b.name: torch.zeros(b.resolved_shape(self.kv_tokens), dtype=DTYPES[b.dtype], device=self.device)
                                for b in m.owns if b.preallocate and not b.of_weights}
        # The target is built first: its handle and weight buffers (embedding, LM head) exist for every other node.
        self.handle = None
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
                              target=self.handle if TARGET_HANDLE in m.requires else None)
            self.nodes[name] = resolved.node_type.factory(ctx)
            if name == self.target:
                self.handle = self._target_handle(name)
            seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in owned.values()}
            if self.device.type == "cuda":
                measured = sum(seen.values()) + torch.cuda.memory_allocated(self.device) - before
            else:
                for t in self.nodes[name].tensors():
                    seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
                measured = sum(seen.values())
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
            self._live = None  # a node may use its request state to warm up
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
    # One request is live at a time (batching is the next issue): `start` prefills every node for the new
    # request, which replaces an unfinished one; stepping the replaced state afterwards is refused.
    def start(self, prompt_ids: list[int], sampling: SamplingParams | None = None,
              request_id: str | None = None) -> ActiveRequest:
        """Validate and seed a request and prefill every node with its prompt; the first `step` drafts from there."""
        sampling = sampling or SamplingParams()
        prompt_ids = list(prompt_ids)
        self._validate(prompt_ids, sampling)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(sampling.seed if sampling.seed is not None else int(torch.seed() % (2**63)))
        eos = () if sampling.ignore_eos else self.handle.eos_ids
        state = ActiveRequest(request_id or uuid.uuid4().hex[:12], len(prompt_ids), list(prompt_ids), sampling, gen,
                              stops=frozenset(eos) | frozenset(sampling.stop_token_ids), started=time.perf_counter())
        self._live = None  # the nodes are mid-prefill: no earlier request may step now
        begin = self._timer.start()
        for name in self.order:
            for port, value in (self.nodes[name].prefill(state) or {}).items():
                state.carried[(name, port)] = value
        state.prefill_marks = (begin, self._timer.start())  # read after the first cycle's sync, not now
        self._live = state
        return state

    def step(self, states: list[ActiveRequest]) -> list[CycleResult]:
        """Run one draft -> verify -> accept -> commit cycle for each state; one host sync in all.

        Emits one ``draft_cycle`` event per state after its commit. A trace sink only observes:
        an exception it raises propagates, but the cycle is already committed, so the request
        stays consistent and may be stepped on or finished.
        """
        self._check_states(states)
        for req in states:  # never draft past the token budget: a cycle emits at most num_draft + 1 tokens
            req.num_draft = max(0, min(self.plan.spec.num_draft, req.sampling.max_new_tokens - len(req.generated) - 1))
        try:
            values = self._run_nodes(states)
            rows = self._read_verdicts(states, values)  # the cycle's one host sync
        except BaseException:
            self._live = None  # the nodes hold a half-run cycle: only a new start may follow
            raise
        times = self._timer.totals_ms()  # node timings of the whole cycle (CUDA events are complete after the sync)
        results = []
        for req, (accepted, emitted, draft, logprobs) in zip(states, rows):
            position, anchor = req.position, req.anchor
            cut = self._cut(req, emitted)
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
                self._live = None
                raise
            commit_ms = (time.perf_counter() - t0) * 1000
            if req.ttft_s is None:
                req.ttft_s = time.perf_counter() - req.started
            req.stats.add(len(draft), accepted, len(cut))
            fields: dict[str, Any] = {}
            for name in self.field_nodes:  # node-contributed fields (docs/TRACING.md)
                for key, value in self.nodes[name].cycle_fields().items():
                    fields.setdefault(key, value)
            results.append(CycleResult(
                req.request_id, req.cycle, position, anchor, tuple(draft), accepted, tuple(cut),
                draft_ms=round(sum(times.get(r, 0.0) for r in DRAFT_ROLES), 4),
                verify_ms=round(times.get("target", 0.0) + times.get("verifier", 0.0), 4),
                commit_ms=round(commit_ms, 4), fields=fields, finish=req.finish_reason, logprobs=logprobs,
                processors=active_processors(req.sampling)))
            req.cycle += 1
        if self.hook is not None:  # after every state is committed: a raising sink leaves them consistent
            for result in results:
                emit_cycle(self.hook, result.event())
        return results

    def finish(self, state: ActiveRequest, reason: str | None = None, kept: int | None = None) -> Result:
        """End a request: its Result and summary stats, and the ``request_done`` event.

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
        if self._live is state:
            self._live = None
        summary = {**state.stats.summary(), "tokens_per_s": round(kept / elapsed, 3) if elapsed > 0 else 0.0,
                   "ttft_s": round(state.ttft_s or 0.0, 6), "prefill_ms": round(self._timer.elapsed_ms(*state.prefill_marks), 4),
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

    def _check_states(self, states: list[ActiveRequest]) -> None:
        if len(states) != 1:
            raise ValueError(f"step got {len(states)} requests; batch > 1 is not supported yet: step one request at a time")
        for req in states:
            if req.done or req.finish_reason is not None:
                raise ValueError(f"request {req.request_id!r} has finished ({req.finish_reason}); start a new one")
            if req is not self._live:
                raise ValueError(f"request {req.request_id!r} is no longer live: another request was started after it "
                                 "(one request at a time) or its last step failed; start it again")

    def _run_nodes(self, states: list[ActiveRequest]) -> dict[tuple[str, str], Any]:
        """Every node's step in schedule order; returns the values on their output ports."""
        req = states[0]  # nodes step one request (batch 1)
        values: dict[tuple[str, str], Any] = {}
        for name in self.order:
            inputs = {e.dst_port: (req.carried if e.carried else values).get((e.src, e.src_port))
                      for e in self.plan.inputs_of(name)}
            versions = self._versions(name) if self.debug else None
            t0 = self._timer.start()
            out = self.nodes[name].step(req, inputs) or {}
            self._timer.stop(self.roles[name], t0)
            if req.cycle == 0 and name == self.target:
                self._check_finite(out)
            if versions is not None:
                self._check_writes(name, versions)
            for port, value in out.items():
                values[(name, port)] = value
        return values

    def _read_verdicts(self, states: list[ActiveRequest], values) -> list[tuple[int, list[int], list[int], list | None]]:
        """(accepted, emitted, drafts, logprobs) per state, from one packed device-to-host transfer (row i = states[i]).

        ``logprobs`` is None unless the verdict carries them; then it holds one ``TokenLogprob`` per emitted token.
        """
        b = len(states)
        verdict: Verdict = values[(self.verifier, "verdict")]
        proposal = next((values.get((e.src, e.src_port)) for e in self.plan.inputs_of(self.verifier)
                         if self.plan.nodes[self.verifier].manifest.input(e.dst_port).type == "proposal"), None)
        width = verdict.emitted.shape[1]  # K + 1 for the K drafts actually proposed
        # accepted [B], emitted [B, K+1] (-1 past the accepted run), drafts [B, K]: one flat int64 transfer
        parts = [verdict.accepted[:b].to(torch.int64), verdict.emitted[:b].to(torch.int64).reshape(-1)]
        k = 0
        if proposal is not None and proposal.tokens.numel():
            k = proposal.tokens.shape[1]
            parts.append(proposal.tokens[:b].to(torch.int64).reshape(-1))
        n = -1
        if verdict.logprobs is not None:
            # Logprobs ride the same transfer: everything as float64, exact for token ids (< 2**53).
            n = verdict.top_ids.shape[-1]
            parts = [p.to(torch.float64) for p in parts] + [
                verdict.logprobs[:b].to(torch.float64).reshape(-1), verdict.top_ids[:b].to(torch.float64).reshape(-1),
                verdict.top_logprobs[:b].to(torch.float64).reshape(-1)]
        packed = torch.cat(parts).tolist()
        rows = []
        base = b + b * width + b * k  # the logprob parts start here
        for i in range(b):
            accepted = int(packed[i])
            emitted_row = [int(t) for t in packed[b + i * width:b + (i + 1) * width]]
            draft = [int(t) for t in packed[b + b * width + i * k:b + b * width + (i + 1) * k]]
            emitted = [t for t in emitted_row[:accepted + 1] if t >= 0]
            logprobs = None
            if n >= 0:
                chosen = packed[base + i * width:base + (i + 1) * width]
                ids_at, lp_at = base + b * width + i * width * n, base + b * width + b * width * n + i * width * n
                ids, lps = packed[ids_at:ids_at + width * n], packed[lp_at:lp_at + width * n]
                logprobs = [TokenLogprob(tok, chosen[j], tuple((int(ids[j * n + c]), lps[j * n + c]) for c in range(n)))
                            for j, tok in enumerate(emitted)]
            rows.append((accepted, emitted, draft, logprobs))
        return rows

    @staticmethod
    def _cut(req: ActiveRequest, emitted: list[int]) -> list[int]:
        """The emitted tokens up to and including a stop token, and within max_new_tokens; sets ``finish_reason``."""
        cut = []
        for tok in emitted:
            cut.append(tok)
            if tok in req.stops:
                req.finish_reason = "stop"
                break
            if len(req.generated) + len(cut) >= req.sampling.max_new_tokens:
                req.finish_reason = "length"
                break
        return cut

    def _validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty; pass --prompt TEXT or --prompt-ids 1,2,3")
        vocab = self.handle.vocab_size
        if vocab:
            bad = [t for t in prompt_ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}); fix the prompt ids")
            bad = [t for t, _ in sampling.logit_bias if t >= vocab]
            if bad:
                raise RequestError(f"sampling field 'logit_bias' names token id {bad[0]}, outside the vocabulary "
                                   f"[0, {vocab}); use token ids of this model's tokenizer")
        limit = self.kv_tokens
        need = len(prompt_ids) + sampling.max_new_tokens
        if limit is not None and need > limit:
            raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {need} "
                               f"exceeds the context of {limit} tokens; shorten the prompt or lower --max-new-tokens")

    def _check_finite(self, out: dict[str, Any]) -> None:
        """Refuse NaN/inf target logits (corrupt weights, float16 overflow) instead of emitting garbage.

        Checked on the first window of each request only: one extra host sync per request, none per cycle.
        """
        for value in out.values():
            if isinstance(value, TargetOutput) and not bool(torch.isfinite(value.logits).all()):
                node = self.plan.nodes[self.target]
                path = node.params.get("path")
                where = f"node '{self.target}' ({node.node_type.name}" + (f", {path})" if path else ")")
                dtype = self.plan.spec.dtype
                fix = "check the checkpoint's weights" + (", or run in --dtype bfloat16 or float32" if dtype == "float16" else "")
                raise ModelFormatError(f"{where} produced NaN or infinite logits for the prompt: its weights are corrupt "
                                       f"or overflow in {dtype}; {fix}")

    # --- debug ownership ----------------------------------------------------------------
    def _versions(self, name: str) -> dict[tuple[str, str], int]:
        return {(owner, b): t._version for owner, bufs in self.owned.items() if owner != name for b, t in bufs.items()}

    def _check_writes(self, name: str, before: dict[tuple[str, str], int]) -> None:
        for (owner, b), version in before.items():
            if self.owned[owner][b]._version != version:
                raise OwnershipError(f"node '{name}' ({self.plan.nodes[name].node_type.name}) wrote buffer {b!r}, "
                                     f"which is owned by '{owner}'; only the owner may write it")

"""The executor: allocates owned buffers from manifests, then runs draft -> verify -> commit cycles.

The schedule is the plan's topological order over non-carried edges; nothing here knows
what a drafter or a target is beyond its role (used only to attribute timings).
Per cycle there is one host synchronisation: reading the verifier's verdict together
with the drafts, packed into a single transfer.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import attrs
import structlog
import torch

from draftflow.core.errors import ModelFormatError, OwnershipError, RequestError
from draftflow.core.manifest import DTYPES
from draftflow.core.node import CommitInfo, Node, NodeContext, RequestState, SamplingParams
from draftflow.core.plan import GraphPlan
from draftflow.core.ports import TargetOutput, Verdict
from draftflow.core.tracing import RequestStats, emit_cycle, emit_request

log = structlog.get_logger("draftflow")
MEMORY_TOLERANCE = 1.10  # measured more than 10% over the declared estimate -> warning
DRAFT_ROLES = ("drafter", "selector")


@attrs.frozen
class Result:
    token_ids: tuple[int, ...]
    prompt_token_ids: tuple[int, ...]
    finish_reason: str
    stats: dict
    text: str | None = None


class _Timer:
    """Per-node timings: CUDA events on the GPU (read after the cycle's one sync), perf_counter on CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, Any, Any]] = []

    def start(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, role: str, begin) -> None:
        self.marks.append((role, begin, self.start()))

    def totals_ms(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for role, a, b in self.marks:
            ms = a.elapsed_time(b) if self.cuda else (b - a) * 1000
            out[role] = out.get(role, 0.0) + ms
        self.marks.clear()
        return out


class Executor:
    """Runs requests through a checked plan. Build once, call ``generate`` many times."""

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
        self._allocate()
        # Nodes that add fields to the cycle event (override Node.cycle_fields): asked once per cycle.
        base = Node.cycle_fields
        self.field_nodes = [n for n in self.order if getattr(type(self.nodes[n]), "cycle_fields", base) is not base]

    # --- allocation ---------------------------------------------------------------------
    def _allocate(self) -> None:
        # Every owned buffer first, so a node may read a buffer whose owner runs after it.
        for name in self.order:
            m = self.plan.nodes[name].manifest
            self.owned[name] = {b.name: torch.zeros(b.resolved_shape(self.kv_tokens), dtype=DTYPES[b.dtype], device=self.device)
                                for b in m.owns if b.preallocate}
        all_buffers = {b: t for owned in self.owned.values() for b, t in owned.items()}
        for name in self.order:
            resolved = self.plan.nodes[name]
            m = resolved.manifest
            owned = self.owned[name]
            before = torch.cuda.memory_allocated(self.device) if self.device.type == "cuda" else 0
            experts = self.plan.vram.experts if self.plan.vram is not None else None
            ctx = NodeContext(name=name, params=resolved.params, manifest=m, device=self.device, dtype=self.dtype,
                              num_draft=self.plan.spec.num_draft, kv_tokens=self.kv_tokens, buffers=owned,
                              shared={b: all_buffers[b] for b in m.reads if b in all_buffers}, graph_nodes=self.nodes,
                              resident_experts=experts.resident if experts is not None and experts.node == name else None)
            self.nodes[name] = resolved.node_type.factory(ctx)
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

    # --- request ------------------------------------------------------------------------
    def generate(self, prompt_ids: list[int], sampling: SamplingParams | None = None, request_id: str | None = None) -> Result:
        sampling = sampling or SamplingParams()
        request_id = request_id or uuid.uuid4().hex[:12]
        self._validate(prompt_ids, sampling)
        gen = torch.Generator(device=self.device)
        gen.manual_seed(sampling.seed if sampling.seed is not None else int(torch.seed() % (2**63)))
        req = RequestState(request_id, len(prompt_ids), list(prompt_ids), sampling, gen)
        eos = set() if sampling.ignore_eos else set(getattr(self.nodes[self.target], "eos_ids", ()) or ())
        stops = eos | set(sampling.stop_token_ids)
        stats = RequestStats()
        timer = _Timer(self.device)
        start = time.perf_counter()
        carried: dict[tuple[str, str], Any] = {}
        for name in self.order:
            for port, value in (self.nodes[name].prefill(req) or {}).items():
                carried[(name, port)] = value
        generated: list[int] = []
        finish, ttft = None, None
        while finish is None:
            # Never draft past the token budget: a cycle emits at most num_draft + 1 tokens.
            req.num_draft = max(0, min(self.plan.spec.num_draft, sampling.max_new_tokens - len(generated) - 1))
            values: dict[tuple[str, str], Any] = {}
            for name in self.order:
                inputs = {e.dst_port: (carried if e.carried else values).get((e.src, e.src_port))
                          for e in self.plan.inputs_of(name)}
                versions = self._versions(name) if self.debug else None
                t0 = timer.start()
                out = self.nodes[name].step(req, inputs) or {}
                timer.stop(self.roles[name], t0)
                if req.cycle == 0 and name == self.target:
                    self._check_finite(out)
                if versions is not None:
                    self._check_writes(name, versions)
                for port, value in out.items():
                    values[(name, port)] = value
            verdict: Verdict = values[(self.verifier, "verdict")]
            proposal = next((values.get((e.src, e.src_port)) for e in self.plan.inputs_of(self.verifier)
                             if self.plan.nodes[self.verifier].manifest.input(e.dst_port).type == "proposal"), None)
            # The one host sync of the cycle: accepted count, emitted tokens and drafts together.
            parts = [verdict.accepted[:1].to(torch.int64), verdict.emitted[0].to(torch.int64)]
            if proposal is not None and proposal.tokens.numel():
                parts.append(proposal.tokens[0].to(torch.int64))
            packed = torch.cat(parts).tolist()
            width = verdict.emitted.shape[1]  # K + 1 for the K drafts actually proposed
            accepted = packed[0]
            emitted_row = packed[1:1 + width]
            draft = packed[1 + width:]
            emitted = [t for t in emitted_row[:accepted + 1] if t >= 0]
            cut = []
            for tok in emitted:
                cut.append(tok)
                if tok in stops:
                    finish = "stop"
                    break
                if len(generated) + len(cut) >= sampling.max_new_tokens:
                    finish = "length"
                    break
            position, anchor = req.position, req.anchor
            req.tokens.extend(cut)
            generated.extend(cut)
            t0 = time.perf_counter()
            info = CommitInfo(position, len(draft), accepted, tuple(cut))
            for name in self.order:
                for port, value in (self.nodes[name].commit(req, info) or {}).items():
                    carried[(name, port)] = value
            commit_ms = (time.perf_counter() - t0) * 1000
            times = timer.totals_ms()
            if ttft is None:
                ttft = time.perf_counter() - start
            stats.add(len(draft), accepted, len(cut))
            event = {"request_id": request_id, "cycle": req.cycle, "position": position, "anchor": anchor,
                     "draft": draft, "accepted": accepted, "emitted": cut,
                     "draft_ms": round(sum(times.get(r, 0.0) for r in DRAFT_ROLES), 4),
                     "verify_ms": round(times.get("target", 0.0) + times.get("verifier", 0.0), 4),
                     "commit_ms": round(commit_ms, 4)}
            for name in self.field_nodes:  # node-contributed fields (docs/TRACING.md); core fields win
                for key, value in self.nodes[name].cycle_fields().items():
                    event.setdefault(key, value)
            if self.hook is not None:
                emit_cycle(self.hook, event)
            req.cycle += 1
        elapsed = time.perf_counter() - start
        summary = {**stats.summary(), "tokens_per_s": round(len(generated) / elapsed, 3) if elapsed > 0 else 0.0,
                   "ttft_s": round(ttft or 0.0, 6)}
        if self.hook is not None:
            emit_request(self.hook, {"request_id": request_id, "tokens": len(generated), **summary, "finish_reason": finish})
        tokenizer = getattr(self.nodes[self.target], "tokenizer", None)
        text = tokenizer.decode(generated) if tokenizer is not None else None
        return Result(tuple(generated), tuple(prompt_ids), finish, summary, text)

    def _validate(self, prompt_ids: list[int], sampling: SamplingParams) -> None:
        if not prompt_ids:
            raise RequestError("the prompt is empty; pass --prompt TEXT or --prompt-ids 1,2,3")
        vocab = getattr(self.nodes[self.target], "vocab_size", None)
        if vocab is not None:
            bad = [t for t in prompt_ids if not 0 <= t < vocab]
            if bad:
                raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}); fix the prompt ids")
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

"""The `target` node: a Qwen3 / Llama / Qwen2 dense model (or a Qwen3-Next hybrid) from a Hugging Face directory or GGUF.

Its manifest is computed from ``config.json`` (or the GGUF header) alone, so the VRAM plan
and every check run before a weight is read. It owns the KV cache (``static``: one
preallocated buffer at the planned capacity; ``grow``: chunks on demand, capability
``kv.grow``) and, when feature taps are asked for, a feature buffer indexed by position.
A hybrid target also owns the Gated DeltaNet states with one candidate per verify-window
position (docs/HYBRID.md), so committing a partially accepted window is a selection.

Every buffer has one row per request slot (manifest dimension ``"batch"``) and
``num_draft + 1`` slack cells past the planned capacity, where a pad row of a batch (a
slot the cycle does not step) writes its window past its committed length. A prefill runs
B = 1 on its slot's rows; a step verifies the ``[n, 1+K]`` window of all rows at once, row
b at its own position (CUDA graphs per batch bucket on the GPU, graphs.py).
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftflow.plugin import (
    EMBED_BUFFER,
    HEAD_BUFFER,
    TARGET_HANDLE,
    BATCH,
    BufferSpec,
    Features,
    Manifest,
    ModelFormatError,
    Node,
    NodeType,
    ParamSpec,
    Port,
    Problem,
    TargetHandle,
    TargetInfo,
    TargetOutput,
    Vram,
    hookimpl,
    kv_dim,
)
from draftflow.layers.config import TargetConfig, weight_bytes
from draftflow.layers.kv_cache import KVCache, static_shape
from draftflow.layers.linear_state import LinearState, conv_shape, journal_shape, recurrent_shape
from draftflow.layers import cpu_linear, tensor_parallel
from draftflow.layers.quant_linear import keeps_quantized
from draftflow.layers.fused import PLAIN, fuse_projections

# Graphs captured at warm-up: windows of 1 and num_draft+1 tokens, buckets 256 .. 2048 (4 per width), which
# covers prompt + max tokens of typical requests. Measured at Qwen3-8B shapes, bf16, H200 (docs/BENCHMARKS.md):
# ~0.09 s per graph once Triton's disk cache holds the kernels (1.7 s for all 8, the first 0.6 s with CUDA
# library loading); ~8 s on a machine's very first run, when Triton compiles every kernel once.
WARMUP_TOKENS = 2048
PARAMS = (
    ParamSpec("path", "path", help="Hugging Face model directory or .gguf file"),
    ParamSpec("kv_mode", "str", "static", "static: preallocate the KV cache; grow: allocate in chunks on demand",
              choices=("static", "grow")),
    ParamSpec("tap_layers", "int_list", [], "layers whose output hidden states are carried to drafters", minimum=0),
    ParamSpec("prefill_chunk", "int", 512, "prompt tokens per prefill forward", minimum=1),
    ParamSpec("grow_chunk", "int", 256, "tokens per allocation in grow mode", minimum=1),
    ParamSpec("cuda_graphs", "bool", True, "on CUDA with kv_mode static, replay decode/verify windows as CUDA graphs "
              "(one per window size and KV bucket, captured at warm-up or on first use); false: the eager forward; "
              "MoE targets only with every expert resident (docs/MOE.md)"),
    ParamSpec("warmup_tokens", "int", WARMUP_TOKENS, "CUDA graphs: at load, capture the decode and verify windows "
              "for contexts up to this many tokens (0: capture each on first use)", minimum=0),
    ParamSpec("linear_rollback", "str", "select", "hybrid targets: select = keep the recurrent state after every "
              "window position and pick one on commit; replay = journal the window and re-run the accepted steps",
              choices=("select", "replay")),
    ParamSpec("quantized", "bool", False, "GGUF targets on CUDA: true keeps the attention and dense-MLP projections "
              "of types Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K in their blocks (Triton kernels dequantize "
              "inside the product, on a repacked layout: less memory; a Q4_K_M 8B decodes 1.14x faster than bf16 on "
              "the H200 but its verify windows cost more, so a DFlash cycle is slower (8.9 against 6.7 ms; "
              "docs/GGUF.md)); a MoE's merged experts of those types then stay quantized on the host and are "
              "dequantized on the device per upload (docs/MOE.md); false (default): dequantize every weight at load. "
              "The CPU always dequantizes"),
    ParamSpec("expert_cache", "int", 0, "MoE targets: routed experts kept resident on the device (0 = autosize from "
              "what vram_budget leaves); pin it so target-only and speculative runs get the same cache (docs/MOE.md)", minimum=0),
)
# Activations of one forward are small next to weights at batch 1; leave room for a window.
SCRATCH_TOKENS = 512


def is_gguf(path: str) -> bool:
    p = Path(path)
    if p.suffix == ".gguf":
        return True
    if not p.is_file():
        return False
    with p.open("rb") as f:  # the magic only: the file may be many GiB
        return f.read(4) == b"GGUF"


def read_any_config(path: str) -> TargetConfig:
    p = Path(path)
    if not p.exists():
        raise ModelFormatError(f"{path}: no such model directory or file; pass a Hugging Face directory or a .gguf file")
    if is_gguf(path):
        from draftflow.plugins.target.gguf_loader import read_gguf_config

        return read_gguf_config(path)
    from draftflow.plugins.target.hf_loader import read_config

    return read_config(path)


def target_info(params) -> TargetInfo:
    """What checks may know of this target from its config alone (also when its manifest failed)."""
    cfg = read_any_config(params["path"])
    return TargetInfo(hidden_size=cfg.hidden_size, vocab_size=cfg.vocab_size, num_layers=cfg.num_layers,
                      max_context=cfg.max_position_embeddings, tap_layers=tuple(params.get("tap_layers") or ()),
                      path=str(params["path"]))


def manifest(params, env) -> Manifest:
    """Sizes are per rank: with tensor_parallel N the layers, KV cache and linear states are one rank's shard
    (tensor_parallel.local_config); the embedding, head and feature taps are whole on every rank."""
    full = read_any_config(params["path"])
    cfg = tensor_parallel.local_config(full, env.tensor_parallel)
    dtype = getattr(torch, env.dtype)
    taps = tuple(params["tap_layers"])
    bad = [t for t in taps if not 0 <= t < cfg.num_layers]
    if bad:
        raise ModelFormatError(f"tap_layers {bad} are outside the model's layers [0, {cfg.num_layers}); pick existing layers")
    window = env.num_draft + 1  # a pad row writes up to one window past its slot's committed length
    kv_shape = (cfg.num_kv_layers, 2, BATCH, kv_dim(window), cfg.num_kv_heads, cfg.head_dim)
    owns = [BufferSpec("kv_cache", kv_shape, env.dtype, preallocate=params["kv_mode"] == "static",
                       doc="K and V per full-attention layer, addressed by position")]
    if cfg.is_hybrid:
        owns += linear_buffers(cfg, window, env.dtype, params["linear_rollback"])
    owns += [BufferSpec(EMBED_BUFFER, (cfg.vocab_size, cfg.hidden_size), env.dtype, preallocate=False, of_weights=True,
                        doc="the token embedding (read-only to every other node)"),
             BufferSpec(HEAD_BUFFER, (cfg.vocab_size, cfg.hidden_size), env.dtype, preallocate=False, of_weights=True,
                        doc="the LM head (the embedding itself when tied; read-only to every other node)")]
    provides = {"target.logits", f"kv.{params['kv_mode']}", TARGET_HANDLE}
    if taps:
        owns.append(BufferSpec("target_features", (BATCH, kv_dim(window), len(taps) * cfg.hidden_size), env.dtype,
                               doc="feature taps of every position, concatenated in tap order (whole on every rank)"))
        provides.add("target.features")
    rows = max(SCRATCH_TOKENS, env.max_batch * (env.num_draft + 1))  # a prefill chunk or every slot's verify window
    scratch = rows * (4 * cfg.hidden_size + 2 * cfg.intermediate_size) * dtype.itemsize + rows * cfg.vocab_size * 4
    if env.tensor_parallel > 1:  # the gathered slices before they are joined
        scratch += rows * cfg.vocab_size * 4
    weights, pool = weight_bytes(cfg, dtype), None
    if is_gguf(params["path"]) and keeps_quantized(env.device, params["quantized"], env.tensor_parallel):
        from draftflow.layers.gguf_quants import kept_savings

        weights -= kept_savings(params["path"], dtype)  # projections held in their GGUF blocks
    if cfg.moe_layers:  # routed experts are an elastic pool, not weights (docs/MOE.md)
        from draftflow.layers.moe import expert_pool_vram

        pool, expert_bytes, moe_scratch = expert_pool_vram(cfg, dtype, params["expert_cache"], SCRATCH_TOKENS)
        weights, scratch = weights - expert_bytes, scratch + moe_scratch
    return Manifest(
        role="target",
        inputs=(Port("proposal", "proposal", required=False, doc="drafts to verify; absent = target-only decoding"),),
        outputs=(Port("logits", "logits"),) + ((Port("features", "features"),) if taps else ()),
        owns=tuple(owns),
        vram=Vram(weights=weights, scratch=scratch, experts=pool),
        provides=provides,
        max_tokens=cfg.max_position_embeddings,
        target=target_info(params),
    )


def linear_buffers(cfg: TargetConfig, window: int, dtype: str, mode: str) -> list[BufferSpec]:
    """The Gated DeltaNet state buffers for verify windows of up to `window` tokens (see linear_state.py)."""
    out = [BufferSpec("linear_conv", conv_shape(cfg, BATCH, window), dtype,
                      doc="per linear layer: last K-1 committed conv inputs, then one window's inputs"),
           BufferSpec("linear_recurrent", recurrent_shape(cfg, BATCH, window, mode), "float32",
                      doc="per linear layer: committed recurrent state" + (", then the state after each window position"
                                                                           if mode == "select" else ""))]
    if mode == "replay":
        out.append(BufferSpec("linear_journal", journal_shape(cfg, BATCH, window), "float32",
                              doc="per linear layer and window token: k, v, log-decay, beta to replay on commit"))
    return out


class _Tokenizer:
    """Text <-> ids through `tokenizers`, with special tokens kept out of decoded text."""

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def decode(self, ids) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=True)


class Target(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        p = ctx.params
        self.tp = tensor_parallel.group(ctx.tensor_parallel, str(ctx.device))  # SINGLE for one rank
        if is_gguf(p["path"]):
            from draftflow.plugins.target.gguf_loader import load_gguf

            loaded = load_gguf(p["path"], ctx.device, ctx.dtype, self.tp, quantized=None if p["quantized"] else False)
        else:
            from draftflow.plugins.target.hf_loader import load_hf

            loaded = load_hf(p["path"], ctx.device, ctx.dtype, self.tp)
        self.model = loaded.model.eval()  # model.config: this rank's shapes; self.config: the checkpoint's
        if torch.device(ctx.device).type == "cpu":
            # One q/k/v and one gate/up product a layer (row views of one weight each; what the CUDA graphs run):
            # on the 2-core CPU a 16-row gate/up product took 111 µs fused against 129 as two (oneDNN), and
            # 212 as two through MKL, which unfused projections took before (docs/BENCHMARKS.md, ninth session)
            fuse_projections(self.model)
        self.config = loaded.config
        self.vocab_size = loaded.config.vocab_size
        self.eos_ids = loaded.eos_ids
        self.tokenizer = _Tokenizer(loaded.tokenizer) if loaded.tokenizer is not None else None
        self.taps = tuple(p["tap_layers"]) or None
        self.features = ctx.buffers.get("target_features")  # [max_batch, kv_tokens + W, n_taps * H]
        window = ctx.num_draft + 1
        if p["kv_mode"] == "static":
            self.cache = KVCache.from_static(ctx.buffers["kv_cache"])  # [L, 2, max_batch, kv_tokens + W, KVH, D]
        else:
            self.cache = KVCache.growing(self.model.config, ctx.max_batch, ctx.kv_tokens + window, ctx.dtype, ctx.device,
                                         p["grow_chunk"])
        self.linear = None
        if self.config.is_hybrid:
            b = ctx.buffers
            self.linear = LinearState(b["linear_conv"], b["linear_recurrent"], window,
                                      self.config.linear_conv_kernel - 1, p["linear_rollback"], b.get("linear_journal"))
        self.partial: dict[int, str] = {}  # slot -> the request whose prompt chunks it holds (prefill_chunk)
        self.expert_counts = {}  # MoE: expert-cache counters at the end of the last cycle (or prefill)
        if self.config.moe_layers:
            self.model.set_expert_cache(ctx.resident_experts)
        ctx.buffers[EMBED_BUFFER] = self.model.embed_tokens.weight  # declared of_weights buffers: readers are checked
        ctx.buffers[HEAD_BUFFER] = self.model.head_weight()
        self.runner = None  # decode/verify windows as CUDA graphs; prefill runs eagerly (`prefill_kernels`)
        # MoE layers on the device path route on the device (docs/MOE.md); a cache whose misses need the host
        # (no device path, or batched windows past the device window) stays eager: a graph cannot replay host decisions.
        moe_eager = self.config.moe_layers and not self.model.expert_cache.capturable(ctx.max_batch * window)
        if p["cuda_graphs"] and p["kv_mode"] == "static" and torch.device(ctx.device).type == "cuda" and not moe_eager:
            from draftflow.plugins.target.graphs import GraphRunner

            self.runner = GraphRunner(self.model, self.cache, window, self.taps or (), linear=self.linear,
                                      features=self.features)
        # Prefill (any length, eager) through the graphs' Triton prologue and norm/SiLU kernels: dense targets only
        self.prefill_kernels = PLAIN
        if self.runner is not None and not (self.config.is_hybrid or self.config.moe_layers):
            self.prefill_kernels = self.runner.eager_kernels

    @torch.inference_mode()
    def warmup(self) -> None:
        """A short eager window (CUDA: loads libraries and kernels; CPU: packs every float32 weight for oneDNN and
        builds its kernels for every verify width, layers/cpu_linear.py), then on CUDA capture the decode and verify
        graphs."""
        experts = self.model.expert_cache
        if experts is not None and not experts.device_path:
            return  # host-routed experts: an eager window would move experts before the first request
        # Never committed: writes slot 0's cells past its committed length and linear-state candidate slots only
        # (the next prefill resets the linear state's open window). Larger batch buckets are captured on first use.
        cache, linear = self._slot(0)
        start = cache.length
        ids = torch.zeros(1, min(16, cache.capacity - start), dtype=torch.long, device=self.ctx.device)
        with cpu_linear.noting() as noted:
            if ids.shape[1]:
                self.model(ids, start, cache, logit_rows=1, linear=linear, kernels=self.prefill_kernels)
        # A B = 1 verify window has 1..K+1 rows, and every product of it (the LM head too) takes them all
        cpu_linear.build_kernels(noted, lambda _: range(1, self.ctx.num_draft + 2))
        if torch.device(self.ctx.device).type != "cuda":
            return
        if self.runner is not None and self.ctx.params["warmup_tokens"]:
            from draftflow.plugins.target.graphs import graph_widths

            # Every padded width (decode, full verify, and those between: prompt lookup's windows, every drafter's
            # last cycles) in every KV bucket up to warmup_tokens. With the widths between in the first bucket only,
            # a request's short tail windows at a longer context captured mid-request, and on a machine's first run
            # Triton compiled their kernels there (the combine kernel is specialised per bucket): DFlash's first
            # HumanEval run on an H100 was 1.35x target-only, its second 1.48x (docs/BENCHMARKS.md, 2026-12-07).
            self.runner.prepare(graph_widths(self.ctx.num_draft + 1), self.ctx.params["warmup_tokens"])
        torch.cuda.synchronize()

    def target_handle(self) -> TargetHandle:
        head = self.model.head_weight()
        return TargetHandle(target_info(self.ctx.params), tokenizer=self.tokenizer, eos_ids=self.eos_ids,
                            dtype=self.ctx.dtype, device=torch.device(self.ctx.device), embed=self.model.embed_tokens,
                            lm_head=lambda hidden: cpu_linear.linear(hidden, head).float(), embed_weight=self.model.embed_tokens.weight,
                            head_weight=head, features=self.features, config=self.config,
                            hf_tokenizer=self.tokenizer.tok if self.tokenizer is not None else None)

    def tensors(self):
        yield from self.model.parameters()
        yield from self.model.buffers()
        if self.cache.mode == "grow":
            yield self.cache.buffer
        if self.model.expert_cache is not None:
            yield from self.model.expert_cache.tensors()

    def cycle_fields(self):
        """MoE targets: expert-cache hits, misses and bytes uploaded during this cycle's window."""
        if self.model.expert_cache is None:
            return {}
        now = self.model.expert_cache.counters()
        delta = {k: v - self.expert_counts.get(k, 0) for k, v in now.items()}
        self.expert_counts = now
        return delta

    def _slot(self, slot: int) -> tuple[KVCache, LinearState | None]:
        """Slot `slot`'s rows of the KV cache and the linear state (views: same storage, same lengths)."""
        return self.cache.rows(slot, slot + 1), self.linear.rows(slot, slot + 1) if self.linear is not None else None

    @torch.inference_mode()
    def prefill(self, req):
        context = req.tokens[:-1]  # the anchor is fed with the first verify window
        s = req.slot
        self._prefill_to(req, len(context))
        if self.model.expert_cache is not None:  # cycle 0 reports its own window, not the prompt's
            self.expert_counts = self.model.expert_cache.counters()
        return {"features": Features(self.features[s:s + 1, :len(context)], 0)} if self.taps else {}

    @torch.inference_mode()
    def prefill_batch(self, reqs):
        """Joining requests' prompts in batched forwards (groups of at most a scratch's worth of padded tokens,
        similar lengths together); a hybrid target, or a request whose slot holds its earlier chunks, alone."""
        out: dict[int, dict] = {}
        batched = [r for r in reqs if self.linear is None and self.partial.get(r.slot) != r.request_id]
        for req in reqs:
            if req not in batched:
                out[id(req)] = self.prefill(req)
        limit = max(self.ctx.params["prefill_chunk"], self.ctx.max_batch * (self.ctx.num_draft + 1))
        group: list = []
        for req in sorted(batched, key=lambda r: len(r.tokens)):  # ascending: the last one sets the group's width
            if group and (len(group) + 1) * (len(req.tokens) - 1) > limit:
                self._prefill_rows(group, out)
                group = []
            group.append(req)
        if group:
            self._prefill_rows(group, out)
        return [out[id(req)] for req in reqs]

    def _prefill_rows(self, group: list, out: dict) -> None:
        """One forward over the group's prompts, padded to the longest, in a scratch cache; then each row's K/V
        and taps into its slot. Causal attention keeps padding out of every real token."""
        contexts = [req.tokens[:-1] for req in group]
        t = max(map(len, contexts))
        if len(group) == 1 or t == 0:
            for req in group:
                out[id(req)] = self.prefill(req)
            return
        device = self.ctx.device
        ids = torch.tensor([c + [0] * (t - len(c)) for c in contexts], dtype=torch.long, device=device)  # [G, T]
        scratch = KVCache.from_static(torch.empty(static_shape(self.model.config, len(group), t), dtype=self.ctx.dtype,
                                                  device=device))
        chunk, tapped = self.ctx.params["prefill_chunk"], []
        for start in range(0, t, chunk):
            window = ids[:, start:start + chunk]
            _, taps = self.model(window, start, scratch, logit_rows=0, tap_layers=self.taps, kernels=self.prefill_kernels)
            scratch.commit(start + window.shape[1])
            if taps is not None:
                tapped.append(taps)  # [G, C, n_taps * H]
        taps = torch.cat(tapped, dim=1) if tapped else None
        for i, req in enumerate(group):
            s, n = req.slot, len(contexts[i])
            self.partial[s] = req.request_id
            cache, _ = self._slot(s)
            cache.crop(0)
            cache.ensure(n)
            self.cache.buffer[:, :, s, :n] = scratch.buffer[:, :, i, :n]
            cache.commit(n)
            if taps is not None:
                self.features[s, :n] = taps[i, :n]
            out[id(req)] = {"features": Features(self.features[s:s + 1, :n], 0)} if self.taps else {}
        if self.model.expert_cache is not None:  # cycle 0 reports its own window, not the prompts'
            self.expert_counts = self.model.expert_cache.counters()

    @torch.inference_mode()
    def prefill_chunk(self, req, end):
        self._prefill_to(req, end)

    def _prefill_to(self, req, end: int) -> int:
        """Bring slot req.slot to the prompt's first `end` tokens, continuing this request's earlier chunks (else
        from an empty slot); returns where it started."""
        s = req.slot
        cache, linear = self._slot(s)
        if self.partial.get(s) != req.request_id:  # a new request in this slot
            self.partial[s] = req.request_id
            cache.crop(0)
            if linear is not None:
                linear.reset()
        begin = cache.length
        chunk = self.ctx.params["prefill_chunk"]
        ids = torch.tensor([req.tokens[begin:end]], dtype=torch.long, device=self.ctx.device)  # [1, end - begin]
        for start in range(begin, end, chunk):
            window = ids[:, start - begin:start - begin + chunk]
            _, taps = self.model(window, start, cache, logit_rows=0, tap_layers=self.taps, linear=linear,
                                 kernels=self.prefill_kernels)
            if taps is not None:
                self.features[s:s + 1, start:start + window.shape[1]] = taps
            stop = min(start + chunk, end)
            cache.commit(stop)
            if linear is not None:
                linear.commit(stop)
        return begin

    @torch.inference_mode()
    def step(self, batch, inputs):
        """Verify row b's window [anchor_b, drafts_b] at position_b for every row; pad rows run at their slot's
        committed length (any valid token) and leave it unchanged."""
        proposal = inputs.get("proposal")
        n = batch.size
        drafts = proposal.tokens if proposal is not None and proposal.tokens.shape[1] else None  # [n, K]
        if drafts is not None and self.tp.size > 1:  # every rank verifies rank 0's drafts (docs/TENSOR_PARALLEL.md)
            drafts = self.tp.broadcast(drafts.contiguous())
        w = 1 + (0 if drafts is None else drafts.shape[1])
        lengths = self.cache.lengths
        anchors = [r.anchor if r is not None else 0 for r in batch.rows]
        starts = [r.position if r is not None else lengths[i] for i, r in enumerate(batch.rows)]
        if self.runner is not None and w <= self.runner.max_window:
            logits, _ = self.runner.step(anchors, drafts, starts)  # [n, W, V]; taps written to the features
            return {"logits": TargetOutput(logits)}
        anchor = torch.tensor(anchors, dtype=torch.long, device=self.ctx.device)[:, None]  # [n, 1]
        window = anchor if drafts is None else torch.cat([anchor, drafts], dim=1)  # [n, W]
        linear = self.linear.rows(0, n) if self.linear is not None else None
        logits, taps = self.model(window, starts[0] if n == 1 else starts, self.cache.rows(0, n), tap_layers=self.taps,
                                  linear=linear)  # [n, W, V]
        if taps is not None:
            if n == 1:
                self.features[:1, starts[0]:starts[0] + w] = taps
            else:
                positions = torch.tensor(starts, device=taps.device)[:, None] + torch.arange(w, device=taps.device)
                self.features[:n].index_put_((torch.arange(n, device=taps.device)[:, None], positions), taps)
        return {"logits": TargetOutput(logits)}

    def commit(self, req, info):
        # Rejected cells stay in the slot's rows but past its length; the next window overwrites them.
        s, length = req.slot, len(req.tokens) - 1
        self.cache.commit(length, row=s)
        if self.linear is not None:  # select the state after the last accepted token (or replay to it)
            self.linear.commit(length, row=s)
        if self.taps:
            return {"features": Features(self.features[s:s + 1, info.position:length], info.position)}
        return {}

    def release(self, req):
        """The slot's rows are reset by the next prefill into it; only forget whose chunks it holds."""
        self.partial.pop(req.slot, None)


def check_tensor_parallel(plan):
    """tensor_parallel N: every count the target splits over N ranks must divide by N (one problem each)."""
    size = plan.spec.tensor_parallel
    if size == 1:
        return []
    out = []
    for name, node in plan.nodes.items():
        if node.node_type.factory is not Target:
            continue
        cfg = read_any_config(node.params["path"])
        for message, fix in tensor_parallel.divisibility_problems(cfg, size):
            out.append(Problem(name, "tensor-parallel", message, fix, node.node_type.name, plan.spec.at("tensor_parallel")))
    return out


def check_host_memory(plan):
    """A MoE target whose routed experts (held on the host: docs/MOE.md) need more host memory than is available
    fails before anything loads, instead of being killed for memory part way through."""
    from draftflow.layers.quant_experts import available_host_memory, host_memory_problem

    out, available = [], available_host_memory()
    for name, node in plan.nodes.items():
        if node.node_type.factory is not Target:
            continue
        path = node.params["path"]
        keep = is_gguf(path) and keeps_quantized(plan.spec.device, node.params["quantized"], plan.spec.tensor_parallel)
        found = host_memory_problem(read_any_config(path), getattr(torch, plan.spec.dtype), path, keep, available)
        if found is not None:
            out.append(Problem(name, "host-memory", *found, node.node_type.name, plan.spec.at("nodes", name, "params", "path")))
    return out


@hookimpl
def draftflow_add_checks(registry):
    registry.add_check("tensor-parallel", check_tensor_parallel)
    registry.add_check("host-memory", check_host_memory)


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="target", role="target", manifest=manifest, factory=Target, params=PARAMS,
        capabilities=("target.logits", "target.features", "target.handle", "kv.static", "kv.grow"), target_info=target_info,
        description="Qwen3 / Llama / Qwen2 dense or Qwen3-Next hybrid target from a Hugging Face directory or GGUF file"))

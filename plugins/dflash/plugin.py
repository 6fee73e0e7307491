"""The `dflash` drafter node: one forward proposes a block of up to B-1 tokens.

Per cycle it appends the newly committed tokens' feature taps (the target's carried
`features`) to its own context K/V cache, embeds `[anchor, MASK x K]` with the target's
embedding, runs the block and reads K drafts through the target's LM head. The cache is
then cropped back to the anchor's position, so it always describes `req.tokens[:-1]`,
the same state contract as the target's KV cache.

Requests live in slots (the cache has a row per slot plus a block's worth of slack cells past
each context). A cycle of one request (slot 0) runs the batch-1 forward on exact shapes; a
cycle of B slots ingests each row's new rows (a long prompt first alone, in chunks) and runs
ONE block pass over all B anchors, each row at its own positions and seeing only its own
first k+1 block rows, so row i drafts what it drafts alone (`proposals` picks per row).
Pad rows draft junk past their slot's context and commit nothing.

The target's embedding and LM head are declared reads (`target_embed`, `target_head`) of
buffers the target owns; the executor builds the target first and hands them over.

A request with a grammar gets drafts the grammar allows: the node keeps its own matcher for
the request and picks the K drafts row by row, row j masked by what the grammar allows after
the committed tokens and drafts[:j] (the drafter was not trained on the grammar and keeps
proposing tokens the masked target must reject). The K rows come to the host once per cycle;
the Proposal's q is the masked distribution each draft was drawn from, so rejection sampling
stays exact. Requests without a grammar never leave the device.
"""

from __future__ import annotations

import torch

from draftflow.plugin import (
    BATCH,
    EMBED_BUFFER,
    HEAD_BUFFER,
    TARGET_HANDLE,
    BufferSpec,
    Incompatibility,
    Manifest,
    ModelFormatError,
    Node,
    NodeType,
    ParamSpec,
    Port,
    Proposal,
    Vram,
    hookimpl,
    kv_dim,
    wrong_target_check,
)
from draftflow.layers import cpu_linear
from draftflow.layers.fused import fuse_projections
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.processors import LogitProcessor
from draftflow.plugins.dflash.checks import defer_check, tap_layer_check
from draftflow.plugins.dflash.config import drafter_dtype, head_copy_bytes, kv_shape, node_dtype, weight_bytes
from draftflow.plugins.dflash.graphs import DraftRunner
from draftflow.plugins.dflash.loader import load_drafter, read_config
from draftflow.plugins.dflash.model import draft_logits
from draftflow.plugins.dflash.proposals import RowProposals

PARAMS = (
    ParamSpec("path", "path", help="z-lab DFlash directory (config.json + safetensors) or .gguf file"),
    ParamSpec("cuda_graphs", "bool", True, "on CUDA, replay each full-width proposal (ingest + block + LM head) as a "
              "CUDA graph per KV bucket, captured on first use; false: the eager forward"),
    ParamSpec("triton", "bool", True, "on CUDA, a block's q/k-norm + RoPE + K/V writes as one Triton kernel, its "
              "attention as the split-KV kernel and its residual adds, norms and SiLU gate as the target's Triton "
              "kernels, with q/k/v and gate/up as one product each (full, non-causal drafter layers; docs/DFLASH.md); "
              "false: the plain ops"),
    ParamSpec("dtype", "str", "graph", "the drafter's compute dtype: `graph` (the graph's) or its own; e.g. a bfloat16 "
              "drafter of a float32 target drafts on half-precision matrix units (GPU tensor cores, CPUs with "
              "AVX512-BF16/AMX) with a bfloat16 copy of the target's embedding and head; the target, and so the "
              "output, are unchanged", choices=("graph", "float32", "bfloat16", "float16")),
    ParamSpec("defer_min", "int", 2, "with the `defer` input connected (e.g. prompt lookup's proposal, which a mixer "
              "prefers): draft nothing in a cycle where that proposal already offers this many drafts in every row",
              minimum=1),
    ParamSpec("min_path_prob", "float", 0.0, "cut the block's drafts short: keep those before the first row where "
              "the running product of the row's top probability (the drafter's softmax) falls under this (at least "
              "one draft; the widest row's cut in a batch); 0: every row of the block. The target verifies fewer "
              "drafts, so the output is unchanged; one host sync a cycle", minimum=0.0),
)
DEFER_DOC = ("optional: another drafter's proposal; a cycle where it offers `defer_min` drafts in every row drafts "
             "nothing here (its feature rows wait in the target's tap buffer)")


# Context rows projected per forward while ingesting a long prompt's features.
CONTEXT_CHUNK = 512
KV_GROW_REASON = ("DFlash keeps its context K/V and block shapes static and sized to the target's preallocated "
                  "cache; set the target's kv_mode: static")


def manifest(params, env) -> Manifest:
    cfg = read_config(params["path"])
    own = drafter_dtype(params, env.dtype)
    dtype = getattr(torch, own)
    h, taps = cfg.hidden_size, cfg.num_taps
    # Context ingestion (fc input, projections) bounded by CONTEXT_CHUNK; block rows need logits over the vocab.
    vocab = cfg.vocab_size or 0
    block = env.max_batch * cfg.block_size  # every slot's block rows in one pass
    scratch = (CONTEXT_CHUNK * (taps * h + 4 * h) + block * (4 * h + 2 * cfg.intermediate_size)) * dtype.itemsize \
        + 2 * block * vocab * 4
    return Manifest(
        role="drafter",
        inputs=(Port("features", "features", carried=True,
                     doc=f"target taps of layers {list(cfg.target_layer_ids)} for the newly committed tokens"),
                Port("defer", "proposal", required=False, doc=DEFER_DOC, auto=False)),
        outputs=(Port("proposal", "proposal"),),
        owns=(BufferSpec("dflash_kv", kv_shape(cfg, kv_dim(slot_width(cfg, env.num_draft)), BATCH), own,
                         doc="context K/V per draft layer and request slot, addressed by position; "
                             "slack cells past the context for a block"),),
        vram=Vram(weights=weight_bytes(cfg, dtype) + head_copy_bytes(vocab, h, own, env.dtype), scratch=scratch),
        reads=(EMBED_BUFFER, HEAD_BUFFER),
        requires={"target.features", TARGET_HANDLE},
        incompatible=(Incompatibility("kv.grow", KV_GROW_REASON),),
    )


def grammar_compiler(handle):
    """The grammar engine's compiler for the target's tokenizer (imported only when a request has a grammar)."""
    from draftflow.layers.grammar import GrammarCompiler

    return GrammarCompiler(handle.hf_tokenizer, handle.vocab_size, tuple(handle.eos_ids))


class DFlash(RowProposals, Node):
    KIND = "dflash"  # the node type named in messages (subclasses reuse the block forward)
    GRAMMAR_DRAFTS = True  # mask the drafts with the request's grammar (DFlash2's candidates go to a selector instead)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.dtype = node_dtype(ctx.params, ctx.dtype)
        self.model, self.config = load_drafter(ctx.params["path"], ctx.device, self.dtype)
        self._fuse()
        self.min_path_prob = float(ctx.params["min_path_prob"])
        self.embed: torch.Tensor | None = None  # [V, H], the target's (declared read: target_embed)
        self.head: torch.Tensor | None = None  # [V, H], the target's (declared read: target_head)
        self.compiler = None  # GrammarCompiler, built at the first request with a grammar, then reused
        self._init_slots(ctx.buffers["dflash_kv"])
        self._bind()

    def _fuse(self) -> None:
        """On the CPU, each drafter layer's q/k/v and gate/up weights back to back (views of one tensor each): one
        product per group. On CUDA the same with the Triton block path (param `triton`), else the plain layout."""
        if torch.device(self.ctx.device).type == "cpu":
            fuse_projections(self.model)
        elif self.ctx.params["triton"]:
            self.model.use_triton()

    def _init_slots(self, buffer: torch.Tensor) -> None:
        """Per-slot state: a cache over each slot's row of `buffer` and the requests' matchers and processors."""
        # buffer: [L, 2, max_batch, kv_tokens + W, KVH, D]
        self.slots = buffer
        self.caches = [KVCache.from_static(buffer[:, :, s:s + 1]) for s in range(buffer.shape[2])]
        self.cache = self.caches[0]  # slot 0: the B = 1 path's cache
        self.runner = None  # DraftRunner, built on first use
        self.matchers: dict[int, object] = {}  # slot -> the request's GrammarMatcher (absent: no grammar)
        self.host_generators: dict[int, torch.Generator] = {}  # slot -> draws grammar-masked drafts on the host
        self.processors: dict[int, LogitProcessor] = {}  # slot -> LogitProcessor following req.tokens (follow)

    def tensors(self):
        yield from self.model.parameters()
        yield from self.model.buffers()

    def _bind(self) -> None:
        """Check the target's embedding and LM head (declared reads, handed over by the executor) against the drafter."""
        if self.ctx.target is None or EMBED_BUFFER not in self.ctx.shared:
            raise ModelFormatError(f"node '{self.name}' ({self.KIND}): no target handle with an embedding and LM head; "
                                   "add a `target` node to the graph")
        cfg = self.config
        embed, head = self.ctx.shared[EMBED_BUFFER], self.ctx.shared[HEAD_BUFFER]
        self.embed = embed.to(self.dtype)  # the target's own tensors, or copies in the drafter's dtype
        self.head = self.embed if head is embed else head.to(self.dtype)
        if self.embed.shape[1] != cfg.hidden_size:
            raise ModelFormatError(f"node '{self.name}' ({self.KIND}): target hidden size {self.embed.shape[1]} differs from "
                                   f"the drafter's {cfg.hidden_size}; use the drafter trained for this target")
        if not 0 <= cfg.mask_token_id < self.embed.shape[0]:
            raise ModelFormatError(f"node '{self.name}' ({self.KIND}): mask_token_id {cfg.mask_token_id} is outside the "
                                   f"target's vocabulary of {self.embed.shape[0]}; use the drafter trained for this target")

    @torch.inference_mode()
    def prefill(self, req):
        slot = req.slot
        self.caches[slot].commit(0)
        self.release(req)
        if req.sampling.grammar is not None and self.GRAMMAR_DRAFTS:
            if self.compiler is None:
                self.compiler = grammar_compiler(self.ctx.target)
            self.matchers[slot] = self.compiler.compile(req.sampling.grammar)
            gen = req.generator  # masked drafts are sampled on the host: a CPU generator, seeded from the request's
            self.host_generators[slot] = gen if gen.device.type == "cpu" \
                else torch.Generator().manual_seed(gen.initial_seed())
        return {}

    def release(self, req) -> None:
        for state in (self.matchers, self.host_generators, self.processors):
            state.pop(req.slot, None)

    def _ingest(self, cache: KVCache, rows: torch.Tensor, start: int) -> None:
        """Append committed feature rows (no block) to one slot at `start`, in chunks of CONTEXT_CHUNK."""
        # rows: [1, C, n_taps * H]
        for i in range(0, rows.shape[1], CONTEXT_CHUNK):
            self.model.draft(rows[:, i:i + CONTEXT_CHUNK].to(self.dtype), start + i, None, cache)

    def _catch_up(self, req, features, k: int, limit: int) -> tuple[torch.Tensor, int]:
        """Ingest what of the request's new feature rows cannot ride with its block; return the rest ([1, C, n*H],
        C <= `limit`, ending at the anchor) and their start. A cycle that drafts nothing ingests nothing: the rows
        wait in the target's tap buffer, and the next cycle that drafts takes them from there."""
        cfg, cache = self.config, self.caches[req.slot]
        rows, start = (features.hidden, features.start) if features is not None else (self._no_rows(), cache.length)
        if k == 0:  # nothing read or copied: a deferred cycle in a long streak would copy every row it skipped
            cache.crop(min(start, cache.length))  # drop last cycle's block
            return self._no_rows(), cache.length
        if start > cache.length:  # cycles without drafting skipped their rows: read them from the tap buffer
            tapped = self.ctx.target.features  # [slots, cells, n_taps * H]
            if tapped is None:
                raise ModelFormatError(f"node '{self.name}' ({self.KIND}): features start at position {start} but the "
                                       f"draft cache holds {cache.length}; wire target.features -> {self.name}.features "
                                       "(carried) and tap the target")
            rows, start = torch.cat([tapped[req.slot:req.slot + 1, cache.length:start], rows], dim=1), cache.length
        cache.crop(start)  # drop anything past the rows (last cycle's block, rejected drafts)
        if start + rows.shape[1] != req.position:  # the rows do not end at the anchor
            self._ingest(cache, rows, start)
            if cache.length != req.position:
                raise ModelFormatError(f"node '{self.name}' ({self.KIND}): draft cache holds {cache.length} positions "
                                       f"but the anchor is at {req.position}; the target must tap {list(cfg.target_layer_ids)}")
            return rows[:, :0], cache.length
        if rows.shape[1] > limit:  # a long catch-up (the prompt): alone, in chunks
            self._ingest(cache, rows[:, :-1], start)
            rows, start = rows[:, -1:], req.position - 1
        return rows, start

    def draft_block(self, batch, inputs) -> tuple[torch.Tensor, torch.Tensor, list[int]] | None:
        """Ingest every row's new feature rows and run one block per row, all rows in one forward; the draft rows'
        hidden states and logits, and the drafts each row wants (None when the cycle drafts nothing)."""
        # returns hidden: [B, K, H] (final-normed), logits: [B, K, V] float32, widths: B ints (<= K; 0 for pad rows)
        n = batch.size
        features = inputs.get("features") or [None] * n
        k = 0 if self._deferred(inputs.get("defer")) else min(self.config.block_size - 1, batch.num_draft)
        if n == 1:
            req = batch.rows[0]
            k = min(k, req.num_draft)
            drafted = self._draft_one(req, features[0], k)
            return None if drafted is None else (*drafted, [k])
        limit = slot_width(self.config, self.ctx.num_draft)  # the slack past each slot's context
        todo, widths = [], [0] * n  # todo: (row, rows [1, C, n*H], start)
        for i, req in batch.active():
            widths[i] = min(k, req.num_draft)
            rows, start = self._catch_up(req, features[i], k, limit)
            todo.append((i, rows, start))
        if k == 0:
            return None
        hidden, logits = self._draft_slots(n, todo, batch, widths)
        return hidden[:n, :k], logits[:n, :k], widths

    def _deferred(self, other) -> bool:
        """Whether the `defer` input offers at least `defer_min` drafts in every row: known on the host only when
        its rows all have its full width (no per-row lengths, e.g. prompt lookup at batch 1), else never."""
        return other is not None and other.lengths is None and other.tokens.shape[1] >= self.ctx.params["defer_min"]

    def _draft_slots(self, n: int, todo: list, batch, widths: list[int]):
        """One forward over slots [0, n): row b ingests its rows and drafts the full trained block (its first
        widths[b] rows are offered); pad rows write past their slots' context only. Commits the context lengths
        of the rows in `todo`."""
        # returns hidden [>=n, B-1, H], logits [>=n, B-1, V]
        cfg = self.config
        width = slot_width(cfg, batch.num_draft)  # the whole trained block: K only picks how many rows are offered
        entries = {i: (rows, start) for i, rows, start in todo}
        runner = self._runner()
        size = runner.batch_size(n) if runner is not None else n
        rows_in, starts, anchors, lasts = [], [], [], []
        for b in range(size):
            rows, start = entries.get(b, (None, self.caches[b].length))
            num_new = 0 if rows is None else rows.shape[1]
            req = batch.rows[b] if b < n else None
            rows_in.append(rows if num_new else None)
            starts.append(start)
            anchors.append(cfg.mask_token_id if req is None else req.anchor)
            lasts.append(start + num_new + width - 1)
        if runner is not None:
            hidden, logits = runner.propose(rows_in, starts, anchors, lasts, width)
        else:
            hidden, logits = self._eager_slots(rows_in, starts, anchors, lasts, width)
        for i, rows, start in todo:
            self.caches[i].commit(start + rows.shape[1])
        return hidden, logits

    def _eager_slots(self, rows_in: list, starts: list[int], anchors: list[int], lasts: list[int], width: int):
        """`draft_slots` on exact shapes: context rows padded to the longest row's, keys up to the last cell written."""
        cfg, device, n = self.config, self.ctx.device, len(rows_in)
        c = max(0 if r is None else r.shape[1] for r in rows_in)
        features = torch.zeros(n, c, cfg.num_taps * cfg.hidden_size, dtype=self.dtype, device=device)  # [B, C, n*H]
        counts = []
        for b, rows in enumerate(rows_in):
            counts.append(0 if rows is None else rows.shape[1])
            if rows is not None:
                features[b, :rows.shape[1]] = rows[0]
        end = max(max(s + c, s + m + width) for s, m in zip(starts, counts))
        for cache in self.caches[:1]:  # every slot has the same capacity
            cache.ensure(end)
        meta = torch.tensor([starts, counts, lasts], dtype=torch.long).to(device)  # [3, B]
        tokens = torch.full((n, width), cfg.mask_token_id, dtype=torch.long, device=device)  # [B, W]
        tokens[:, 0] = torch.tensor(anchors, dtype=torch.long).to(device)
        block = self.model.embed_block(tokens, self.embed)
        hidden = self.model.draft_slots(features, block, meta[0], meta[1], meta[2], self.slots[:, :, :n], end)
        hidden = hidden[:, 1:]  # [B, K, H]
        return hidden, draft_logits(hidden, self.head, cfg)

    def _draft_one(self, req, features, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """B = 1: ingest the new feature rows and run a (k+1)-row block in one forward (exact shapes, or a graph)."""
        # returns hidden: [1, k, H] (final-normed), logits: [1, k, V] float32; None when k = 0
        cfg, cache = self.config, self.caches[req.slot]
        runner = self._runner()
        width = slot_width(cfg, k)  # the whole trained block: K only picks how many rows are offered
        rows, start = self._catch_up(req, features, k, width if runner is not None else CONTEXT_CHUNK)
        if k == 0:
            return None
        if runner is not None and rows.shape[1] > 0:
            hidden, logits = runner(rows, start, req.anchor, width)  # [1, B-1, H], [1, B-1, V]
            return hidden[:, :k], logits[:, :k]
        return self._eager_block(rows, start, req.anchor, width, k, cache)

    def _eager_block(self, rows: torch.Tensor, start: int, anchor: int, width: int, k: int, cache: KVCache
                     ) -> tuple[torch.Tensor, torch.Tensor]:
        """Ingest `rows` at `start` and run the `width`-row block [anchor, MASK...] after them in one eager forward;
        the first k draft rows' hidden states ([1, k, H], final-normed) and logits ([1, k, V] float32)."""
        block = torch.full((1, width), self.config.mask_token_id, dtype=torch.long, device=self.ctx.device)  # [1, B]
        block[0, 0] = anchor
        # The block's K/V sit past cache.length: the next cycle's crop drops them.
        hidden = self.model.draft(rows.to(self.dtype), start, self.model.embed_block(block, self.embed), cache)[:, 1:k + 1]
        return hidden, draft_logits(hidden, self.head, self.config)

    def _no_rows(self) -> torch.Tensor:
        cfg = self.config
        return torch.zeros(1, 0, cfg.num_taps * cfg.hidden_size, dtype=self.ctx.dtype, device=self.ctx.device)

    def _runner(self):
        """The CUDA-graph proposal path, when enabled and on CUDA (built once, after binding)."""
        if self.runner is None and self.ctx.params.get("cuda_graphs") and torch.device(self.ctx.device).type == "cuda" \
                and self.ctx.num_draft > 0:
            width = slot_width(self.config, self.ctx.num_draft)
            self.runner = DraftRunner(self.model, self.cache, self.embed, self.head, width, slots=self.slots)
        return self.runner

    @torch.inference_mode()
    def warmup(self) -> None:
        """Capture the full-width B = 1 proposal graphs of the KV buckets up to graphs.WARMUP_TOKENS cells, so the first
        request captures nothing; batched graphs are captured at their first use. Eager: one block in slot 0 (never
        committed; the next prefill resets the slot), which on the CPU packs the weights for oneDNN, then the
        kernels of every context length a cycle brings."""
        runner = self._runner()
        if runner is not None:
            runner.warmup()
        elif self.ctx.num_draft > 0:
            with cpu_linear.noting() as noted:
                self._warm_eager()  # ingests C = 1 context row
            self.caches[0].crop(0)
            # A cycle ingests C = 1..K+1 rows: `fc` takes C of them, each layer's k/v the C and the block's B (CPU:
            # oneDNN's kernels for those row counts, layers/cpu_linear.py); the block's other products keep B rows.
            # (After a cycle a policy gave K = 0, the next one ingests both cycles' rows: a count built on first use.)
            width = slot_width(self.config, self.ctx.num_draft)
            cpu_linear.build_kernels(noted, lambda m: range(m, m + self.ctx.num_draft + 1) if m in (1, 1 + width) else ())

    def _warm_eager(self) -> torch.Tensor:
        """`_eager_block` on one zero feature row in slot 0, offering K rows; returns their hidden states ([1, K, H])."""
        cfg, width = self.config, slot_width(self.config, self.ctx.num_draft)
        rows = torch.zeros(1, 1, cfg.num_taps * cfg.hidden_size, dtype=self.dtype, device=self.ctx.device)
        k = min(self.ctx.num_draft, width - 1)
        return self._eager_block(rows, 0, cfg.mask_token_id, width, k, self.caches[0])[0]

    @torch.inference_mode()
    def step(self, batch, inputs):
        drafted = self.draft_block(batch, inputs)
        if drafted is None:
            return {"proposal": Proposal(torch.empty(batch.size, 0, dtype=torch.long, device=self.ctx.device))}
        _, logits, widths = drafted  # [B, K, V]
        logits = self.processed(batch, logits)
        if self.min_path_prob > 0:  # the drafts before the drafter's confidence runs out (docs/DFLASH.md)
            k = confident_width(logits, self.min_path_prob)
            logits, widths = logits[:, :k], [min(w, k) for w in widths]
        if batch.size == 1:
            return {"proposal": self._row_proposal(batch.rows[0], logits)}
        return {"proposal": self._batch_proposal(batch, logits, widths)}

    def commit(self, req, info):
        # Block K/V were never committed; the next step's features start exactly at the slot's length.
        matcher = self.matchers.get(req.slot)
        if matcher is not None:
            matcher.commit(info.emitted)
        return {}


def confident_width(logits: torch.Tensor, threshold: float) -> int:
    """How many of a block's K draft rows to keep: those before the first row where the running product of the top
    candidate's probability (the row maximum of the softmax of `logits` [B, K, V]) falls under `threshold`; at least
    1, and the widest row's count over the batch."""
    k = logits.shape[1]
    # softmax then its maximum: one fused pass and a small one (CPU: half the time of exp(top - logsumexp))
    below = torch.cumprod(logits.float().softmax(-1).amax(-1), -1) < threshold  # [B, K]
    first = torch.where(below.any(-1), below.int().argmax(-1), k)  # [B]: the first row under it, else K
    return max(1, int(first.max()))


def slot_width(cfg, num_draft: int) -> int:
    """Rows a proposal writes past a slot's context: the trained block (every proposal drafts all of it, K or
    not), also the most rows a batched proposal ingests per slot; the draft cache's slack cells."""
    return cfg.block_size if num_draft > 0 else 1


check_tap_layers = tap_layer_check("dflash", lambda path: read_config(path).target_layer_ids)


check_defer = defer_check("dflash")


def trained_for(cfg) -> dict:
    """What a DFlash(2) backbone config records about the target it was trained for."""
    return {"hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "layers": cfg.num_target_layers}


check_target = wrong_target_check("dflash", lambda params: trained_for(read_config(params["path"])))


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="dflash", role="drafter", manifest=manifest, factory=DFlash, params=PARAMS,
        capabilities=("proposal", "sampling.temperature>0"),
        description="DFlash block drafter (z-lab): B-1 drafts per forward from target feature taps"))


@hookimpl
def draftflow_add_checks(registry):
    registry.add_check("dflash-taps", check_tap_layers)
    registry.add_check("dflash-target", check_target)
    registry.add_check("dflash-defer", check_defer)


def shortcut_hooks(kind: str, backbone):
    """The two compose hooks of a block drafter plugin `kind`; ``backbone(path)`` reads its DFlashConfig.

    A shortcut graph's target taps the layers the drafter was trained on, and the graph may
    offer every row of the trained block (K = block_size - 1). A smaller K (`--spec K`, the
    adaptive_k policy) still drafts the whole block, which is attended non-causally, and offers
    its first K rows, so the first K drafts are those of the trained shape.
    """

    def draftflow_target_params(plugin, params, target):
        if plugin != kind or not params.get("path"):
            return None
        return {"tap_layers": list(backbone(params["path"]).target_layer_ids)}

    def draftflow_shortcut_defaults(plugin, params):
        if plugin != kind or not params.get("path"):
            return None
        return {"num_draft": backbone(params["path"]).block_size - 1}

    return hookimpl(draftflow_target_params), hookimpl(draftflow_shortcut_defaults)


draftflow_target_params, draftflow_shortcut_defaults = shortcut_hooks("dflash", read_config)

"""The `dflash` drafter node: one forward proposes a block of up to B-1 tokens.

Per cycle it appends the newly committed tokens' feature taps (the target's carried
`features`) to its own context K/V cache, embeds `[anchor, MASK x K]` with the target's
embedding, runs the block and reads K drafts through the target's LM head. The cache is
then cropped back to the anchor's position, so it always describes `req.tokens[:-1]`,
the same state contract as the target's KV cache.

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
    EMBED_BUFFER,
    HEAD_BUFFER,
    KV_TOKENS,
    TARGET_HANDLE,
    BufferSpec,
    Incompatibility,
    Manifest,
    ModelFormatError,
    Node,
    NodeType,
    ParamSpec,
    Port,
    Problem,
    Proposal,
    Vram,
    hookimpl,
    wrong_target_check,
)
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.processors import LogitProcessor
from draftflow.layers.sampling import filter_logits, sample
from draftflow.plugins.dflash.config import kv_shape, weight_bytes
from draftflow.plugins.dflash.graphs import DraftRunner
from draftflow.plugins.dflash.loader import load_drafter, read_config
from draftflow.plugins.dflash.model import draft_logits

PARAMS = (
    ParamSpec("path", "path", help="z-lab DFlash directory (config.json + safetensors) or .gguf file"),
    ParamSpec("cuda_graphs", "bool", True, "on CUDA, replay each full-width proposal (ingest + block + LM head) as a "
              "CUDA graph per KV bucket, captured on first use; false: the eager forward"),
)
# Context rows projected per forward while ingesting a long prompt's features.
CONTEXT_CHUNK = 512
KV_GROW_REASON = ("DFlash keeps its context K/V and block shapes static and sized to the target's preallocated "
                  "cache; set the target's kv_mode: static")


def manifest(params, env) -> Manifest:
    cfg = read_config(params["path"])
    dtype = getattr(torch, env.dtype)
    h, taps = cfg.hidden_size, cfg.num_taps
    # Context ingestion (fc input, projections) bounded by CONTEXT_CHUNK; block rows need logits over the vocab.
    vocab = cfg.vocab_size or 0
    scratch = (CONTEXT_CHUNK * (taps * h + 4 * h) + cfg.block_size * (4 * h + 2 * cfg.intermediate_size)) * dtype.itemsize \
        + 2 * cfg.block_size * vocab * 4
    return Manifest(
        role="drafter",
        inputs=(Port("features", "features", carried=True,
                     doc=f"target taps of layers {list(cfg.target_layer_ids)} for the newly committed tokens"),),
        outputs=(Port("proposal", "proposal"),),
        owns=(BufferSpec("dflash_kv", kv_shape(cfg, KV_TOKENS), env.dtype,
                         doc="context K/V per draft layer, addressed by position"),),
        vram=Vram(weights=weight_bytes(cfg, dtype), scratch=scratch),
        reads=(EMBED_BUFFER, HEAD_BUFFER),
        requires={"target.features", TARGET_HANDLE},
        incompatible=(Incompatibility("kv.grow", KV_GROW_REASON),),
    )


def grammar_compiler(handle):
    """The grammar engine's compiler for the target's tokenizer (imported only when a request has a grammar)."""
    from draftflow.layers.grammar import GrammarCompiler

    return GrammarCompiler(handle.hf_tokenizer, handle.vocab_size, tuple(handle.eos_ids))


class DFlash(Node):
    KIND = "dflash"  # the node type named in messages (subclasses reuse the block forward)
    GRAMMAR_DRAFTS = True  # mask the drafts with the request's grammar (DFlash2's candidates go to a selector instead)

    def __init__(self, ctx):
        super().__init__(ctx)
        self.model, self.config = load_drafter(ctx.params["path"], ctx.device, ctx.dtype)
        self.cache = KVCache.from_static(ctx.buffers["dflash_kv"])  # [L, 2, 1, kv_tokens, KVH, D]
        self.embed: torch.Tensor | None = None  # [V, H], the target's (declared read: target_embed)
        self.head: torch.Tensor | None = None  # [V, H], the target's (declared read: target_head)
        self.runner = None  # DraftRunner, built on first use
        self.compiler = None  # GrammarCompiler, built at the first request with a grammar, then reused
        self.matcher = None  # the live request's GrammarMatcher (None: no grammar)
        self.processor = None  # the request's LogitProcessor, following req.tokens (LogitProcessor.follow)
        self.host_generator: torch.Generator | None = None  # draws grammar-masked drafts on the host
        self._bind()

    def tensors(self):
        yield from self.model.parameters()
        yield from self.model.buffers()

    def _bind(self) -> None:
        """Check the target's embedding and LM head (declared reads, handed over by the executor) against the drafter."""
        if self.ctx.target is None or EMBED_BUFFER not in self.ctx.shared:
            raise ModelFormatError(f"node '{self.name}' ({self.KIND}): no target handle with an embedding and LM head; "
                                   "add a `target` node to the graph")
        cfg = self.config
        self.embed, self.head = self.ctx.shared[EMBED_BUFFER], self.ctx.shared[HEAD_BUFFER]
        if self.embed.shape[1] != cfg.hidden_size:
            raise ModelFormatError(f"node '{self.name}' ({self.KIND}): target hidden size {self.embed.shape[1]} differs from "
                                   f"the drafter's {cfg.hidden_size}; use the drafter trained for this target")
        if not 0 <= cfg.mask_token_id < self.embed.shape[0]:
            raise ModelFormatError(f"node '{self.name}' ({self.KIND}): mask_token_id {cfg.mask_token_id} is outside the "
                                   f"target's vocabulary of {self.embed.shape[0]}; use the drafter trained for this target")

    @torch.inference_mode()
    def prefill(self, req):
        self.cache.commit(0)
        self.matcher = None
        if req.sampling.grammar is not None and self.GRAMMAR_DRAFTS:
            if self.compiler is None:
                self.compiler = grammar_compiler(self.ctx.target)
            self.matcher = self.compiler.compile(req.sampling.grammar)
            gen = req.generator  # masked drafts are sampled on the host: a CPU generator, seeded from the request's
            self.host_generator = gen if gen.device.type == "cpu" else torch.Generator().manual_seed(gen.initial_seed())
        return {}

    def _ingest(self, rows: torch.Tensor, start: int) -> None:
        """Append committed feature rows (no block) at `start`, in chunks of CONTEXT_CHUNK."""
        # rows: [1, C, n_taps * H]
        for i in range(0, rows.shape[1], CONTEXT_CHUNK):
            self.model.draft(rows[:, i:i + CONTEXT_CHUNK], start + i, None, self.cache)

    def draft_block(self, req, inputs) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Ingest the new feature rows and run one block in one forward; the draft rows' hidden states and
        logits (None when K = 0)."""
        # returns hidden: [1, K, H] (final-normed), logits: [1, K, V] float32
        cfg = self.config
        k = min(cfg.block_size - 1, req.num_draft)
        features = inputs.get("features")
        rows, start = (features.hidden, features.start) if features is not None else (self._no_rows(), self.cache.length)
        if start > self.cache.length:
            raise ModelFormatError(f"node '{self.name}' ({self.KIND}): features start at position {start} but the draft "
                                   f"cache holds {self.cache.length}; wire target.features -> {self.name}.features (carried)")
        self.cache.crop(start)  # drop anything past the rows (last cycle's block, rejected drafts)
        if k == 0 or start + rows.shape[1] != req.position:  # nothing to draft, or the rows do not end at the anchor
            self._ingest(rows, start)
            if k == 0:
                return None
            if self.cache.length != req.position:
                raise ModelFormatError(f"node '{self.name}' ({self.KIND}): draft cache holds {self.cache.length} positions "
                                       f"but the anchor is at {req.position}; the target must tap {list(cfg.target_layer_ids)}")
            rows, start = rows[:, :0], req.position
        runner = self._runner()
        if rows.shape[1] > (k + 1 if runner is not None else CONTEXT_CHUNK):  # a long catch-up (the prompt)
            self._ingest(rows[:, :-1], start)
            rows, start = rows[:, -1:], req.position - 1
        if runner is not None and rows.shape[1] > 0:
            return runner(rows, start, req.anchor, k + 1)  # [1, K, H], [1, K, V]
        block = torch.full((1, k + 1), cfg.mask_token_id, dtype=torch.long, device=self.ctx.device)  # [1, K+1]
        block[0, 0] = req.anchor
        # The block's K/V sit past cache.length: the next cycle's crop drops them.
        hidden = self.model.draft(rows, start, self.model.embed_block(block, self.embed), self.cache)[:, 1:]  # [1, K, H]
        return hidden, draft_logits(hidden, self.head, cfg)

    def _no_rows(self) -> torch.Tensor:
        cfg = self.config
        return torch.zeros(1, 0, cfg.num_taps * cfg.hidden_size, dtype=self.ctx.dtype, device=self.ctx.device)

    def _runner(self):
        """The CUDA-graph proposal path, when enabled and on CUDA (built once, after binding)."""
        if self.runner is None and self.ctx.params.get("cuda_graphs") and torch.device(self.ctx.device).type == "cuda" \
                and self.ctx.num_draft > 0:
            width = min(self.ctx.num_draft, self.config.block_size - 1) + 1
            self.runner = DraftRunner(self.model, self.cache, self.embed, self.head, width)
        return self.runner

    @torch.inference_mode()
    def warmup(self) -> None:
        """Capture the full-width proposal graphs of the first KV buckets (graphs.WARMUP_BUCKETS), so the first
        request captures nothing; a no-op on the eager path."""
        runner = self._runner()
        if runner is not None:
            runner.warmup()

    @torch.inference_mode()
    def step(self, req, inputs):
        drafted = self.draft_block(req, inputs)
        if drafted is None:
            return {"proposal": Proposal(torch.empty(1, 0, dtype=torch.long, device=self.ctx.device))}
        _, logits = drafted  # [1, K, V]
        s = req.sampling
        if s.has_processors:  # the request's penalties and bias (committed prefix only): higher acceptance
            self.processor = LogitProcessor.follow(self.processor, req, logits.shape[-1], logits.device)
            logits = self.processor.process(logits)
        if self.matcher is not None:
            return {"proposal": self._grammar_proposal(req, logits)}
        if s.temperature == 0:
            return {"proposal": Proposal(logits.argmax(dim=-1))}
        q = filter_logits(logits, s.temperature, s.top_k, s.top_p, s.min_p)  # [1, K, V]: the q the drafts come from
        return {"proposal": Proposal(sample(q, generator=req.generator), probs=q)}

    def _grammar_proposal(self, req, logits: torch.Tensor) -> Proposal:
        """Drafts picked one row at a time, row j masked by the grammar after the committed tokens and drafts[:j]:
        the masked argmax (T = 0) or a draw from the masked, filtered q (T > 0), which the Proposal carries.
        Drafting stops after an EOS draft (the output ends there)."""
        # logits: [1, K, V] processed (penalties, bias)
        s = req.sampling
        rows = logits[0].float().cpu()  # [K, V]: the cycle's one host sync, all rows at once
        vocab = rows.shape[-1]
        mask = torch.zeros(vocab, dtype=torch.bool)  # [V]
        probs = []  # [V] per draft

        def choose(j: int, allowed: torch.Tensor) -> int:  # allowed: [V_grammar] bool, after drafts[:j]
            width = min(vocab, allowed.shape[0])
            mask[:width] = allowed[:width]
            row = rows[j].masked_fill(~mask, float("-inf"))  # [V]
            if s.temperature == 0:
                return int(row.argmax())
            q = filter_logits(row, s.temperature, s.top_k, s.top_p, s.min_p)  # [V]
            probs.append(q)
            return int(sample(q, generator=self.host_generator))

        drafts = self.matcher.walk(choose, rows.shape[0])
        device = self.ctx.device
        tokens = torch.tensor([drafts], dtype=torch.long).to(device, non_blocking=True)  # [1, K']
        if not probs:
            return Proposal(tokens)
        return Proposal(tokens, probs=torch.stack(probs)[None].to(device, non_blocking=True))  # [1, K', V]

    def commit(self, req, info):
        # Block K/V were never committed; the next step's features start exactly at cache.length.
        if self.matcher is not None:
            self.matcher.commit(info.emitted)
        return {}


def tap_layer_check(kind: str, layer_ids):
    """A check that every `kind` node's target_layer_ids (``layer_ids(path)``) equal the target's tap_layers, in order."""

    def check(plan):
        targets = [n for n in plan.by_role("target") if "tap_layers" in plan.nodes[n].params]
        for name, node in plan.nodes.items():
            if node.node_type.name != kind or not targets:
                continue
            ids = tuple(layer_ids(node.params["path"]))
            target = targets[0]
            taps = tuple(plan.nodes[target].params["tap_layers"])
            if taps != ids:
                yield Problem(name, f"{kind}-taps", f"the drafter reads target layers {list(ids)} but target '{target}' "
                              f"taps {list(taps)}", f"set nodes.{target}.tap_layers={list(ids)}", kind,
                              plan.spec.node(name).where if plan.spec.node(name) else "")

    return check


check_tap_layers = tap_layer_check("dflash", lambda path: read_config(path).target_layer_ids)


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


def shortcut_hooks(kind: str, backbone):
    """The two compose hooks of a block drafter plugin `kind`; ``backbone(path)`` reads its DFlashConfig.

    A shortcut graph's target taps the layers the drafter was trained on, and the graph drafts
    the trained block: a shorter block is attended non-causally, so its rows differ from the
    trained ones (and accept less).
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

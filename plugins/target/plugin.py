"""The `target` node: a Qwen3 / Llama / Qwen2 dense model from a Hugging Face directory or GGUF.

Its manifest is computed from ``config.json`` (or the GGUF header) alone, so the VRAM plan
and every check run before a weight is read. It owns the KV cache (``static``: one
preallocated buffer at the planned capacity; ``grow``: chunks on demand, capability
``kv.grow``) and, when feature taps are asked for, a feature buffer indexed by position.
"""

from __future__ import annotations

from pathlib import Path

import torch

from draftflow.core.errors import ModelFormatError
from draftflow.core.hookspecs import hookimpl
from draftflow.core.manifest import KV_TOKENS, BufferSpec, Manifest, Port, Vram
from draftflow.core.node import Node
from draftflow.core.params import ParamSpec
from draftflow.core.ports import Features, TargetOutput
from draftflow.core.registry import NodeType
from draftflow.plugins.target.config import TargetConfig, weight_bytes
from draftflow.plugins.target.kv_cache import KVCache

PARAMS = (
    ParamSpec("path", "path", help="Hugging Face model directory or .gguf file"),
    ParamSpec("kv_mode", "str", "static", "static: preallocate the KV cache; grow: allocate in chunks on demand",
              choices=("static", "grow")),
    ParamSpec("tap_layers", "int_list", [], "layers whose output hidden states are carried to drafters"),
    ParamSpec("prefill_chunk", "int", 512, "prompt tokens per prefill forward"),
    ParamSpec("grow_chunk", "int", 256, "tokens per allocation in grow mode"),
    ParamSpec("cuda_graphs", "bool", True, "on CUDA with kv_mode static, replay decode/verify windows as CUDA graphs "
              "(one per window size and KV bucket, captured on first use); false: the eager forward"),
)
# Activations of one forward are small next to weights at batch 1; leave room for a window.
SCRATCH_TOKENS = 512


def is_gguf(path: str) -> bool:
    return Path(path).suffix == ".gguf" or (Path(path).is_file() and Path(path).read_bytes()[:4] == b"GGUF")


def read_any_config(path: str) -> TargetConfig:
    p = Path(path)
    if not p.exists():
        raise ModelFormatError(f"{path}: no such model directory or file; pass a Hugging Face directory or a .gguf file")
    if is_gguf(path):
        from draftflow.plugins.target.gguf_loader import read_gguf_config

        return read_gguf_config(path)
    from draftflow.plugins.target.hf_loader import read_config

    return read_config(path)


def manifest(params, env) -> Manifest:
    cfg = read_any_config(params["path"])
    dtype = getattr(torch, env.dtype)
    taps = tuple(params["tap_layers"])
    bad = [t for t in taps if not 0 <= t < cfg.num_layers]
    if bad:
        raise ModelFormatError(f"tap_layers {bad} are outside the model's layers [0, {cfg.num_layers}); pick existing layers")
    kv_shape = (cfg.num_layers, 2, 1, KV_TOKENS, cfg.num_kv_heads, cfg.head_dim)
    owns = [BufferSpec("kv_cache", kv_shape, env.dtype, preallocate=params["kv_mode"] == "static",
                       doc="K and V per layer, addressed by position")]
    provides = {"target.logits", f"kv.{params['kv_mode']}"}
    if taps:
        owns.append(BufferSpec("target_features", (1, KV_TOKENS, len(taps) * cfg.hidden_size), env.dtype,
                               doc="feature taps of every position, concatenated in tap order"))
        provides.add("target.features")
    scratch = SCRATCH_TOKENS * (4 * cfg.hidden_size + 2 * cfg.intermediate_size) * dtype.itemsize + SCRATCH_TOKENS * cfg.vocab_size * 4
    return Manifest(
        role="target",
        inputs=(Port("proposal", "proposal", required=False, doc="drafts to verify; absent = target-only decoding"),),
        outputs=(Port("logits", "logits"),) + ((Port("features", "features"),) if taps else ()),
        owns=tuple(owns),
        vram=Vram(weights=weight_bytes(cfg, dtype), scratch=scratch),
        provides=provides,
        max_tokens=cfg.max_position_embeddings,
    )


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
        if is_gguf(p["path"]):
            from draftflow.plugins.target.gguf_loader import load_gguf as load
        else:
            from draftflow.plugins.target.hf_loader import load_hf as load
        loaded = load(p["path"], ctx.device, ctx.dtype)
        self.model = loaded.model.eval()
        self.config = loaded.config
        self.vocab_size = loaded.config.vocab_size
        self.eos_ids = loaded.eos_ids
        self.tokenizer = _Tokenizer(loaded.tokenizer) if loaded.tokenizer is not None else None
        self.taps = tuple(p["tap_layers"]) or None
        self.features = ctx.buffers.get("target_features")  # [1, kv_tokens, n_taps * H]
        if p["kv_mode"] == "static":
            self.cache = KVCache.from_static(ctx.buffers["kv_cache"])
        else:
            self.cache = KVCache.growing(self.config, 1, ctx.kv_tokens, ctx.dtype, ctx.device, p["grow_chunk"])
        self.runner = None  # static-shape windows as CUDA graphs; prefill always runs eagerly
        if p["cuda_graphs"] and p["kv_mode"] == "static" and torch.device(ctx.device).type == "cuda":
            from draftflow.plugins.target.graphs import GraphRunner

            self.runner = GraphRunner(self.model, self.cache, ctx.num_draft + 1, self.taps or ())

    def tensors(self):
        yield from self.model.parameters()
        yield from self.model.buffers()
        if self.cache.mode == "grow":
            yield self.cache.buffer

    def _forward(self, tokens: torch.Tensor, start: int, logit_rows):
        # tokens: [1, T]
        logits, taps = self.model(tokens, start, self.cache, logit_rows=logit_rows, tap_layers=self.taps)
        if taps is not None:
            self.features[:, start:start + tokens.shape[1]] = taps
        return logits  # [1, R, V]

    @torch.inference_mode()
    def prefill(self, req):
        context = req.tokens[:-1]  # the anchor is fed with the first verify window
        self.cache.crop(0)
        chunk = self.ctx.params["prefill_chunk"]
        ids = torch.tensor([context], dtype=torch.long, device=self.ctx.device)  # [1, P-1]
        for start in range(0, len(context), chunk):
            self._forward(ids[:, start:start + chunk], start, 0)
            self.cache.commit(min(start + chunk, len(context)))
        return {"features": Features(self.features[:, :len(context)], 0)} if self.taps else {}

    @torch.inference_mode()
    def step(self, req, inputs):
        proposal = inputs.get("proposal")
        drafts = proposal.tokens if proposal is not None and proposal.tokens.shape[1] else None  # [1, K]
        if self.runner is not None and 1 + (0 if drafts is None else drafts.shape[1]) <= self.runner.max_window:
            # The anchor and start go in as kernel arguments: no host-to-device copy, no sync.
            logits, taps = self.runner(req.anchor, drafts, req.position)  # [1, K+1, V], [1, K+1, n*H]
            if taps is not None:
                self.features[:, req.position:req.position + logits.shape[1]] = taps
            return {"logits": TargetOutput(logits)}
        anchor = torch.tensor([[req.anchor]], dtype=torch.long, device=self.ctx.device)  # [1, 1]
        window = anchor if proposal is None else torch.cat([anchor, proposal.tokens], dim=1)  # [1, K+1]
        logits = self._forward(window, req.position, None)  # [1, K+1, V]
        return {"logits": TargetOutput(logits)}

    def commit(self, req, info):
        # Rejected cells stay in the cache but past its length; the next window overwrites them.
        self.cache.commit(len(req.tokens) - 1)
        if self.taps:
            return {"features": Features(self.features[:, info.position:len(req.tokens) - 1], info.position)}
        return {}


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="target", role="target", manifest=manifest, factory=Target, params=PARAMS,
        capabilities=("target.logits", "target.features", "kv.static", "kv.grow"),
        description="Qwen3 / Llama / Qwen2 dense target from a Hugging Face directory or GGUF file"))

"""The `mtp` drafter: a DeepSeek-V3 / Qwen3-Next multi-token-prediction head.

Each cycle it first catches up on the positions the target committed last cycle: the
carried ``features`` input holds the target's final hidden h_i for positions
``start .. start+T-1`` and ``req.tokens`` supplies t_{i+1}, so the pairs fill the head's
own KV cache at positions i. The last pair's argmax is draft 1; drafts 2..K chain the head
on its own output hidden, writing KV past the committed length (overwritten next cycle,
so a rejection needs no rollback). Drafts are argmax, so q is one-hot.

Each request slot has its own row of the head's KV cache (``mtp_kv`` is ``[1, 2, batch,
kv_tokens + K, KVH, D]``: the K slack cells take the chained drafts past a full context)
and its own carried features. A batched cycle runs the head row by row for now (one
catch-up and one K-step chain per stepped request) and sends one padded ``[n, K']``
proposal; pad rows propose token 0 and touch no cache row.

The target must tap its last layer (``tap_layers`` includes num_layers-1; that tap is
post-norm, as the MTP equations want); a check says so before anything is allocated.
"""

from __future__ import annotations

import torch

from draftflow.plugin import (
    EMBED_BUFFER,
    HEAD_BUFFER,
    BATCH,
    TARGET_HANDLE,
    BufferSpec,
    DraftflowError,
    Manifest,
    Node,
    NodeType,
    ParamSpec,
    Port,
    Problem,
    Proposal,
    Vram,
    hookimpl,
    kv_dim,
    target_info,
    wrong_target_check,
)
from draftflow.plugins.mtp.model import load_head
from draftflow.plugins.mtp.weights import LAYOUTS, find_mtp
from draftflow.layers.kv_cache import KVCache

PARAMS = (
    ParamSpec("path", "path", help="the target's checkpoint directory when it carries MTP weights, "
                                   "or a standalone MTP safetensors file or directory"),
    ParamSpec("config", "path", "", "config.json (or its directory) describing the model; default: next to path"),
    ParamSpec("layout", "str", "auto", "tensor naming; auto detects it from the checkpoint", choices=("auto",) + LAYOUTS),
    ParamSpec("prefill_chunk", "int", 512, "pairs per forward when catching up on a prompt", minimum=1),
)


def manifest(params, env) -> Manifest:
    ckpt = find_mtp(params["path"], params["config"], params["layout"])
    cfg, dtype = ckpt.config, getattr(torch, env.dtype)
    chunk = params["prefill_chunk"]
    block = ckpt.block_config
    # Per pair: the block's activations; an MoE block's widest MLP is k routed experts plus the shared one.
    mlp = (block.num_experts_per_tok * (3 * block.moe_intermediate_size + 2 * cfg.hidden_size)
           + 2 * block.shared_expert_intermediate_size) if block.moe_layers else 2 * cfg.intermediate_size
    scratch = chunk * (6 * cfg.hidden_size + mlp) * dtype.itemsize + env.num_draft * cfg.vocab_size * 4
    return Manifest(
        role="drafter",
        inputs=(Port("features", "features", carried=True, doc="target taps incl. the last layer (post-norm hidden)"),),
        outputs=(Port("proposal", "proposal", doc="K argmax drafts, probs None"),),
        owns=(BufferSpec("mtp_kv", (1, 2, BATCH, kv_dim(env.num_draft), cfg.num_kv_heads, cfg.head_dim), env.dtype,
                         doc="K and V of the MTP block per request slot, addressed by pair position i"),),
        vram=Vram(weights=ckpt.nbytes(dtype), scratch=scratch),
        reads=(EMBED_BUFFER, HEAD_BUFFER),
        requires={"target.features", TARGET_HANDLE},
    )


class Mtp(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        p = ctx.params
        self.ckpt = find_mtp(p["path"], p["config"], p["layout"])
        self.head = load_head(self.ckpt, ctx.device, ctx.dtype).eval()
        kv = ctx.buffers["mtp_kv"]  # [1, 2, max_batch, kv_tokens + K, KVH, D]
        self.caches = [KVCache.from_static(kv[:, :, s:s + 1]) for s in range(kv.shape[2])]  # one per request slot
        self.chunk = p["prefill_chunk"]
        self.tap = None  # slice of the target's features holding the last layer
        self._bind()

    def tensors(self):
        yield from self.head.parameters()
        if self.head.expert_cache is not None:
            yield from self.head.expert_cache.tensors()

    def _bind(self) -> None:
        target = self.ctx.target
        if target is None or EMBED_BUFFER not in self.ctx.shared:
            raise DraftflowError(f"node '{self.name}' (mtp): no target handle to share the embedding with; "
                                 "add a `target` node to the graph")
        last = target.info.num_layers - 1
        taps = target.tap_layers
        if last not in taps:
            raise DraftflowError(f"the target does not tap its last layer {last}; set its tap_layers=[..., {last}]")
        h = target.hidden_size
        i = taps.index(last)
        self.tap = slice(i * h, (i + 1) * h)
        self.head.bind(self.ctx.shared[EMBED_BUFFER], self.ctx.shared[HEAD_BUFFER])

    @torch.inference_mode()
    def prefill(self, req):
        self.caches[req.slot].crop(0)
        return {}

    def release(self, req):
        self.caches[req.slot].crop(0)

    @torch.inference_mode()
    def step(self, batch, inputs):
        features = inputs["features"]  # carried: row i's Features, hidden [1, T, n_taps*H] at start..start+T-1
        rows = {i: self._draft(req, features[i]) for i, req in batch.active()}
        width = max((d.shape[1] for d in rows.values()), default=0)
        tokens = torch.zeros((batch.size, width), dtype=torch.long, device=self.ctx.device)  # [n, K']: pad rows 0
        for i, drafts in rows.items():
            tokens[i, :drafts.shape[1]] = drafts[0]
        lengths = None
        if any(d.shape[1] != width for d in rows.values()):
            lengths = torch.tensor([rows[i].shape[1] if i in rows else 0 for i in range(batch.size)]).to(self.ctx.device)
        return {"proposal": Proposal(tokens, lengths=lengths)}  # tokens: [n, K']

    def _draft(self, req, f) -> torch.Tensor:  # [1, k] int64, k = req.num_draft (0 before the first pair)
        """Catch slot ``req.slot`` up on the features' pairs, then chain the head ``req.num_draft`` times."""
        cache, k = self.caches[req.slot], req.num_draft
        if cache.length != f.start:  # the features must continue exactly where the last cycle's pairs ended
            raise DraftflowError(f"mtp: features start at {f.start} but the MTP cache holds {cache.length} pairs; "
                                 "feed mtp.features from the target's carried features output")
        t = f.hidden.shape[1]
        ids = torch.tensor([req.tokens[f.start + 1:f.start + t + 1]], dtype=torch.long, device=self.ctx.device)  # [1, T]
        hidden = f.hidden[..., self.tap]  # [1, T, H]
        logits = None  # a one-token prompt has no (t_{i+1}, h_i) pair yet: no drafts this cycle
        for s in range(0, t, self.chunk):
            logits, out = self.head(ids[:, s:s + self.chunk], hidden[:, s:s + self.chunk], f.start + s, cache)
            cache.commit(f.start + min(s + self.chunk, t))
        drafts = []
        pos = f.start + t  # next pair: (draft 1, its hidden) at this position
        for j in range(k if logits is not None else 0):
            tok = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            drafts.append(tok)
            if j + 1 < k:
                logits, out = self.head(tok, out, pos + j, cache)
        return torch.cat(drafts, dim=1) if drafts else torch.empty((1, 0), dtype=torch.long, device=self.ctx.device)


def _trained_for(params) -> dict:
    cfg = find_mtp(params["path"], params["config"], params["layout"]).config
    return {"hidden": cfg.hidden_size, "vocab": cfg.vocab_size, "layers": cfg.num_layers}


check_target = wrong_target_check("mtp", _trained_for)


def check_last_layer_tapped(plan):
    """An mtp node needs the target's last-layer (final, post-norm) hidden among its taps."""
    mtps = [n for n, r in plan.nodes.items() if r.node_type.name == "mtp"]
    found = target_info(plan)
    if not mtps or found is None:
        return  # no target that can describe itself: its own problem says why
    target, info = found
    last = info.num_layers - 1
    taps = list(info.tap_layers)
    spec = plan.spec.node(target)
    plugin = (plan.nodes.get(target) or plan.unresolved[target]).node_type.name
    for name in mtps:
        if last not in taps:
            fixed = ", ".join(map(str, sorted(set(taps) | {last})))
            yield Problem(target, "mtp-hidden",
                          f"mtp node '{name}' needs the target's final hidden state, but tap_layers {taps} lacks the last layer {last}",
                          f"set nodes.{target}.tap_layers=[{fixed}]", plugin, spec.where if spec else "")


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="mtp", role="drafter", manifest=manifest, factory=Mtp, params=PARAMS,
        description="multi-token-prediction head (DeepSeek-V3 or Qwen3-Next layout) chained K times"))


@hookimpl
def draftflow_add_checks(registry):
    registry.add_check("mtp-hidden", check_last_layer_tapped)
    registry.add_check("mtp-target", check_target)


@hookimpl
def draftflow_target_params(plugin, params, target):
    """A shortcut graph's target taps its last layer: the MTP head reads the final (post-norm) hidden state."""
    if plugin != "mtp" or target is None:
        return None
    return {"tap_layers": [target.num_layers - 1]}

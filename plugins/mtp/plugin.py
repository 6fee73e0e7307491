"""The `mtp` drafter: a DeepSeek-V3 / Qwen3-Next multi-token-prediction head.

Each cycle it first catches up on the positions the target committed last cycle: the
carried ``features`` input holds the target's final hidden h_i for positions
``start .. start+T-1`` and ``req.tokens`` supplies t_{i+1}, so the pairs fill the head's
own KV cache at positions i. The last pair's argmax is draft 1; drafts 2..K chain the head
on its own output hidden, writing KV past the committed length (overwritten next cycle,
so a rejection needs no rollback). Drafts are argmax, so q is one-hot.

Each request slot has its own row of the head's KV cache (``mtp_kv`` is ``[1, 2, batch,
kv_tokens + K + 1, KVH, D]``) and its own carried features. A batched cycle catches every row
up in one forward (rows padded to the longest run of new pairs, at most K + 1; a run
longer than that, a joining request's prompt, goes alone in chunks first), then chains
the head K - 1 times over all n rows at per-row positions. Pad rows and padding pairs
only write cells past their slot's committed pairs (at most K + 1 past it: the slack cells),
which the next catch-up overwrites; the proposal is ``[n, K']`` with per-row lengths when
rows want different K.

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
from draftflow.layers import cpu_linear
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
    rows = max(chunk, env.max_batch * (env.num_draft + 1))  # a prompt chunk or every slot's pairs
    scratch = rows * (6 * cfg.hidden_size + mlp) * dtype.itemsize + env.max_batch * env.num_draft * cfg.vocab_size * 4
    return Manifest(
        role="drafter",
        inputs=(Port("features", "features", carried=True, doc="target taps incl. the last layer (post-norm hidden)"),),
        outputs=(Port("proposal", "proposal", doc="K argmax drafts, probs None"),),
        owns=(BufferSpec("mtp_kv", (1, 2, BATCH, kv_dim(env.num_draft + 1), cfg.num_kv_heads, cfg.head_dim), env.dtype,
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
        self.cache = KVCache.from_static(ctx.buffers["mtp_kv"])  # [1, 2, max_batch, kv_tokens + K + 1, KVH, D], row = slot
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
    def warmup(self) -> None:
        """One pair through the head in slot 0 (never committed): on the CPU this packs its weights for oneDNN, then
        builds its kernels for the 1..K+1 pairs a cycle's catch-up brings (layers/cpu_linear.py)."""
        experts = self.head.expert_cache
        if experts is not None and not experts.device_path:
            return  # host-routed experts: a forward would move experts before the first request
        ids = torch.zeros((1, 1), dtype=torch.long, device=self.ctx.device)
        hidden = torch.zeros((1, 1, self.tap.stop - self.tap.start), dtype=self.ctx.dtype, device=self.ctx.device)
        with cpu_linear.noting() as noted:
            self.head(ids, hidden, 0, self.cache.rows(0, 1))
        self.cache.crop(0, row=0)
        cpu_linear.build_kernels(noted, lambda _: range(1, self.ctx.num_draft + 2))

    @torch.inference_mode()
    def prefill(self, req):
        self.cache.crop(0, row=req.slot)
        return {}

    def release(self, req):
        self.cache.crop(0, row=req.slot)

    @torch.inference_mode()
    def step(self, batch, inputs):
        features = inputs["features"]  # carried: row i's Features, hidden [1, T, n_taps*H] at start..start+T-1
        n, device = batch.size, self.ctx.device
        for i, req in batch.active():  # the features must continue exactly where the last cycle's pairs ended
            if self.cache.lengths[i] != features[i].start:
                raise DraftflowError(f"mtp: features start at {features[i].start} but the MTP cache holds "
                                     f"{self.cache.lengths[i]} pairs in slot {i}; feed mtp.features from the "
                                     "target's carried features output")
        last: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # row -> (logits [V], hidden [H]) of its last pair
        limit = batch.num_draft + 1  # longer runs (a prompt) catch up alone, so padding stays within the slack cells
        for i, req in batch.active():
            if features[i].hidden.shape[1] > limit:
                last[i] = self._catch_up_alone(req, features[i])
        short = {i: features[i] for i, _ in batch.active() if i not in last and features[i].hidden.shape[1] > 0}
        if short:
            last.update(self._catch_up(batch, short))
        width = max((req.num_draft for i, req in batch.active() if i in last), default=0)
        tokens = torch.zeros((n, width), dtype=torch.long, device=device)  # [n, K']: pad rows 0
        if width:
            self._chain(batch, last, tokens)
        wanted = [req.num_draft if req is not None and i in last else 0 for i, req in enumerate(batch.rows)]
        lengths = None
        if any(wanted[i] != width for i, _ in batch.active()):
            lengths = torch.tensor(wanted).to(device, non_blocking=True)  # [n]
        return {"proposal": Proposal(tokens, lengths=lengths)}

    def _pairs(self, req, f) -> tuple[torch.Tensor, torch.Tensor]:  # ids [T], hidden [T, H]
        """The (t_{i+1}, h_i) pairs the features bring: ids from the committed tokens, h from the last-layer tap."""
        t = f.hidden.shape[1]
        ids = torch.tensor(req.tokens[f.start + 1:f.start + t + 1], dtype=torch.long).to(self.ctx.device, non_blocking=True)
        return ids, f.hidden[0, :, self.tap]

    def _catch_up_alone(self, req, f) -> tuple[torch.Tensor, torch.Tensor]:  # logits [V], hidden [H]
        """A long run (a prompt) on its own slot's row, in chunks of ``prefill_chunk`` pairs."""
        cache, (ids, hidden) = self.cache.rows(req.slot, req.slot + 1), self._pairs(req, f)
        t = ids.shape[0]
        for s in range(0, t, self.chunk):
            logits, out = self.head(ids[None, s:s + self.chunk], hidden[None, s:s + self.chunk], f.start + s, cache)
            cache.commit(f.start + min(s + self.chunk, t))
        return logits[0, -1], out[0, -1]

    def _catch_up(self, batch, short: dict) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """Every short run in one forward over rows [0, n), each padded to the longest; other rows are pad rows."""
        n, device = batch.size, self.ctx.device
        if n == 1:  # batch 1: the run itself, no padding copies
            ((i, f),) = short.items()
            ids, hidden = self._pairs(batch.rows[i], f)
            logits, out = self.head(ids[None], hidden[None], f.start, self.cache.rows(0, 1))
            self.cache.commit(f.start + ids.shape[0], row=i)
            return {i: (logits[0, -1], out[0, -1])}
        t = max(f.hidden.shape[1] for f in short.values())
        ids = torch.zeros((n, t), dtype=torch.long, device=device)  # [n, T]
        hidden = torch.zeros((n, t, self.tap.stop - self.tap.start), dtype=self.ctx.dtype, device=device)  # [n, T, H]
        last_rows = [0] * n
        starts = list(self.cache.lengths[:n])  # pad rows sit at their slot's committed length: they write past it only
        for i, f in short.items():
            row_ids, row_hidden = self._pairs(batch.rows[i], f)
            ids[i, :row_ids.shape[0]] = row_ids
            hidden[i, :row_hidden.shape[0]] = row_hidden
            last_rows[i], starts[i] = row_ids.shape[0] - 1, f.start
        index = torch.tensor(last_rows).to(device, non_blocking=True)  # [n]
        logits, out = self.head(ids, hidden, starts, self.cache.rows(0, n), last_rows=index)  # [n, 1, V], [n, 1, H]
        for i, f in short.items():
            self.cache.commit(f.start + f.hidden.shape[1], row=i)
        return {i: (logits[i, 0], out[i, 0]) for i in short}

    def _chain(self, batch, last: dict, tokens: torch.Tensor) -> None:
        """Drafts 1..K' into ``tokens`` [n, K']: argmax of each row's last logits, then the head chained on its output."""
        n, k = tokens.shape
        if len(last) == n:  # every row drafts (always so at batch 1): no padding copies
            logits = torch.stack([last[i][0] for i in range(n)])  # [n, V]
            out = torch.stack([last[i][1] for i in range(n)])[:, None]  # [n, 1, H]
        else:
            logits = torch.zeros((n, last[next(iter(last))][0].shape[-1]), device=tokens.device)
            out = torch.zeros((n, 1, self.tap.stop - self.tap.start), dtype=self.ctx.dtype, device=tokens.device)
            for i, (row_logits, row_out) in last.items():
                logits[i], out[i, 0] = row_logits, row_out
        pos = list(self.cache.lengths[:n])  # next pair of each row: (draft 1, its hidden) at its committed length
        for j in range(k):
            tokens[:, j] = logits.argmax(-1)
            if j + 1 < k:
                step_logits, out = self.head(tokens[:, j:j + 1], out, [p + j for p in pos], self.cache.rows(0, n))
                logits = step_logits[:, 0]


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

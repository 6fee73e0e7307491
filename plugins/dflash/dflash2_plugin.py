"""The `dflash2` drafter node and the selector nodes `dflash2-selector` and `top1-selector`.

`dflash2` runs the DFlash2 backbone (DFlash's block forward with the convolutions) and
outputs `candidates`: the top-M ids of each draft row's logits, their unary logits and
the rows' final-normed hidden states. A selector node turns them into the `proposal`:

- `dflash2-selector`: the learned pairwise walk (see `model.walk`); greedy at T = 0, at
  T > 0 sampled, with q over the M candidates for candidate-restricted rejection sampling.
- `top1-selector`: the ablation without the pairwise term; argmax of the unary logits at
  T = 0, at T > 0 a sample from softmax(unary / T) over the candidates (with that q).

The selector's weights are in the dflash2 artifact. They travel with the candidates: the
drafter emits `DFlash2Candidates`, a `Candidates` that also references the drafter's
`CandidateSelector` module (no copy), so a selector needs no name lookup and works with
whichever dflash2 node feeds it. The `dflash2-source` check rejects graphs where another
kind of node feeds `dflash2-selector`. Where the drafter replays its proposals as CUDA
graphs, its candidates also carry the greedy walk as CUDA graphs (`selector_graphs`),
which `dflash2-selector` replays for a lone greedy request.
"""

from __future__ import annotations

import attrs
import torch

from draftflow.layers import cpu_linear
from draftflow.layers.sampling import sample
from draftflow.plugin import (
    BATCH,
    EMBED_BUFFER,
    HEAD_BUFFER,
    TARGET_HANDLE,
    BufferSpec,
    Candidates,
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
    kv_dim,
    wrong_target_check,
)
from draftflow.plugins.dflash.checks import defer_check, tap_layer_check
from draftflow.plugins.dflash.config import drafter_dtype, head_copy_bytes, kv_shape, node_dtype
from draftflow.plugins.dflash.dflash2_config import weight_bytes
from draftflow.plugins.dflash.dflash2_loader import load_drafter, read_config
from draftflow.plugins.dflash.dflash2_model import CandidateSelector, walk
from draftflow.plugins.dflash.plugin import (CONTEXT_CHUNK, KV_GROW_REASON, DFlash, confident_width, shortcut_hooks,
                                             slot_width, trained_for)
from draftflow.plugins.dflash.plugin import DEFER_DOC, PARAMS as DFLASH_PARAMS
from draftflow.plugins.dflash.selector_graphs import GreedyWalkGraphs

PARAMS = (ParamSpec("path", "path", help="DFlash2 directory (config.json + safetensors) or .gguf file"),
          *DFLASH_PARAMS[1:])  # cuda_graphs, triton, dtype, defer_min, min_path_prob (the top candidate's probability)


@attrs.define
class DFlash2Candidates(Candidates):
    """`Candidates` plus the producing drafter's selector weights (a module reference) and, on CUDA with graphs, its
    greedy walk as CUDA graphs (`selector_graphs.GreedyWalkGraphs`, B = 1)."""

    selector: CandidateSelector | None = None
    walk_graphs: GreedyWalkGraphs | None = None


def manifest(params, env) -> Manifest:
    cfg = read_config(params["path"])
    own = drafter_dtype(params, env.dtype)
    base, dtype = cfg.base, getattr(torch, own)
    h, taps, b = base.hidden_size, base.num_taps, base.block_size
    rows = env.max_batch * b  # every slot's block rows in one pass
    scratch = (CONTEXT_CHUNK * (taps * h + 4 * h) + rows * (6 * h + 2 * base.intermediate_size)) * dtype.itemsize \
        + 2 * rows * cfg.vocab_size * 4
    return Manifest(
        role="drafter",
        inputs=(Port("features", "features", carried=True,
                     doc=f"target taps of layers {list(base.target_layer_ids)} for the newly committed tokens"),
                Port("defer", "proposal", required=False, doc=DEFER_DOC, auto=False)),
        outputs=(Port("candidates", "candidates",
                      doc=f"top-{cfg.selector_top_k} ids and unary logits per draft row, with hidden states"),),
        owns=(BufferSpec("dflash2_kv", kv_shape(base, kv_dim(slot_width(base, env.num_draft)), BATCH), own,
                         doc="context K/V per draft layer and request slot, addressed by position; "
                             "slack cells past the context for a block"),),
        vram=Vram(weights=weight_bytes(cfg, dtype) + head_copy_bytes(cfg.vocab_size, h, own, env.dtype), scratch=scratch),
        reads=(EMBED_BUFFER, HEAD_BUFFER),
        requires={"target.features", TARGET_HANDLE},
        incompatible=(Incompatibility("kv.grow", KV_GROW_REASON.replace("DFlash", "DFlash2")),),
    )


class DFlash2(DFlash):
    """DFlash's node (binding, feature ingest, block forward) on the DFlash2 model; emits candidates."""

    KIND = "dflash2"
    GRAMMAR_DRAFTS = False  # the selector picks the drafts from the candidates; only the verifier masks them

    def __init__(self, ctx):
        Node.__init__(self, ctx)
        self.dtype = node_dtype(ctx.params, ctx.dtype)
        self.model, self.config2 = load_drafter(ctx.params["path"], ctx.device, self.dtype)
        self._fuse()
        self.config = self.config2.base  # what DFlash's binding and block forward read
        self.compiler = None  # DFlash's grammar compiler, never built here (GRAMMAR_DRAFTS)
        self._init_slots(ctx.buffers["dflash2_kv"])  # [L, 2, max_batch, kv_tokens + W, KVH, D]
        self.min_path_prob = float(ctx.params["min_path_prob"])
        self.walk_graphs = None  # `_walk_graphs`: built with the proposal runner
        self._bind()

    def _bind(self) -> None:
        super()._bind()
        if self.embed.shape[0] < self.config2.vocab_size:
            raise ModelFormatError(f"node '{self.name}' (dflash2): the selector's codebooks have "
                                   f"{self.config2.vocab_size} rows but the target's vocabulary has "
                                   f"{self.embed.shape[0]}; use the drafter trained for this target")

    def _walk_graphs(self) -> GreedyWalkGraphs | None:
        """The selector's greedy walk of one request as CUDA graphs, wherever the proposals replay graphs."""
        runner = self._runner()
        if self.walk_graphs is None and runner is not None:
            cfg = self.config2
            rows = min(self.ctx.num_draft, cfg.base.block_size - 1)
            self.walk_graphs = GreedyWalkGraphs(self.model.candidate_selector, rows, cfg.selector_top_k,
                                                cfg.base.hidden_size, self.dtype, self.ctx.device,
                                                capture=runner.capture)
        return self.walk_graphs

    @torch.inference_mode()
    def warmup(self) -> None:
        """DFlash's warm-up, then every row count's greedy-walk graph."""
        super().warmup()
        if self._walk_graphs() is not None:
            self.walk_graphs.warmup()

    def _warm_eager(self) -> torch.Tensor:
        hidden = super()._warm_eager()
        with cpu_linear.noting() as noted:
            self.model.candidate_selector.hidden_projection(hidden)  # the selector nodes' walk reads it
        if self.min_path_prob > 0:  # the walk reads the rows before the cut: 1..K (CPU: oneDNN's kernels for each)
            cpu_linear.build_kernels(noted, lambda _: range(1, hidden.shape[1] + 1))
        return hidden

    @torch.inference_mode()
    def step(self, batch, inputs):
        drafted = self.draft_block(batch, inputs)
        selector = self.model.candidate_selector
        if drafted is None:
            m, device = self.config2.selector_top_k, self.ctx.device
            return {"candidates": DFlash2Candidates(torch.empty(batch.size, 0, m, dtype=torch.long, device=device),
                                                    torch.empty(batch.size, 0, m, device=device), None, selector)}
        hidden, logits, _ = drafted  # [B, K, H], [B, K, V]
        # Codebooks may be narrower than a padded target head: never propose an id without a row.
        # Penalties and bias (committed prefix only) pick and weigh the candidates.
        logits = self.processed(batch, logits[..., :self.config2.vocab_size])
        if self.min_path_prob > 0:  # cut first: the top-M below reads only the rows kept
            k = confident_width(logits, self.min_path_prob)
            logits, hidden = logits[:, :k], hidden[:, :k]
        scores, ids = logits.topk(self.config2.selector_top_k, dim=-1)  # [B, k, M] each, best first
        return {"candidates": DFlash2Candidates(ids, scores, hidden, selector, self._walk_graphs())}


def selector_manifest(params, env) -> Manifest:
    return Manifest(
        role="selector",
        inputs=(Port("candidates", "candidates", doc="top-M candidates per draft row"),),
        outputs=(Port("proposal", "proposal"),),
        provides={"sampling.temperature>0"},
    )


def row_widths(batch, k: int) -> list[int]:
    """Drafts each row of a K-column batch wants (0 for pad rows): a row picks its first min(K, num_draft) drafts
    exactly as it would alone, so a sampled row draws the same numbers whatever else is batched."""
    return [0 if r is None else min(k, r.num_draft) for r in batch.rows]


def batch_proposal(batch, ids: torch.Tensor, drafts: torch.Tensor, sampled: list, widths: list[int]) -> Proposal:
    """Rows' candidate picks in one Proposal: q one-hot over the candidates for greedy rows when some row sampled."""
    # ids: [B, K, M]; drafts: [B, K] (greedy picks, sampled rows' overwritten); sampled: (row, q [k, M])
    probs = None
    if sampled:
        probs = (ids == drafts[..., None]).float()  # [B, K, M]: candidate ids are distinct per row
        for i, q in sampled:
            probs[i, :q.shape[0]] = q
    lengths = torch.tensor(widths, dtype=torch.long).to(ids.device)
    return Proposal(drafts, probs=probs, candidate_ids=None if probs is None else ids, lengths=lengths)


class DFlash2Selector(Node):
    """The learned pairwise walk over the candidates."""

    @torch.inference_mode()
    def step(self, batch, inputs):
        cand = inputs["candidates"]
        n, k = cand.ids.shape[:2]
        if k == 0:
            return {"proposal": Proposal(cand.ids[..., 0])}
        selector = getattr(cand, "selector", None)
        if selector is None:
            raise ModelFormatError(f"node '{self.name}' (dflash2-selector): its candidates carry no selector weights; "
                                   "feed it from a dflash2 node, or use plugin: top1-selector")
        device = cand.ids.device
        if n == 1:
            req = batch.rows[0]
            walk_graphs = getattr(cand, "walk_graphs", None)
            if walk_graphs is not None and req.sampling.temperature <= 0:
                return {"proposal": Proposal(walk_graphs(cand.ids, cand.scores, cand.hidden, req.anchor))}
            anchor = torch.full((1,), req.anchor, dtype=torch.long, device=device)
            drafts, q = walk(selector, cand.ids, cand.scores, cand.hidden, anchor, req.sampling.temperature,
                             req.generator)
            if q is None:
                return {"proposal": Proposal(drafts)}
            return {"proposal": Proposal(drafts, probs=q, candidate_ids=cand.ids)}
        anchors = torch.tensor([0 if r is None else r.anchor for r in batch.rows], dtype=torch.long).to(device)
        drafts, _ = walk(selector, cand.ids, cand.scores, cand.hidden, anchors, 0.0)  # [B, K]: every row greedy
        widths, sampled = row_widths(batch, k), []
        for i, req in batch.active():
            t, w = req.sampling.temperature, widths[i]
            if t > 0 and w > 0:
                row, q = walk(selector, cand.ids[i:i + 1, :w], cand.scores[i:i + 1, :w], cand.hidden[i:i + 1, :w],
                              anchors[i:i + 1], t, req.generator)
                drafts[i, :w] = row[0]
                sampled.append((i, q[0]))
        return {"proposal": batch_proposal(batch, cand.ids, drafts, sampled, widths)}


class Top1Selector(Node):
    """Ablation: no pairwise term; the unary logits alone pick (T = 0) or weigh (T > 0) the candidates."""

    @torch.inference_mode()
    def step(self, batch, inputs):
        cand = inputs["candidates"]  # ids, scores: [B, K, M]
        n, k = cand.ids.shape[:2]
        greedy = cand.ids.gather(-1, cand.scores.argmax(dim=-1, keepdim=True))[..., 0]  # [B, K]
        if k == 0:
            return {"proposal": Proposal(greedy)}
        if n == 1:
            t = batch.rows[0].sampling.temperature
            return {"proposal": Proposal(greedy) if t == 0 else self._sampled(cand.ids, cand.scores, t,
                                                                             batch.rows[0].generator)}
        widths, sampled = row_widths(batch, k), []
        for i, req in batch.active():
            t, w = req.sampling.temperature, widths[i]
            if t > 0 and w > 0:
                row = self._sampled(cand.ids[i:i + 1, :w], cand.scores[i:i + 1, :w], t, req.generator)
                greedy[i, :w] = row.tokens[0]
                sampled.append((i, row.probs[0]))
        return {"proposal": batch_proposal(batch, cand.ids, greedy, sampled, widths)}

    @staticmethod
    def _sampled(ids: torch.Tensor, scores: torch.Tensor, t: float, generator) -> Proposal:
        """A draw from softmax(unary / T) over the candidates, with that q: a deterministic top-1 draft with a
        non-one-hot q would not be lossless."""
        # ids, scores: [1, k, M]
        q = (scores.float() / t).softmax(dim=-1)  # [1, k, M]
        pick = sample(q, generator)  # [1, k]
        return Proposal(ids.gather(-1, pick[..., None])[..., 0], probs=q, candidate_ids=ids)


def backbone(path: str):
    """The DFlash config of a DFlash2 artifact's block drafter."""
    return read_config(path).base


check_tap_layers = tap_layer_check("dflash2", lambda path: backbone(path).target_layer_ids)
check_target = wrong_target_check("dflash2", lambda params: trained_for(backbone(params["path"])))
check_defer = defer_check("dflash2")


def check_selector_source(plan):
    """A dflash2-selector's candidates come from a dflash2 node (whose artifact holds the codebooks)."""
    for edge in plan.edges:
        dst, src = plan.nodes.get(edge.dst), plan.nodes.get(edge.src)
        if dst is None or src is None or dst.node_type.name != "dflash2-selector" or src.node_type.name == "dflash2":
            continue
        yield Problem(edge.dst, "dflash2-source", f"candidates come from '{edge.src}' ({src.node_type.name}), which "
                      "has no selector codebooks", f"feed {edge.dst}.candidates from a dflash2 node, or use plugin: "
                      "top1-selector", "dflash2", plan.spec.node(edge.dst).where if plan.spec.node(edge.dst) else "")


def check_candidates_used(plan):
    """A dflash2 node's candidates feed some node; else it would draft nothing, silently."""
    fed = {e.src for e in plan.edges if e.src_port == "candidates"}
    for name, node in plan.nodes.items():
        if node.node_type.name == "dflash2" and name not in fed:
            yield Problem(name, "dflash2-unused", "its candidates feed no node, so the graph never drafts",
                          f"add a selector node, e.g. `selector: {{plugin: dflash2-selector}}` (or top1-selector), "
                          f"fed by {name}.candidates", "dflash2",
                          plan.spec.node(name).where if plan.spec.node(name) else "")


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="dflash2", role="drafter", manifest=manifest, factory=DFlash2, params=PARAMS,
        capabilities=("candidates",),
        description="DFlash2 block drafter: DFlash + dynamic convolutions; top-M candidates per draft row"))
    registry.add_node_type(NodeType(
        name="dflash2-selector", role="selector", manifest=selector_manifest, factory=DFlash2Selector, params=(),
        capabilities=("proposal", "sampling.temperature>0"),
        description="DFlash2's learned candidate selector: pairwise codebook walk over the drafter's candidates"))
    registry.add_node_type(NodeType(
        name="top1-selector", role="selector", manifest=selector_manifest, factory=Top1Selector, params=(),
        capabilities=("proposal", "sampling.temperature>0"),
        description="ablation selector: top-1 of the unary logits (T > 0: softmax over the candidates)"))


@hookimpl
def draftflow_add_checks(registry):
    registry.add_check("dflash2-taps", check_tap_layers)
    registry.add_check("dflash2-target", check_target)
    registry.add_check("dflash2-defer", check_defer)
    registry.add_check("dflash2-source", check_selector_source)
    registry.add_check("dflash2-unused", check_candidates_used)


draftflow_target_params, draftflow_shortcut_defaults = shortcut_hooks("dflash2", backbone)

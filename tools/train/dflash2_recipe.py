"""DFlash2 training: the DFlash recipe plus the candidate selector's loss.

Everything DFlash does is reused (`dflash_recipe.py`): random anchors, `[anchor, MASK…]`
blocks that see the context strictly before their anchor plus their own rows, the
position-decayed cross-entropy of the unary logits, and the shared loop (AdamW, cosine
warm-up, bf16 autocast, clipping, checkpoints). The block forward runs the layers'
`attention_conv` / `mlp_conv` wrappers on each block's rows, as the `dflash2` node does.

Selector loss (speculators' DFlash2 objective, docs: shared/reference/dflash2.md §6), per
draft row n with final-normed hidden h_n and unary logits l_n:
- candidates C_n = top-M ids of l_n, best first (what the `dflash2` node emits); when the
  row's label y_n is not among them it replaces the weakest (the last), so every row
  trains the selector (`recall` reports how often no injection was needed);
- predecessor = the label of the row before (teacher forcing; the anchor for row 1), which
  is what the selector walk conditions on whenever the row is verified;
- score_n[k] = l_n[C_n[k]] + <A[prev] ⊙ W_hid h_n, S[C_n[k]]>, exactly `model.walk`'s score;
- M-way cross-entropy towards y_n's slot, weighted by the same exp(-(k-1)/gamma) as the
  token loss. Total = token loss + alpha(t) · selector loss, alpha(t) = 0 for the first
  `warmup` share of the run, then a linear ramp to `alpha` over `ramp` (SpecForge's
  defaults: 0.0005 each). Without `stop_gradient` the selector loss also trains the unary
  logits and hidden states (SpecForge's default).

Initialisation: the DFlash backbone as `init_weights` makes it (or the tensors of a trained
DFlash drafter, `init_from`), both convolutions as identities (tap 0 = 1, other taps 0,
kernel projection 0) and a zero successor codebook (a trained DFlash2 drafter is instead
continued as it is: `continue_drafter`). With those, the DFlash2 drafter starts
as exactly its backbone with the top-1 selector: a trained DFlash drafter is a lossless
starting point, and the new parts only learn what improves on it. The base kernels are not
weight-decayed (decay would pull their identity taps towards zero).
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from draftflow.core.errors import DraftflowError
from draftflow.plugins.dflash.config import DFlashConfig
from draftflow.plugins.dflash.loader import read_artifact
from draftflow.plugins.dflash.dflash2_config import CODEBOOKS, DFlash2Config
from draftflow.plugins.dflash.dflash2_loader import is_dflash2
from draftflow.plugins.dflash.dflash2_loader import load_drafter as load_dflash2
from draftflow.plugins.dflash.dflash2_model import DFlash2Model, walk
from draftflow.tools.train.dflash_recipe import Blocks, DFlashRecipe
from draftflow.tools.train.loop import init_weights

# The selector-loss schedule of SpecForge (shares of the run): weight 0, then a linear ramp.
SELECTOR_WARMUP, SELECTOR_RAMP = 0.0005, 0.0005


def init_backbone_config(path: str, target) -> DFlashConfig:
    """The backbone config of the trained DFlash (v1) drafter at `path`, checked against the target."""
    if is_dflash2(path):
        raise DraftflowError(f"--init-from {path}: a DFlash2 drafter; `draftflow train dflash --init-from` takes a "
                             "DFlash (v1) drafter (continue a DFlash2 drafter with `draftflow train dflash2`)")
    return _fits_target(read_artifact(path).config, path, target)


def continue_drafter(path: str, target, device=None) -> DFlash2Model:
    """The trained DFlash2 drafter at `path`, loaded as the dflash2 node loads it (its own config, every tensor) in
    float32 and trainable, its backbone checked against the target."""
    drafter, cfg = load_dflash2(path, device, torch.float32)
    _fits_target(cfg.base, path, target)  # its codebooks keep their own vocabulary (may be narrower than the target's)
    return drafter.requires_grad_(True)


def _fits_target(cfg: DFlashConfig, path: str, target) -> DFlashConfig:
    """`cfg` (a trained drafter's backbone) checked against the target, with the target's sizes filled in."""
    t = target.config
    if cfg.hidden_size != t.hidden_size:
        raise DraftflowError(f"--init-from {path}: hidden size {cfg.hidden_size} but the target's is {t.hidden_size}; "
                             "use a drafter trained for this target")
    if max(cfg.target_layer_ids) >= t.num_layers or not 0 <= cfg.mask_token_id < t.vocab_size:
        raise DraftflowError(f"--init-from {path}: taps {list(cfg.target_layer_ids)} / mask {cfg.mask_token_id} do not "
                             f"fit the target ({t.num_layers} layers, vocabulary {t.vocab_size}); use a drafter trained "
                             "for this target")
    return attrs.evolve(cfg, vocab_size=t.vocab_size, num_target_layers=t.num_layers)


def load_backbone(drafter: torch.nn.Module, init_from: str, grown_from: int | None = None) -> None:
    """Copy the trained DFlash (v1) drafter's tensors at `init_from` into `drafter` (DFlash2: its backbone part);
    `grown_from`: the drafter has layers from this index on that `init_from` lacks (left as they are)."""
    tensors = read_artifact(init_from).tensors
    missing = set(drafter.state_dict()) - set(tensors)
    missing = {n for n in missing if not n.startswith("candidate_selector.") and "_conv." not in n}
    if grown_from is not None:
        missing = {n for n in missing if not (n.startswith("layers.") and int(n.split(".")[1]) >= grown_from)}
    if missing:
        raise DraftflowError(f"--init-from {init_from}: no tensor for {sorted(missing)[:3]}; the backbone "
                             "must match the drafter's shape")
    with torch.no_grad():
        drafter.load_state_dict(tensors, strict=False)


def new_drafter(cfg: DFlash2Config, seed: int = 0, init_from: str | None = None, device=None) -> DFlash2Model:
    """A trainable DFlash2 drafter: fresh (or `init_from`'s) backbone, identity convolutions, zero successor codebook."""
    drafter = DFlash2Model(cfg, device=device)
    init_weights(drafter, seed=seed)
    with torch.no_grad():
        if init_from is not None:
            load_backbone(drafter, init_from)
        for layer in drafter.layers:
            for conv in (layer.attention_conv, layer.mlp_conv):
                conv.base_kernel.zero_()
                conv.base_kernel[:, 0] = 1.0
                conv.kernel_projection.weight.zero_()
        drafter.candidate_selector.successor_codebook.weight.zero_()
    return drafter


class DFlash2Recipe(DFlashRecipe):
    """DFlash's decayed block cross-entropy plus alpha x the selector's M-way cross-entropy."""

    def __init__(self, target, drafter: DFlash2Model, num_anchors: int = 16, gamma: float | None = None,
                 labels: str = "data", seed: int = 0, alpha: float = 1.0, warmup: float = SELECTOR_WARMUP,
                 ramp: float = SELECTOR_RAMP, stop_gradient: bool = False, distill: float = 0.0) -> None:
        super().__init__(target, drafter, num_anchors, gamma, labels, seed, distill)
        self.config2: DFlash2Config = drafter.config2
        self.alpha, self.warmup, self.ramp, self.stop_gradient = alpha, warmup, ramp, stop_gradient
        self.progress = 1.0  # set by the loop before each step; 1.0 = full weight (evaluation, direct use)
        self.no_weight_decay = {n for n, _ in drafter.named_parameters() if n.endswith(".base_kernel")}

    def selector_weight(self) -> float:
        """alpha(t): 0 during the warm-up share, then a linear ramp to alpha."""
        if self.progress < self.warmup:
            return 0.0
        return self.alpha * min(1.0, (self.progress - self.warmup) / self.ramp) if self.ramp > 0 else self.alpha

    def selector_loss(self, blocks: Blocks) -> tuple[torch.Tensor, torch.Tensor]:
        """Decayed M-way cross-entropy of the selector walk's scores (teacher-forced predecessor) and top-M recall."""
        m, vocab = self.config2.selector_top_k, self.config2.vocab_size
        logits = blocks.logits[:, :vocab]  # [R, V] with R = B*N*(W-1); the node's codebooks bound the ids too
        hidden = blocks.hidden.reshape(-1, blocks.hidden.shape[-1])  # [R, H]
        if self.stop_gradient:
            logits, hidden = logits.detach(), hidden.detach()
        gold = blocks.labels.flatten()  # [R]
        ids = logits.detach().topk(m, dim=-1).indices  # [R, M], best first as in the node
        hit = ids == gold[:, None]  # [R, M]
        inside = hit.any(-1)  # [R]
        ids = torch.where(inside[:, None], ids, torch.cat([ids[:, :-1], gold[:, None]], dim=-1))
        slot = torch.where(inside, hit.float().argmax(-1), torch.full_like(gold, m - 1))  # [R]
        prev = torch.cat([blocks.anchors[..., None], blocks.labels[..., :-1]], dim=-1).flatten()  # [R]
        sel = self.module.candidate_selector
        pair = sel.predecessor_codebook(prev) * sel.hidden_projection(hidden)  # [R, Rk]
        scores = logits.gather(1, ids) + torch.einsum("rk,rmk->rm", pair, sel.successor_codebook(ids))  # [R, M]
        ce = F.cross_entropy(scores.float(), slot, reduction="none").view_as(blocks.labels)
        return self.decayed_mean(ce), inside.float().mean()

    def loss(self, tokens: torch.Tensor, first_anchor: torch.Tensor | None = None) -> torch.Tensor:
        # tokens: [B, S]; first_anchor: [B] or None, as DFlashRecipe.loss
        blocks = self.forward_blocks(tokens, first_anchor)
        token, (selector, recall) = self.token_loss(blocks), self.selector_loss(blocks)
        # token_loss's own parts (ce and kl with distill) are kept
        self.loss_parts = {**self.loss_parts, "token_loss": token.detach(), "selector_loss": selector.detach(),
                           "recall": recall}
        return token + self.selector_weight() * selector

    def propose(self, prefix: torch.Tensor, feats: torch.Tensor, k: int) -> dict[str, torch.Tensor]:
        """The selector walk's K greedy drafts ("") and the top-1 ablation's ("top1"), from one drafter forward."""
        # prefix: [1, P]; feats: [1, P, n_taps*H]; returns {name: [K]}
        hidden, logits = self.draft_rows(prefix, feats, k)  # [1, K, H], [1, K, V]
        scores, ids = logits[..., :self.config2.vocab_size].topk(self.config2.selector_top_k, dim=-1)  # [1, K, M]
        drafts, _ = walk(self.module.candidate_selector, ids, scores, hidden, prefix[0, -1:], 0.0)
        return {"": drafts[0], "top1": ids[0, :, 0]}

    def hf_config(self) -> dict:
        return self.config2.to_hf_dict()

    def artifact_tensors(self) -> dict[str, torch.Tensor]:
        """As DFlash, with the codebooks spelled as published checkpoints spell them (no `.weight`)."""
        out = super().artifact_tensors()
        return {(n.removesuffix(".weight") if n.removesuffix(".weight") in CODEBOOKS else n): t for n, t in out.items()}

"""DFlash training: many `[anchor, MASK x (B-1)]` blocks per sequence in one drafter forward.

Per sequence `num_anchors` random anchors a (1 <= a <= S-B). Block b sits at positions
a_b .. a_b+B-1 and attends to the projected target features of positions < a_b (strictly
before its anchor: at inference the anchor's own features do not exist yet) plus the rows
of its own block, never another block. Row k >= 1 predicts token a+k with weight
exp(-(k-1)/gamma): early rows decide acceptance, so they count most. Labels are the data
tokens (`labels="data"`; on windows the target wrote itself, `train/regenerate.py`, that is
the paper's recipe) or the target's own greedy predictions at each position
(`labels="target"`, distillation on raw text, exact only for row 1). With `distill` = w > 0 a row's
loss is `(1 - w) * CE(label) + w * KL(p || q)`, p the target's own next-token distribution
(temperature 1) at the row's label position and q the row's unary distribution: the drafter
learns how sure the target is, which is what rejection sampling accepts at T > 0 (sum of
min(p, q)); the hard label keeps greedy drafting's argmax.

The forward is the node's own `DFlashModel.forward` (plugins/dflash/model.py), run without a
cache and with this recipe's metadata (`training_window`: positions and the context/block
mask); `tests/tools/test_train.py` pins that one anchor here gives exactly the node's
drafts. A layer's optional sublayer wrappers (DFlash2's convolutions) run on each block's
rows alone, as at inference, so `dflash2_recipe.py` trains through this same forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import attrs
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from draftflow.core.errors import DraftflowError
from draftflow.plugins.dflash.config import DFlashConfig
from draftflow.layers.kv_cache import KVCache
from draftflow.plugins.dflash.model import DFlashModel, Window, draft_logits, fold_mask
from draftflow.plugins.target.model import TargetModel
from draftflow.tools.train.loop import WindowKV, estimate_acceptance
from draftflow.tools.train.output import write_files

# Decay constants of the reference recipe, by block size ("paper Eq. 4").
DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def new_config(target: TargetModel, num_layers: int, block_size: int, tap_layers: tuple[int, ...], mask_token_id: int,
               intermediate_size: int | None = None) -> DFlashConfig:
    """A drafter config shaped like the target's layers (hidden size and heads must match its embedding)."""
    t = target.config
    return DFlashConfig(
        hidden_size=t.hidden_size, intermediate_size=intermediate_size or t.intermediate_size, num_layers=num_layers,
        num_heads=t.num_heads, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, rms_norm_eps=t.rms_norm_eps,
        rope_theta=t.rope_theta, rope_scaling=t.rope_scaling, max_position_embeddings=t.max_position_embeddings,
        block_size=block_size, target_layer_ids=tuple(tap_layers), mask_token_id=mask_token_id,
        num_target_layers=t.num_layers, vocab_size=t.vocab_size)


def grown_config(cfg: DFlashConfig, num_layers: int) -> DFlashConfig:
    """`cfg` with `num_layers` layers (more than it has); a listed layer type repeats the last one."""
    types = cfg.layer_types + (cfg.layer_types[-1:] * (num_layers - cfg.num_layers) if cfg.layer_types else ())
    return attrs.evolve(cfg, num_layers=num_layers, layer_types=types)


def zero_new_layers(drafter: DFlashModel, first: int) -> None:
    """Layers `first`.. add nothing to the residual stream yet (their attention output and MLP down projections
    zero), so a grown drafter drafts exactly as the drafter it grew from until training moves them."""
    with torch.no_grad():
        for layer in drafter.layers[first:]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()


def training_window(drafter: DFlashModel, anchors: torch.Tensor, seq: int, width: int) -> Window:
    """The forward's metadata for N blocks per sequence: block b sits at a_b .. a_b+W-1 and sees the context
    strictly before a_b plus its own rows (causally in causal layers), never another block; in a sliding-window
    layer only the context cells less than its window behind each row (as the node attends)."""
    # anchors: [B, N]; keys of the forward: the S context rows, then the N*W block rows
    cfg = drafter.config
    bsz, n = anchors.shape
    dev = anchors.device
    offset = torch.arange(width, device=dev)  # [W]
    ctx_pos = torch.arange(seq, device=dev)  # [S]
    row_anchor = anchors.repeat_interleave(width, dim=1)  # [B, N*W]
    row_block = torch.arange(n, device=dev).repeat_interleave(width)  # [N*W]
    row_k = offset.repeat(n)  # [N*W]
    sees_ctx = ctx_pos[None, None, :] < row_anchor[:, :, None]  # [B, N*W, S]
    same = row_block[:, None] == row_block[None, :]  # [N*W, N*W]
    groups = cfg.num_heads // cfg.num_kv_heads
    kinds = [(cfg.layer_is_causal(i), cfg.layer_span(i)) for i in range(cfg.num_layers)]
    by_kind = {}
    for causal, span in kinds:
        if span is not None and span < width:
            raise DraftflowError(f"drafter config: sliding_window {span} is shorter than the block of {width}; "
                                 "training needs a window of at least block_size")
        if (causal, span) not in by_kind:
            own = same & (row_k[None, :] <= row_k[:, None]) if causal else same
            ctx = sees_ctx if span is None else sees_ctx & ((row_anchor + row_k)[:, :, None] - ctx_pos < span)
            visible = torch.cat([ctx, own[None].expand(bsz, -1, -1)], dim=-1)[:, None]  # [B, 1, N*W, S+N*W]
            by_kind[causal, span] = fold_mask(visible, groups, None)
    masks = [by_kind[kind] for kind in kinds]
    block_pos = (anchors[:, :, None] + offset).reshape(bsz, n * width)  # [B, N*W]
    return Window(ctx_pos, block_pos, masks, seq + n * width, width)


def block_hidden(drafter: DFlashModel, features: torch.Tensor, block: torch.Tensor, anchors: torch.Tensor) -> torch.Tensor:
    """Normed hidden states of every block row, all blocks of a batch in one forward (the node's forward, no cache)."""
    # features: [B, S, n_taps*H]; block: [B, N*W, H] embedded rows; anchors: [B, N]; returns [B, N*W, H]
    window = training_window(drafter, anchors, features.shape[1], block.shape[1] // anchors.shape[1])
    return drafter(features, block, window)


class Blocks(NamedTuple):
    """One training forward: the draft rows of every block and what they are scored against."""

    hidden: torch.Tensor  # [B, N, W-1, H] final-normed drafter hidden states of rows 1..W-1
    logits: torch.Tensor  # [B*N*(W-1), V] float32 unary logits (target head, multiplier, softcap)
    labels: torch.Tensor  # [B, N, W-1] the token each row should draft
    anchors: torch.Tensor  # [B, N] the anchor token of each block (row 1's predecessor)
    teacher: torch.Tensor | None = None  # [B*N*(W-1), V] float32 p of the target at each row (distill only)
    teacher_neg_entropy: torch.Tensor | None = None  # [B*N*(W-1)] sum of p log p (distill only)


class DFlashRecipe:
    """Position-decayed block cross-entropy against a frozen target's features."""

    def __init__(self, target: TargetModel, drafter: DFlashModel, num_anchors: int = 16, gamma: float | None = None,
                 labels: str = "data", seed: int = 0, distill: float = 0.0) -> None:
        if labels not in ("data", "target"):
            raise ValueError(f"labels {labels!r}: expected 'data' or 'target'")
        if not 0.0 <= distill <= 1.0:
            raise ValueError(f"distill {distill}: expected a weight in [0, 1]")
        self.target, self.module, self.config = target, drafter, drafter.config
        self.num_anchors, self.labels, self.distill = num_anchors, labels, distill
        self.gamma = gamma or DEFAULT_GAMMA.get(self.config.block_size, 7.0)
        self.generator = torch.Generator().manual_seed(seed + 17)
        k = torch.arange(1, self.config.block_size, dtype=torch.float32)
        self.row_weight = torch.exp(-(k - 1) / self.gamma)  # [W-1]
        # Named parts of the last `loss` (detached), logged by the training loop; DFlash has only the one loss.
        self.loss_parts: dict[str, torch.Tensor] = {}

    def _anchors(self, bsz: int, seq: int, first: torch.Tensor | None = None) -> torch.Tensor:
        """N sorted anchors per row in [first, S-W] (first: [B], default 1; every label row stays in the window)."""
        width = self.config.block_size
        lows = [1] * bsz if first is None else [max(1, int(f)) for f in first]
        spans = [seq - width - lo + 1 for lo in lows]
        if min(spans) < 1:
            raise ValueError(f"windows of {seq} tokens leave no anchor in [{max(lows)}, {seq - width}] for blocks of "
                             f"{width}")
        n = min(self.num_anchors, min(spans))
        picks = [torch.randperm(span, generator=self.generator)[:n].sort().values + lo for span, lo in zip(spans, lows)]
        return torch.stack(picks)  # [B, N]

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.module.embed_block(tokens, self.target.embed_tokens.weight)

    def forward_blocks(self, tokens: torch.Tensor, first_anchor: torch.Tensor | None = None) -> Blocks:
        """Random anchors (at or after `first_anchor` [B] when given), one drafter forward over all their blocks,
        unary logits and labels."""
        # tokens: [B, S]
        cfg, width = self.config, self.config.block_size
        bsz, seq = tokens.shape
        with torch.no_grad():
            rows = None if self.labels == "target" or self.distill > 0 else 0  # 0: no logits, features only
            logits, feats = self.target(tokens, 0, WindowKV(), logit_rows=rows, tap_layers=cfg.target_layer_ids)
        anchors = self._anchors(bsz, seq, first_anchor).to(tokens.device)  # [B, N]
        n = anchors.shape[1]
        block = torch.full((bsz, n, width), cfg.mask_token_id, dtype=torch.long, device=tokens.device)
        block[:, :, 0] = tokens.gather(1, anchors)
        hidden = block_hidden(self.module, feats, self._embed(block.flatten(1)), anchors)  # [B, N*W, H]
        hidden = hidden.view(bsz, n, width, -1)[:, :, 1:]  # rows 1..W-1: [B, N, W-1, H]
        out = draft_logits(hidden.reshape(1, -1, hidden.shape[-1]), self.target.head_weight(), cfg)  # [1, B*N*(W-1), V]
        at = anchors[:, :, None] + torch.arange(1, width, device=tokens.device)  # [B, N, W-1] label positions
        source = tokens if self.labels == "data" else torch.cat([tokens[:, :1], logits.argmax(-1)[:, :-1]], 1)
        labels = source.gather(1, at.flatten(1)).view(bsz, n, width - 1)
        teacher = neg_entropy = None
        if self.distill > 0:  # logits[:, i] is the target's distribution of token i + 1
            with torch.no_grad():
                rows_at = (at - 1).flatten(1)  # [B, N*(W-1)]
                picked = logits.gather(1, rows_at[..., None].expand(-1, -1, logits.shape[-1]))  # [B, N*(W-1), V]
                log_p = F.log_softmax(picked.float(), dim=-1).flatten(0, 1)  # [R, V]
                del picked
                teacher = log_p.exp()
                neg_entropy = (teacher * log_p).sum(-1)  # [R]
        return Blocks(hidden, out[0], labels, block[:, :, 0], teacher, neg_entropy)

    def token_loss(self, blocks: Blocks) -> torch.Tensor:
        """Position-decayed cross-entropy of the unary logits (blended with the KL to the target with distill)."""
        if blocks.teacher is None:
            ce = F.cross_entropy(blocks.logits, blocks.labels.flatten(), reduction="none").view_as(blocks.labels)
            return self.decayed_mean(ce)
        log_q = F.log_softmax(blocks.logits, dim=-1)  # [R, V], shared by both terms (one [R, V] buffer fewer)
        ce = -log_q.gather(1, blocks.labels.flatten()[:, None]).view_as(blocks.labels)
        kl = (blocks.teacher_neg_entropy - (blocks.teacher * log_q).sum(-1)).view_as(blocks.labels)
        self.loss_parts = {"ce": self.decayed_mean(ce).detach(), "kl": self.decayed_mean(kl).detach()}
        return self.decayed_mean((1.0 - self.distill) * ce + self.distill * kl)

    def decayed_mean(self, per_row: torch.Tensor) -> torch.Tensor:
        """Mean over rows with weight exp(-(k-1)/gamma) for draft row k."""
        # per_row: [B, N, W-1]
        w = self.row_weight.to(per_row.device).expand_as(per_row)
        return (per_row * w).sum() / w.sum()

    def loss(self, tokens: torch.Tensor, first_anchor: torch.Tensor | None = None) -> torch.Tensor:
        # tokens: [B, S]; first_anchor: [B] first position a block may be anchored at (regenerated windows)
        return self.token_loss(self.forward_blocks(tokens, first_anchor))

    def draft_rows(self, prefix: torch.Tensor, feats: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states and unary logits of K draft rows after the anchor prefix[-1], through the inference path."""
        # prefix: [1, P]; feats: [1, P, n_taps*H] (the anchor's own row is not used); returns [1, K, H], [1, K, V]
        cfg, p = self.config, prefix.shape[1]
        dt = feats.dtype
        cache = KVCache.from_static(torch.zeros(cfg.num_layers, 2, 1, p + k + 1, cfg.num_kv_heads, cfg.head_dim,
                                                dtype=dt, device=feats.device))
        block = torch.full((1, k + 1), cfg.mask_token_id, dtype=torch.long, device=prefix.device)
        block[0, 0] = prefix[0, -1]
        hidden = self.module.draft(feats[:, : p - 1], 0, self._embed(block), cache)[:, 1:]  # [1, K, H]
        return hidden, draft_logits(hidden, self.target.head_weight(), cfg)

    def propose(self, prefix: torch.Tensor, feats: torch.Tensor, k: int) -> torch.Tensor:
        """K greedy drafts for the anchor prefix[-1], as the dflash node drafts them."""
        # prefix: [1, P]; feats: [1, P, n_taps*H]; returns [K]
        return self.draft_rows(prefix, feats, k)[1].argmax(-1)[0]

    def evaluate(self, windows: list[torch.Tensor], loss_windows=None, decode_tokens: int = 0) -> dict[str, float]:
        """Held-out loss (on `loss_windows` = (tokens [N, S], first_anchor [N]) when given) and acceptance (decoded
        too with `decode_tokens`: loop.decode_acceptance)."""
        device = self.target.norm.weight.device  # held-out windows live on the host
        totals: dict[str, float] = {}
        if loss_windows is None:
            scored = [(w[None], None) for w in windows]
        else:
            tokens, first = loss_windows
            scored = [(tokens[i:i + 1], first[i:i + 1]) for i in range(tokens.shape[0])]
        for w, first in scored:
            loss = self.loss(w.to(device), first)
            for name, value in {"loss": loss, **self.loss_parts}.items():
                totals[name] = totals.get(name, 0.0) + float(value)
        out = estimate_acceptance(self.target, windows, self.config.target_layer_ids, self.config.block_size - 1,
                                  self.propose, decode_tokens)
        return {name: total / max(1, len(scored)) for name, total in totals.items()} | out

    def hf_config(self) -> dict:
        return self.config.to_hf_dict()

    def artifact_tensors(self) -> dict[str, torch.Tensor]:
        """Checkpoint name -> float32 tensor (the module's names are the z-lab names)."""
        return {n: t.detach().float().contiguous() for n, t in self.module.state_dict().items()}

    def save(self, out: Path) -> None:
        """A z-lab layout directory: config.json + model.safetensors (no embedding, no LM head)."""
        import json

        tensors, config = self.artifact_tensors(), json.dumps(self.hf_config(), indent=2) + "\n"
        write_files(out, {"model.safetensors": lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}),
                          "config.json": lambda tmp: tmp.write_text(config)})

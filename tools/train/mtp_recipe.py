"""MTP training: next-next-token prediction from the target's hidden state and the next token.

For every position i of a window the head takes (t_{i+1}, h_i), h_i being the target's
final post-norm hidden state, and predicts t_{i+2} (the data token, or with
`labels="target"` the target's own greedy prediction there). The head is an MTP module of
`plugins/mtp/model.py`, unchanged, in either published layout:

- `deepseek-v3` (the default): its own output norm and LM head, starting as copies of the
  target's, so step 0 already predicts "the next token after t_{i+1}" as well as the target's
  last layer can from h_i;
- `qwen3-next`: its own output norm (x̂·(1+w), starting as the target's final norm) and the
  target's LM head, shared and frozen as in Qwen3-Next: the file holds V x H fewer weights
  (6.3 MB of the demo's BF16 head).
"""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from draftflow.plugins.mtp.model import MtpHead
from draftflow.plugins.mtp.weights import HEAD_NAMES, LAYOUTS
from draftflow.layers.kv_cache import KVCache, static_shape
from draftflow.plugins.target.model import TargetModel
from draftflow.tools.train.loop import WindowKV, estimate_acceptance, init_weights
from draftflow.tools.train.output import write_files

LAYOUT = "deepseek-v3"  # the default layout


def new_head(target: TargetModel, seed: int = 0, layout: str = LAYOUT) -> MtpHead:
    """A fresh trainable head bound to the target's embedding (qwen3-next: and LM head); out_norm starts as the
    target's final norm, deepseek-v3's own head as a copy of the target's."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {LAYOUTS}")
    head = MtpHead(target.config, layout, dtype=target.embed_tokens.weight.dtype, device=target.embed_tokens.weight.device)
    init_weights(head, seed=seed)
    with torch.no_grad():
        for name, p in head.named_parameters():  # a norm that scales by (1 + w) has unit gains at w = 0
            offset = head.block_cfg.norm_offset if name.startswith("block.") else layout == "qwen3-next"
            if offset and "norm" in name and p.dim() == 1:
                p.zero_()
        scale = target.norm.weight + 1 if target.config.norm_offset else target.norm.weight  # the target's gains
        head.out_norm.weight.copy_(scale - 1 if layout == "qwen3-next" else scale)
        if layout != "qwen3-next":
            head.head.weight.copy_(target.head_weight())
    head.bind(target.embed_tokens.weight, target.head_weight())
    return head


class MtpRecipe:
    """Cross-entropy of t_{i+2} from (t_{i+1}, h_i) over whole windows, against a frozen target."""

    def __init__(self, target: TargetModel, head: MtpHead, labels: str = "data", num_draft: int = 4) -> None:
        if labels not in ("data", "target"):
            raise ValueError(f"labels {labels!r}: expected 'data' or 'target'")
        self.target, self.module, self.labels, self.num_draft = target, head, labels, num_draft
        self.last = target.config.num_layers - 1

    def loss(self, tokens: torch.Tensor, first_anchor: torch.Tensor | None = None) -> torch.Tensor:
        # tokens: [B, S]; first_anchor (regenerated windows) is not needed: with labels="target" every position's
        # label is the target's own prediction given exactly the tokens the head sees
        with torch.no_grad():
            rows = None if self.labels == "target" else 0
            logits, hidden = self.target(tokens, 0, WindowKV(), logit_rows=rows, tap_layers=(self.last,))  # h: [B, S, H]
        out, _ = self.module(tokens[:, 1:-1], hidden[:, :-2], 0, WindowKV(), last_only=False)  # [B, S-2, V]
        labels = tokens[:, 2:] if self.labels == "data" else logits[:, 1:-1].argmax(-1)  # [B, S-2]
        return F.cross_entropy(out.flatten(0, 1), labels.flatten())

    def propose(self, prefix: torch.Tensor, feats: torch.Tensor, k: int) -> torch.Tensor:
        """K chained drafts after prefix[-1], exactly as the mtp node drafts them."""
        # prefix: [1, P]; feats: [1, P, H] (final hidden); returns [K]
        p = prefix.shape[1]
        one = attrs.evolve(self.target.config, num_layers=1)
        cache = KVCache.from_static(torch.zeros(static_shape(one, 1, p + k), dtype=feats.dtype, device=feats.device))
        logits, out = self.module(prefix[:, 1:], feats[:, : p - 1], 0, cache)  # pairs (t_{i+1}, h_i), i < P-1
        cache.commit(p - 1)
        drafts = []
        for j in range(k):
            tok = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            drafts.append(tok)
            if j + 1 < k:
                logits, out = self.module(tok, out, p - 1 + j, cache)
        return torch.cat(drafts, dim=1)[0]

    def evaluate(self, windows: list[torch.Tensor], loss_windows=None, decode_tokens: int = 0) -> dict[str, float]:
        """Held-out loss (on the regenerated `loss_windows` tokens when given) and acceptance (decoded too with
        `decode_tokens`: loop.decode_acceptance)."""
        device = self.target.norm.weight.device  # held-out windows live on the host
        scored = [w[None] for w in windows] if loss_windows is None else list(loss_windows[0].split(1))
        losses = [float(self.loss(w.to(device))) for w in scored]
        out = estimate_acceptance(self.target, windows, (self.last,), self.num_draft, self.propose, decode_tokens)
        return {"loss": sum(losses) / max(1, len(losses)), **out}

    def save(self, out: Path, target_config: dict) -> None:
        """`mtp.safetensors` with its layout's names (DeepSeek-V3: `model.layers.{N}.*`; Qwen3-Next: `mtp.*`, the
        block under `mtp.layers.0.`) and the target's config.json."""
        layout = self.module.layout
        prefix = f"model.layers.{self.target.config.num_layers}." if layout == "deepseek-v3" else "mtp."
        block = prefix if layout == "deepseek-v3" else "mtp.layers.0."
        names = HEAD_NAMES[layout]
        state = {}
        for name, t in self.module.state_dict().items():
            if name in ("embed", "shared_head"):  # the target's tensors, bound (and registered) by `bind`
                continue
            key = prefix + names[name] if name in names else block + name.removeprefix("block.")
            state[key] = t.detach().float().contiguous()
        config = json.dumps(dict(target_config, num_nextn_predict_layers=1), indent=2) + "\n"
        write_files(out, {"mtp.safetensors": lambda tmp: save_file(state, str(tmp), metadata={"format": "pt"}),
                          "config.json": lambda tmp: tmp.write_text(config)})

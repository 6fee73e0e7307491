"""The MTP head: one decoder block over (embedding of t_{i+1}, target hidden h_i) pairs.

    x_i    = proj(cat[norm_e(Emb(t_{i+1})), norm_h(h_i)])        # Linear 2H -> H, no bias
    y_i    = block(x_i)                                          # pre-norm attention + MLP
    logits = head(out_norm(y_i))                                 # predicts t_{i+2}

The pair (t_{i+1}, h_i) sits at RoPE position i (vLLM's convention). Chained drafting
feeds step j the embedding of draft j and the previous step's output hidden: ``y`` for
DeepSeek-V3, ``out_norm(y)`` for Qwen3-Next. The block is the target plugin's own
``DecoderLayer`` built from a one-layer config (``weights.block_config``): dense or sparse
MoE MLP, plain or gated attention, partial RoPE as the target's config says. Its MoE block
gets its own ``ExpertCache`` with every expert resident (the head runs a few tokens per
step, so it never needs eviction). Qwen3-Next norms compute x̂·(1+w) in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from draftflow.layers import cpu_linear
from draftflow.plugins.mtp.weights import block_config, read_state
from draftflow.layers.config import TargetConfig
from draftflow.layers.expert_cache import ExpertCache
from draftflow.layers.attention import Window
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.decoder import DecoderLayer
from draftflow.layers.norm import RMSNorm
from draftflow.layers.rope import rope_inv_freq, rope_tables
from draftflow.layers.moe import HostExperts, SparseMoeBlock


class UnitOffsetRMSNorm(RMSNorm):
    """Qwen3-Next RMSNorm: x̂·(1+w), computed in float32 and cast back (w starts at 0)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [..., dim]
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)


class MtpHead(nn.Module):
    """Weights of one MTP module; embedding (and Qwen3-Next's LM head) are bound from the target."""

    def __init__(self, cfg: TargetConfig, layout: str, dtype: torch.dtype, device=None,
                 block_cfg: TargetConfig | None = None) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        norm = UnitOffsetRMSNorm if layout == "qwen3-next" else RMSNorm
        self.cfg, self.layout = cfg, layout
        self.block_cfg = block_cfg or block_config(cfg, layout)
        self.norm_e, self.norm_h, self.out_norm = (norm(h, eps, dtype, device) for _ in range(3))
        self.proj = cpu_linear.Linear(2 * h, h, bias=False, dtype=dtype, device=device)
        self.block = DecoderLayer(self.block_cfg, dtype, device)  # layer 0 of a one-layer, full-attention config
        if layout != "qwen3-next":
            self.head = cpu_linear.Linear(h, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        inv_freq = rope_inv_freq(cfg)
        if device is not None and torch.device(device).type != "meta":
            inv_freq = inv_freq.to(device)  # meta models get it through `.to(device)` later
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.requires_grad_(False)
        self.embed: torch.Tensor | None = None  # [V, H], bound from the target
        self.shared_head: torch.Tensor | None = None  # [V, H], Qwen3-Next only
        self.expert_cache: ExpertCache | None = None  # MoE block only: its routed experts, all resident

    @property
    def is_moe(self) -> bool:
        return isinstance(self.block.mlp, SparseMoeBlock)

    def bind(self, embed: torch.Tensor, head: torch.Tensor) -> None:
        """Share the target's embedding and (Qwen3-Next) LM head instead of holding copies."""
        self.embed = embed
        self.shared_head = head if self.layout == "qwen3-next" else None

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64: t_{i+1}
        hidden: torch.Tensor,  # [B, T, H]: h_i (target) or the previous step's output
        start_pos: int | list[int],  # position i of each row's first pair (one int: every row)
        cache: KVCache,  # B rows (a `rows` view of the per-slot cache)
        last_only: bool = True,
        last_rows: torch.Tensor | None = None,  # [B] int64: the one pair per row to score (ragged rows)
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Return (logits [B, R, V] float32, next hidden [B, R, H]); R = 1 if last_only or last_rows, else T."""
        b, t = tokens.shape
        starts = [start_pos] * b if isinstance(start_pos, int) else list(start_pos)
        cache.ensure(max(starts) + t)
        window = Window.rows(starts, t, tokens.device)  # one start: the exact prefix, causal from 0 or one token
        e = F.embedding(tokens, self.embed)  # [B, T, H]
        cos, sin = rope_tables(self.inv_freq, window.positions.reshape(-1), e.dtype)  # [T or B*T, 1, D] each
        if window.per_row:
            cos, sin = cos.view(b, t, 1, -1), sin.view(b, t, 1, -1)
        x = self.proj(torch.cat([self.norm_e(e), self.norm_h(hidden.to(e.dtype))], dim=-1))  # [B, T, H]
        blk = self.block
        x = x + blk.self_attn(blk.input_layernorm(x), cos, sin, cache, 0, window=window)
        x = x + blk.mlp(blk.post_attention_layernorm(x))
        if last_rows is not None:
            x = x.gather(1, last_rows[:, None, None].expand(-1, 1, x.shape[-1]))  # [B, 1, H]
        elif last_only:
            x = x[:, -1:]
        normed = self.out_norm(x)
        head = self.shared_head if self.layout == "qwen3-next" else self.head.weight
        logits = cpu_linear.linear(normed, head).float()  # [B, R, V]
        return logits, (normed if self.layout == "qwen3-next" else x)


def load_head(ckpt, device: torch.device, dtype: torch.dtype) -> MtpHead:
    """Build on the meta device and assign the checkpoint tensors (no double allocation)."""
    head = MtpHead(ckpt.config, ckpt.layout, dtype, device="meta", block_cfg=ckpt.block_config)
    is_moe = head.is_moe
    # Routed experts are not module parameters: read them to the host and stack them as the target loader does.
    state = read_state(ckpt, device, dtype, host_prefix="block.mlp.experts." if is_moe else None)
    if is_moe:
        experts = {"layers.0." + n.removeprefix("block."): state.pop(n) for n in list(state) if n.startswith("block.mlp.experts.")}
        host = HostExperts.pop_from_state(experts, head.block_cfg, pin=False)  # never re-read: all stay resident
    head.load_state_dict(state, strict=True, assign=True)
    head = head.to(device)
    if is_moe:
        head.expert_cache = ExpertCache(host, None, head.block_cfg.num_experts_per_tok, device)
        head.expert_cache.attach([head.block.mlp])
    return head

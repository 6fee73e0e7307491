"""An independent MTP reference, written from the published equations in plain torch (float32).

    x_i = proj(cat[norm_e(Emb(t_{i+1})), norm_h(h_i)]);  y = block(x);  logits = head(out_norm(y))

The block is a pre-norm decoder layer (RMSNorm, GQA attention with RoPE at position i,
SiLU-gated MLP). Everything is recomputed over the whole pair sequence each step: no KV
cache, no shared code with draftflow.
"""

from __future__ import annotations

import math

import torch


def rms(x, w, eps, unit_offset):
    x = x.float()
    y = x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y * (1.0 + w) if unit_offset else y * w


def rope(x, pos, theta):
    # x: [T, heads, D]; half-split pairs (i, i + D/2) rotate by pos * theta^(-2i/D)
    d = x.shape[-1]
    inv = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)  # [D/2]
    ang = pos[:, None].float() * inv[None]  # [T, D/2]
    cos, sin = ang.cos()[:, None], ang.sin()[:, None]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def block(w, x, cfg, unit):
    """w: block weights by relative name; x: [T, H] -> [T, H]."""
    t, eps, d = x.shape[0], cfg.rms_norm_eps, cfg.head_dim
    nh, nkv = cfg.num_attention_heads, cfg.num_key_value_heads
    pos = torch.arange(t)
    h = rms(x, w["input_layernorm.weight"], eps, unit)
    q = (h @ w["self_attn.q_proj.weight"].T).view(t, nh, d)
    k = (h @ w["self_attn.k_proj.weight"].T).view(t, nkv, d)
    v = (h @ w["self_attn.v_proj.weight"].T).view(t, nkv, d)
    if "self_attn.q_norm.weight" in w:
        q, k = rms(q, w["self_attn.q_norm.weight"], eps, unit), rms(k, w["self_attn.k_norm.weight"], eps, unit)
    theta = cfg.rope_parameters["rope_theta"] if getattr(cfg, "rope_parameters", None) else cfg.rope_theta
    q, k = rope(q, pos, theta), rope(k, pos, theta)
    k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(d)
    scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
    att = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(t, nh * d)
    x = x + att @ w["self_attn.o_proj.weight"].T
    h = rms(x, w["post_attention_layernorm.weight"], eps, unit)
    gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
    return x + (gate * torch.sigmoid(gate) * up) @ w["mlp.down_proj.weight"].T


def mtp_forward(state, layout, cfg, embed, lm_head, tokens, hidden):
    """tokens: [T] (t_{i+1}); hidden: [T, H] (h_i) -> (logits [T, V], next hidden [T, H])."""
    unit = layout == "qwen3-next"
    eps = cfg.rms_norm_eps
    if unit:
        p, bp = "mtp.", "mtp.layers.0."
        names = ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "fc", "norm")
    else:
        p = bp = f"model.layers.{cfg.num_hidden_layers}."
        names = ("enorm", "hnorm", "eh_proj", "shared_head.norm")
    ne, nh_, proj, on = (state[p + n + ".weight"] for n in names)
    head = lm_head if unit else state[p + "shared_head.head.weight"]
    w = {k[len(bp):]: v for k, v in state.items() if k.startswith(bp)}
    x = torch.cat([rms(embed[tokens], ne, eps, unit), rms(hidden, nh_, eps, unit)], dim=-1) @ proj.T
    y = block(w, x, cfg, unit)
    normed = rms(y, on, eps, unit)
    return normed @ head.T, (normed if unit else y)


def draft_chain(state, layout, cfg, embed, lm_head, tokens, hidden, k):
    """Greedy drafts of k chained steps after the pairs (tokens, hidden); also the per-step logits."""
    tokens, hidden, drafts, logits_seen = list(tokens), hidden, [], []
    for _ in range(k):
        logits, nxt = mtp_forward(state, layout, cfg, embed, lm_head, torch.tensor(tokens), hidden)
        logits_seen.append(logits[-1])
        drafts.append(int(logits[-1].argmax()))
        tokens.append(drafts[-1])
        hidden = torch.cat([hidden, nxt[-1:]], dim=0)
    return drafts, (torch.stack(logits_seen) if logits_seen else None)

"""Static-shape target steps, captured once per (window, KV bucket) and replayed as CUDA graphs.

A decode or verify window of W tokens starts at a position that changes every cycle. To
keep every shape fixed, the start lives in a device tensor: RoPE angles, the K/V write
positions (`index_copy_`) and the attention mask are computed from it on the device, and
attention reads a fixed prefix of the cache, a *bucket* (a power of two >= start+W, capped
at the capacity), with the keys after each query masked out. One graph per (W, bucket) is
captured on first use; a replay then runs the whole forward with no Python and no host
synchronisation.

At batch 1 the matrix products are memory-bound GEMVs and everything between them is
launch-bound, so the small work is fused: torch.compile turns residual add + RMSNorm and
the SiLU gate into one kernel each, `fuse_projections` lets q/k/v and gate/up run as one
product each, and on CUDA two Triton kernels (`kernels.py`) do q/k-norm + RoPE + the KV
write in one launch and attention split over key blocks, so its cost stays flat in context
length. The math is the eager model's, op for op, so float32 results agree with
`TargetModel.forward` to rounding (tests/plugins/target/test_graph_step.py); numbers and the
profile are in docs/BENCHMARKS.md.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
import torch
import torch.nn.functional as F
from torch import nn

from draftflow.layers.attention import MIN_BUCKET, attend_prefix, bucket_for
from draftflow.layers.graphs import GraphCache
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.rope import rotate
from draftflow.plugins.target.model import TargetModel



# --- weight layout -------------------------------------------------------------------------
def fuse_projections(model: TargetModel) -> None:
    """Store each layer's q/k/v weights (and biases) in one tensor, and gate/up in another.

    The parameters stay the model's own: each becomes a row-slice view of its group's
    tensor, so the eager path computes exactly what it did and no weight is duplicated
    (one group's worth is allocated transiently). Idempotent.
    """
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        _rehome([attn.q_proj, attn.k_proj, attn.v_proj])
        _rehome([mlp.gate_proj, mlp.up_proj])


def joined(tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """The tensors as one `[sum of rows, ...]` view if they lie back to back in one storage, else None."""
    first = tensors[0]
    offset = first.storage_offset()
    for t in tensors:
        adjacent = t.untyped_storage().data_ptr() == first.untyped_storage().data_ptr() and t.storage_offset() == offset
        if not (adjacent and t.is_contiguous() and t.shape[1:] == first.shape[1:]):
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return first.as_strided((rows, *first.shape[1:]), first.stride())


def _rehome(linears: list[nn.Linear]) -> None:
    for attr in ("weight", "bias"):
        parts = [getattr(lin, attr) for lin in linears]
        if parts[0] is None or joined(parts) is not None:
            continue
        group = torch.cat([p.detach() for p in parts])
        row = 0
        for lin, p in zip(linears, parts):
            setattr(lin, attr, nn.Parameter(group[row:row + p.shape[0]], requires_grad=False))
            row += p.shape[0]


# --- the fused elementwise pieces ---------------------------------------------------------
def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order as model.RMSNorm: float32 statistics, cast back, then the weight.
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def _add_rms(x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # x, delta: [B, W, H] -> (x + delta, its norm)
    x = x + delta
    return x, _rms(x, weight, eps)


def _qk_rope(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor | None, k_weight: torch.Tensor | None,
             cos: torch.Tensor, sin: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    # q: [B, W, QH, D]; k: [B, W, KVH, D]; cos, sin: [W, 1, D]
    if q_weight is not None:
        q, k = _rms(q, q_weight, eps), _rms(k, k_weight, eps)
    return rotate(q, cos, sin), rotate(k, cos, sin)


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    # gate_up: [B, W, 2I] (gate then up) -> [B, W, I]
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class _Ops:
    """The elementwise pieces, plain or compiled (one compile each; the window length becomes dynamic on its second size)."""

    def __init__(self, compiled: bool) -> None:
        wrap: Callable = _compile if compiled else (lambda f: f)
        self.rms, self.add_rms, self.qk_rope, self.silu_mul = map(wrap, (_rms, _add_rms, _qk_rope, _silu_mul))


def _compile(fn: Callable) -> Callable:
    options = {}
    import torch._inductor.config as inductor_config

    if hasattr(inductor_config, "emulate_precision_casts"):
        options["emulate_precision_casts"] = True  # round where eager rounds, so bf16 results track the eager path
    return torch.compile(fn, fullgraph=True, options=options)


# --- the static step ------------------------------------------------------------------------
class StaticStep:
    """One window of the model at a device-held start position, over a fixed cache prefix.

    Shapes depend only on (W, bucket), so a call can be captured as a CUDA graph. It writes
    K/V for positions start..start+W-1 into the cache buffer and returns
    (logits [B, W, V] in the model dtype, taps [B, W, n_taps*H] or None). With `triton`,
    layers whose q/k/v are fused run their attention prologue as one Triton kernel.
    """

    def __init__(self, model: TargetModel, kv: torch.Tensor, compiled: bool, triton: bool = False,
                 triton_attention: bool = False) -> None:
        # kv: [num_layers, 2, B, capacity, num_kv_heads, head_dim]
        self.model, self.kv, self.cfg = model, kv, model.config
        self.ops = _Ops(compiled)
        self.prep = self.attention = None
        d = self.cfg.head_dim
        if (triton or triton_attention) and d & (d - 1) == 0:  # Triton blocks are powers of two
            from draftflow.layers import triton_kernels as kernels

            self.prep = kernels.qk_rope_write if triton else None
            self.attention = kernels.decode_attention if triton_attention else None

    def __call__(self, tokens: torch.Tensor, start: torch.Tensor, bucket: int,
                 taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor | None]:
        # tokens: [B, W] int64; start: [1] int64 on the model's device
        m, cfg, ops, eps = self.model, self.cfg, self.ops, self.cfg.rms_norm_eps
        w = tokens.shape[1]
        groups = cfg.num_heads // cfg.num_kv_heads
        pos = start + torch.arange(w, device=tokens.device)  # [W]
        freqs = pos.float()[:, None] * m.inv_freq[None, :]  # [W, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)[:, None, :]  # [W, 1, D]
        x = m.embed_tokens(tokens)  # [B, W, H]
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        # Query row g*W + j (head group g, window token j) may see keys <= pos[j]; later keys,
        # stale cells of rejected drafts included, get -inf.
        if self.attention is None:
            visible = torch.arange(bucket, device=tokens.device)[None, :] <= pos[:, None]  # [W, S]
            mask = torch.zeros(visible.shape, dtype=x.dtype, device=x.device).masked_fill_(~visible, float("-inf"))
            mask = mask.repeat(groups, 1)  # [G*W, S]

        captured: dict[int, torch.Tensor] = {}
        last = cfg.num_layers - 1
        h = ops.rms(x, m.layers[0].input_layernorm.weight, eps)
        for i, layer in enumerate(m.layers):
            attn = layer.self_attn
            q = self._attention_inputs(i, attn, h, start, pos, cos, sin)  # [B, KVH, G*W, D]
            if self.attention is not None:
                out = self.attention(q, self.kv[i, 0], self.kv[i, 1], start, w, bucket)  # [B, W, QH*D]
            else:
                out = attend_prefix(q, self.kv[i, 0, :, :bucket], self.kv[i, 1, :, :bucket], mask, w)
            x, h = ops.add_rms(x, attn.o_proj(out), layer.post_attention_layernorm.weight, eps)
            mlp = layer.mlp
            gate_up = joined([mlp.gate_proj.weight, mlp.up_proj.weight])
            if gate_up is not None:
                hidden = ops.silu_mul(F.linear(h, gate_up))
            else:
                hidden = ops.silu_mul(torch.cat([mlp.gate_proj(h), mlp.up_proj(h)], dim=-1))
            norm = m.layers[i + 1].input_layernorm.weight if i < last else m.norm.weight
            x, h = ops.add_rms(x, mlp.down_proj(hidden), norm, eps)
            if i in taps:
                captured[i] = h if i == last else x  # like the eager path: the last tap is after the final norm
        features = torch.cat([captured[i] for i in taps], dim=-1) if taps else None
        return F.linear(h, m.head_weight()), features

    def _attention_inputs(self, i: int, attn, h: torch.Tensor, start: torch.Tensor, pos: torch.Tensor,
                          cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Project, normalise and rotate; write K/V at `pos`; return q with query groups folded into rows."""
        # h: [B, W, H]; pos: [W]; cos, sin: [W, 1, D] -> [B, KVH, G*W, D]
        d, eps = attn.head_dim, self.cfg.rms_norm_eps
        weight = joined([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight])
        has_bias = attn.q_proj.bias is not None
        bias = joined([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]) if has_bias else None
        norms = (attn.q_norm.weight, attn.k_norm.weight) if attn.qk_norm else (None, None)
        if weight is not None and (bias is not None or not has_bias):
            qkv = F.linear(h, weight, bias)  # [B, W, (QH + 2*KVH) * D]
            if self.prep is not None:
                return self.prep(qkv, cos[:, 0], sin[:, 0], *norms, start, self.kv[i, 0], self.kv[i, 1],
                                 attn.num_heads, eps)
            q, k, v = qkv.split([attn.num_heads * d, attn.num_kv_heads * d, attn.num_kv_heads * d], dim=-1)
        else:
            q, k, v = attn.q_proj(h), attn.k_proj(h), attn.v_proj(h)
        q, k, v = q.unflatten(-1, (-1, d)), k.unflatten(-1, (-1, d)), v.unflatten(-1, (-1, d))
        q, k = self.ops.qk_rope(q, k, *norms, cos, sin, eps)
        self.kv[i, 0].index_copy_(1, pos, k)
        self.kv[i, 1].index_copy_(1, pos, v)
        b, w, qh, _ = q.shape
        kvh = attn.num_kv_heads
        return q.view(b, w, kvh, qh // kvh, d).permute(0, 2, 3, 1, 4).reshape(b, kvh, qh // kvh * w, d)


# --- the runner --------------------------------------------------------------------------------
class GraphRunner:
    """Target windows through static buffers: one CUDA graph per (W, bucket), captured on first use.

    `capture=False` runs the same static step without graphs (CPU, tests). Returned logits
    and taps are views of static buffers, valid until the next call.
    """

    def __init__(self, model: TargetModel, cache: KVCache, max_window: int, tap_layers: Sequence[int] = (), *,
                 capture: bool = True, compiled: bool = True, fused: bool = True, triton: bool | None = None,
                 triton_attention: bool | None = None, min_bucket: int = MIN_BUCKET) -> None:
        if cache.mode != "static":
            raise ValueError("GraphRunner needs a static KV cache (kv_mode: static): graphs cannot follow a growing buffer")
        if fused:
            fuse_projections(model)
        kv = cache.buffer  # [L, 2, B, capacity, KVH, D]
        device, batch = kv.device, kv.shape[2]
        self.model, self.cache, self.max_window = model, cache, max_window
        self.taps = tuple(tap_layers)
        self.capture, self.min_bucket = capture, min_bucket
        triton = kv.is_cuda and fused if triton is None else triton  # the prologue kernel needs fused q/k/v
        triton_attention = kv.is_cuda if triton_attention is None else triton_attention
        self.step = StaticStep(model, kv, compiled, triton, triton_attention)
        self.tokens = torch.zeros(batch, max_window, dtype=torch.long, device=device)  # [B, Wmax]
        self.start = torch.zeros(1, dtype=torch.long, device=device)  # [1]
        self.logits = torch.zeros(batch, max_window, model.config.vocab_size, dtype=torch.float32, device=device)
        width = len(self.taps) * model.config.hidden_size
        self.features = torch.zeros(batch, max_window, width, dtype=kv.dtype, device=device) if self.taps else None
        self.graphs = GraphCache(self._run, capture, device)

    def __call__(self, anchor: int, drafts: torch.Tensor | None, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run the window [anchor, *drafts] at `start`; return (logits [B, W, V] float32, taps [B, W, n*H] or None)."""
        # drafts: [B, K] int64 on the device, or None
        w = 1 + (drafts.shape[1] if drafts is not None else 0)
        if w > self.max_window:
            raise ValueError(f"window of {w} tokens exceeds the runner's max_window {self.max_window}")
        if start > self.cache.length:
            raise ValueError(
                f"forward at start_pos={start} but the KV cache holds only {self.cache.length} committed "
                "positions; commit the previous window first so attention never reads unwritten cells"
            )
        self.cache.ensure(start + w)
        self.tokens[:, :1].fill_(anchor)
        if w > 1:
            self.tokens[:, 1:w].copy_(drafts)
        self.start.fill_(start)
        bucket = bucket_for(start + w, self.cache.capacity, self.min_bucket)
        self.graphs(w, bucket)
        return self.logits[:, :w], (self.features[:, :w] if self.taps else None)

    def _run(self, w: int, bucket: int) -> None:
        logits, features = self.step(self.tokens[:, :w], self.start, bucket, self.taps)
        self.logits[:, :w].copy_(logits)
        if features is not None:
            self.features[:, :w].copy_(features)

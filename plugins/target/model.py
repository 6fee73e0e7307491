"""The target model: a qwen3 / llama / qwen2 decoder (or a qwen3_next hybrid) with one forward for every phase.

The same `forward` serves chunked prefill, one-token decode, multi-token verify windows
and training, eagerly or captured as a CUDA graph (graphs.py only holds its static
buffers): tokens are always written to the cache at absolute positions
`start_pos .. start_pos+T-1` and attend to cache[:start_pos] plus the causal window.
Module and parameter names equal the HF names without the `model.` prefix, so loading
is a rename, not a rewrite. Hybrid stacks put a Gated DeltaNet (`linear_attn`, gdn.py)
in place of attention on some layers; those layers read and write a `LinearState`.
"""

from __future__ import annotations

import torch
from torch import nn

from draftflow.layers import cpu_linear
from draftflow.layers.attention import Window
from draftflow.layers.config import TargetConfig
from draftflow.layers.decoder import DecoderLayer
from draftflow.layers.fused import PLAIN, Kernels
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.linear_state import LinearState
from draftflow.layers.meta import embedding
from draftflow.layers.moe import SparseMoeBlock
from draftflow.layers.norm import RMSNorm
from draftflow.layers.rope import rope_inv_freq, rope_tables
from draftflow.layers.tensor_parallel import SINGLE, TPGroup, local_config, vocab_logits


class TargetModel(nn.Module):
    """Decoder-only target model over an external `KVCache`.

    Build on `device="meta"` and load with `load_state_dict(..., assign=True)` to avoid
    allocating weights twice; the loaders do that. With a tensor-parallel group `tp` of N > 1
    ranks the layers are this rank's shard: `config` is the local config (split counts / N,
    tensor_parallel.py) and `full_config` the checkpoint's; the forward adds the collectives.
    """

    def __init__(
        self, cfg: TargetConfig, dtype: torch.dtype = torch.float32, device: torch.device | str | None = None,
        tp: TPGroup = SINGLE,
    ) -> None:
        super().__init__()
        self.tp, self.full_config = tp, cfg
        self.config = cfg = local_config(cfg, tp.size, tp.rank)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, dtype, device)
        self.layers = nn.ModuleList(DecoderLayer(cfg, dtype, device, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype, device, cfg.norm_offset)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=dtype, device=device)
        # Computed on CPU even for meta models; `.to(device)` after loading moves it.
        # On a real device the RoPE table goes there now; on meta it stays on the CPU until `.to(device)`.
        inv_freq = rope_inv_freq(cfg)
        if device is not None and torch.device(device).type != "meta":
            inv_freq = inv_freq.to(device)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.requires_grad_(False)
        self.host_experts = None  # MoE: routed experts on the host (moe.HostExperts), set by the loaders
        self.expert_cache = None  # MoE: the device slots serving them (expert_cache.ExpertCache)

    def set_expert_cache(self, resident: int | None, grouped: bool | None = None):
        """MoE only: (re)build the expert cache with `resident` device slots (None = every expert).

        `grouped`: one grouped GEMM per layer and window, or one GEMM per routed expert (None: the
        measured default, see `ExpertCache`).
        """
        from draftflow.layers.expert_cache import ExpertCache

        blocks = [layer.mlp for layer in self.layers if isinstance(layer.mlp, SparseMoeBlock)]
        for block in blocks:  # free the old slots before allocating new ones (the blocks hold the old cache too)
            block.experts = None
        if self.expert_cache is not None:
            self.expert_cache.release()
        self.expert_cache = None
        if self.inv_freq.is_cuda:
            torch.cuda.empty_cache()
        self.expert_cache = ExpertCache(self.host_experts, resident, self.config.num_experts_per_tok, self.inv_freq.device,
                                        grouped)
        self.expert_cache.attach(blocks)
        return self.expert_cache

    def head_weight(self) -> torch.Tensor:
        """The LM-head matrix: [V, H] (the embedding itself when tied)."""
        return self.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight

    def forward(
        self,
        tokens: torch.Tensor,  # [B, T] int64
        start_pos: int | list[int] | torch.Tensor,  # host int or [B] ints (eager); [1] or [B] int64 on the device (captured)
        cache: KVCache,
        logit_rows: int | torch.Tensor | None = None,  # None | count of last rows | [R] or [B, R] indices
        tap_layers: tuple[int, ...] | None = None,
        linear: LinearState | None = None,
        *,
        bucket: int | None = None,
        kernels: Kernels = PLAIN,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Run a window; return (logits [B, R, V] float32, taps [B, T, len(taps)*H] or None).

        Row b of the batch is cache row b (a `cache.rows(...)` view picks the slots). Eager
        (`start_pos` an int, or a list of per-row starts): the window attends to the exact
        prefix (the longest row's; shorter rows mask the rest), shapes follow T, and the host
        checks the cache and the linear state. Captured (`start_pos` a device tensor, [1] or
        per row [B]): the window attends to the first `bucket` cells with later keys masked, no
        host int depends on the start and nothing syncs, so the call can be a CUDA graph; the
        caller checks the starts, makes the cells writable and opens the linear-state window
        (`linear.begin`) first (graphs.GraphRunner). `kernels` picks plain, compiled or
        Triton pieces (fused.Kernels); the math is the same.

        Tap L is the hidden state after decoder layer L, i.e. transformers'
        `hidden_states[L+1]`; like transformers, the last layer's tap is taken after the
        final norm. The cache's committed length is not changed: the caller commits.
        Hybrid models also need `linear` (the Gated DeltaNet states); the window must start
        at its committed length, and the caller commits it too (`linear.commit`).
        """
        b, t = tokens.shape
        cfg = self.config
        taps = tuple(tap_layers or ())
        bad = [i for i in taps if not 0 <= i < cfg.num_layers]
        if bad:
            raise ValueError(f"tap_layers {bad} are outside [0, {cfg.num_layers}); pick existing layers")
        if cfg.is_hybrid and linear is None:
            raise ValueError("this hybrid (qwen3_next) model has linear-attention layers; pass linear=LinearState "
                             "(LinearState.allocate(cfg, batch, max_window, dtype, device))")
        if isinstance(start_pos, torch.Tensor):
            if bucket is None:
                raise ValueError("a device-held start_pos needs the attention bucket (attention.bucket_for)")
            window = Window.bucketed(start_pos, t, bucket)
            recorded = True  # windows of at most linear.max_window tokens; the runner checks and opens them
        else:
            starts = [start_pos] * b if isinstance(start_pos, int) else list(start_pos)
            if len(starts) != b:
                raise ValueError(f"forward got {len(starts)} start positions for a window of {b} rows; pass one per row")
            lengths = cache.lengths if hasattr(cache, "lengths") else [cache.length] * b
            for row, (start, length) in enumerate(zip(starts, lengths)):
                if start > length:
                    raise ValueError(
                        f"forward at start_pos={start} but the KV cache holds only {length} committed positions"
                        f"{f' in row {row}' if b > 1 else ''}; commit the previous window first so attention never reads unwritten cells"
                    )
            cache.ensure(max(starts) + t)
            window = Window.at(start_pos, t, tokens.device) if isinstance(start_pos, int) else \
                Window.rows(starts, t, tokens.device)
            recorded = linear.begin(starts, t) if cfg.is_hybrid else False

        x = self.embed_tokens(tokens)  # [B, T, H]
        # [T, 1, R] each, or [B, T, 1, R] for per-row positions
        cos, sin = rope_tables(self.inv_freq, window.positions.reshape(-1), x.dtype)
        if window.per_row:
            cos, sin = cos.view(b, t, 1, -1), sin.view(b, t, 1, -1)
        if self.host_experts is not None and self.expert_cache is None:
            self.set_expert_cache(None)  # nobody sized the cache: keep every expert resident
        ops, eps, offset = kernels, cfg.rms_norm_eps, cfg.norm_offset
        captured: dict[int, torch.Tensor] = {}
        last = cfg.num_layers - 1
        reduce = self.tp.all_reduce if self.tp.size > 1 else None  # row-parallel partial sums -> the full delta
        h = ops.rms(x, self.layers[0].input_layernorm.weight, eps, offset)
        for i, layer in enumerate(self.layers):
            if layer.is_linear:
                delta = layer.linear_attn(h, linear, layer.slot, recorded)
            else:
                delta = layer.self_attn(h, cos, sin, cache, layer.slot, window=window, kernels=kernels)
            if reduce is not None:
                delta = reduce(delta)
            if isinstance(layer.mlp, SparseMoeBlock):  # its routing may come with the norm, in one launch
                x, h, routing = layer.mlp.norm_and_route(x, delta, layer.post_attention_layernorm.weight, eps, offset,
                                                         ops)
                delta = layer.mlp(h, routing)
            else:
                x, h = ops.add_rms(x, delta, layer.post_attention_layernorm.weight, eps, offset)
                delta = layer.mlp(h, kernels)
            if reduce is not None:
                delta = reduce(delta)
            norm = self.layers[i + 1].input_layernorm.weight if i < last else self.norm.weight
            x, h = ops.add_rms(x, delta, norm, eps, offset)  # h: the next layer's input (the final norm at the end)
            if i in taps:
                captured[i] = h if i == last else x
        tapped = torch.cat([captured[i] for i in taps], dim=-1) if taps else None

        if logit_rows is None:
            rows = h
        elif isinstance(logit_rows, int):
            rows = h[:, t - logit_rows :]
        elif logit_rows.dim() == 1:
            rows = h.index_select(1, logit_rows)
        else:  # [B, R]: per-sequence rows
            rows = h.gather(1, logit_rows[:, :, None].expand(-1, -1, h.shape[-1]))
        if self.tp.size > 1:
            return vocab_logits(rows, self.head_weight(), self.tp), tapped  # [B, R, V], gathered
        logits = cpu_linear.linear(rows, self.head_weight()).float()  # [B, R, V]
        return logits, tapped

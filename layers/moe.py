"""Sparse mixture-of-experts FFN: the Qwen3-MoE block (and the Qwen3-Next shared expert).

Router: `gate` = Linear(H, E); softmax in float32; top-k; with `norm_topk_prob` the k
weights are renormalised to sum to 1; then cast back to the activation dtype (the
transformers order). Experts are SiLU-gated MLPs of width `moe_intermediate_size`. An
optional shared expert (Qwen3-Next / Qwen2-MoE) adds `sigmoid(shared_expert_gate(x)) *
shared_expert(x)`; its width is `shared_expert_intermediate_size` (0 = none).

Module and parameter names are the HF ones (`mlp.gate`, `mlp.shared_expert.*`,
`mlp.shared_expert_gate`). The routed experts are *not* parameters of the block: they
live on the host in a `HostExperts` stack and reach the device through an
`ExpertCache` (expert_cache.py), which the block calls per window. Checkpoint names of
the experts are the per-expert `mlp.experts.{j}.{gate,up,down}_proj.weight` that Hub
checkpoints and transformers 5's `save_pretrained` write; the fused transformers-5
in-memory form `mlp.experts.gate_up_proj` [E, 2I, H] / `mlp.experts.down_proj` [E, H, I]
is accepted by the HF loader too (`split_fused_experts`).
"""

from __future__ import annotations

import math

from typing import TYPE_CHECKING, Any

import attrs
import torch
import torch.nn.functional as F
from torch import nn

from draftflow.core.errors import ModelFormatError

if TYPE_CHECKING:
    from draftflow.layers.config import TargetConfig
    from draftflow.layers.expert_cache import LayerExperts

def moe_fields(d: dict[str, Any], source: str, num_layers: int) -> dict[str, Any]:
    """TargetConfig MoE fields from an HF config dict (Qwen3-MoE names; transformers 5 writes `num_local_experts`)."""
    experts = d.get("num_experts", d.get("num_local_experts"))
    for key, value in (("num_experts", experts), ("num_experts_per_tok", d.get("num_experts_per_tok")),
                       ("moe_intermediate_size", d.get("moe_intermediate_size"))):
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelFormatError(f"{source}: field {key!r} is {value!r}; expected a positive integer; fix the config")
    if d["num_experts_per_tok"] > experts:
        raise ModelFormatError(f"{source}: field 'num_experts_per_tok' is {d['num_experts_per_tok']}, more than "
                               f"num_experts={experts}; expected at most num_experts; fix the config")
    step = int(d.get("decoder_sparse_step") or 1)
    dense = set(d.get("mlp_only_layers") or [])
    return {
        "num_experts": experts,
        "num_experts_per_tok": d["num_experts_per_tok"],
        "moe_intermediate_size": d["moe_intermediate_size"],
        "norm_topk_prob": bool(d.get("norm_topk_prob", False)),
        # transformers' rule: sparse unless listed in mlp_only_layers or off the sparse step.
        "moe_layers": tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
        "shared_expert_intermediate_size": int(d.get("shared_expert_intermediate_size") or 0),
    }


def moe_tensors(cfg: TargetConfig, p: str) -> dict[str, tuple[int, ...]]:
    """HF names -> shapes of one MoE block under prefix `p` (`model.layers.N.mlp.`)."""
    h, i, s = cfg.hidden_size, cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size
    out = {p + "gate.weight": (cfg.num_experts, h)}
    for j in range(cfg.num_experts):
        out[f"{p}experts.{j}.gate_proj.weight"] = (i, h)
        out[f"{p}experts.{j}.up_proj.weight"] = (i, h)
        out[f"{p}experts.{j}.down_proj.weight"] = (h, i)
    if s:
        out.update({p + "shared_expert.gate_proj.weight": (s, h), p + "shared_expert.up_proj.weight": (s, h),
                    p + "shared_expert.down_proj.weight": (h, s), p + "shared_expert_gate.weight": (1, h)})
    return out


def is_expert_tensor(name: str) -> bool:
    """Whether an HF name is a routed expert's weight (host-resident, served by the expert cache)."""
    return ".mlp.experts." in name


def bytes_per_expert(cfg: TargetConfig, dtype: torch.dtype) -> int:
    """Device bytes of one routed expert (gate, up and down projections)."""
    return 3 * cfg.hidden_size * cfg.moe_intermediate_size * dtype.itemsize


def total_experts(cfg: TargetConfig) -> int:
    """Routed experts over all MoE layers (the expert cache's universe)."""
    return len(cfg.moe_layers) * cfg.num_experts


def split_fused_experts(found: dict[str, tuple[int, ...]]) -> dict[str, tuple[str, int, slice]]:
    """Per-expert names for fused transformers-5 tensors: name -> (fused name, expert, row slice).

    `mlp.experts.gate_up_proj` [E, 2I, H] holds gate rows then up rows; `mlp.experts.down_proj`
    is [E, H, I]. `found` is updated in place: fused entries are replaced by per-expert shapes.
    """
    views: dict[str, tuple[str, int, slice]] = {}
    for name in [n for n in found if n.endswith(".mlp.experts.gate_up_proj") or n.endswith(".mlp.experts.down_proj")]:
        shape = found.pop(name)
        prefix, kind = name.rsplit(".", 1)
        if len(shape) != 3:
            raise ModelFormatError(f"tensor {name!r} has shape {list(shape)}; expected a 3-D [experts, out, in] tensor; "
                                   "re-save the checkpoint")
        for j in range(shape[0]):
            if kind == "down_proj":
                views[f"{prefix}.{j}.down_proj.weight"] = (name, j, slice(None))
                found[f"{prefix}.{j}.down_proj.weight"] = (shape[1], shape[2])
            else:
                half = shape[1] // 2
                for part, rows in (("gate_proj", slice(0, half)), ("up_proj", slice(half, shape[1]))):
                    views[f"{prefix}.{j}.{part}.weight"] = (name, j, rows)
                    found[f"{prefix}.{j}.{part}.weight"] = (half, shape[2])
    return views


def host_block(shapes: list[tuple[tuple[int, ...], torch.dtype]], pin: bool) -> list[torch.Tensor]:
    """Empty host tensors of these (shape, dtype)s, all views of one allocation (pinned when `pin`).

    torch's pinned allocator rounds each allocation up to a power of two, so one block of the sum
    wastes less than one allocation per tensor (Qwen3-30B-A3B's two stacks, 39 + 19 GB, would pin 103 GB;
    one block of 58 GB pins 69)."""
    sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes]
    starts = [sum(-(-n // 256) * 256 for n in sizes[:k]) for k in range(len(sizes))]  # 256-byte aligned views
    block = torch.empty(starts[-1] + sizes[-1] if sizes else 0, dtype=torch.uint8, pin_memory=pin)
    return [block[a:a + n].view(dtype).view(shape) for (shape, dtype), a, n in zip(shapes, starts, sizes)]


@attrs.define
class HostExperts:
    """Routed expert weights of every MoE layer, stacked on the host (pinned when the device is CUDA)."""

    layers: tuple[int, ...]  # decoder layer index of each stack row
    gate_up: torch.Tensor  # [L_moe, E, 2I, H]: gate rows, then up rows (F.linear layout)
    down: torch.Tensor  # [L_moe, E, H, I]

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(MoE layers, experts per layer, 2I, H)."""
        return tuple(self.gate_up.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.gate_up.dtype

    @property
    def bytes_per_expert(self) -> int:
        """Bytes one upload moves."""
        return (self.gate_up[0, 0].numel() + self.down[0, 0].numel()) * self.gate_up.element_size()

    def readable_on_device(self) -> bool:
        """Whether the expert kernels can read a miss straight from these (pinned) stacks (probed once)."""
        from draftflow.layers.moe_kernels import host_reads_work

        return host_reads_work(self.gate_up)

    def upload(self, row: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Copy one expert into its slot: pinned memory + non_blocking, queued on the stream before its GEMM."""
        gate_up.copy_(self.gate_up[row, expert], non_blocking=True)
        down.copy_(self.down[row, expert], non_blocking=True)

    @classmethod
    def pop_from_state(cls, state: dict[str, torch.Tensor], cfg: TargetConfig, pin: bool) -> HostExperts:
        """Move per-expert entries (`layers.N.mlp.experts.J.*.weight`, module names) out of `state` into stacks."""
        e, i, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
        some = next((t for n, t in state.items() if ".mlp.experts." in n), None)
        dtype = some.dtype if some is not None else torch.float32
        n = len(cfg.moe_layers)
        gate_up, down = host_block([((n, e, 2 * i, h), dtype), ((n, e, h, i), dtype)], pin)
        for row, layer in enumerate(cfg.moe_layers):
            for j in range(e):
                p = f"layers.{layer}.mlp.experts.{j}."
                gate_up[row, j, :i] = state.pop(p + "gate_proj.weight")
                gate_up[row, j, i:] = state.pop(p + "up_proj.weight")
                down[row, j] = state.pop(p + "down_proj.weight")
        return cls(tuple(cfg.moe_layers), gate_up, down)


class ExpertMLP(nn.Module):
    """A SiLU-gated MLP of width `width` (the shared expert; HF `Qwen2MoeMLP` names)."""

    def __init__(self, hidden: int, width: int, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(hidden, width, bias=False, dtype=dtype, device=device)
        self.up_proj = nn.Linear(hidden, width, bias=False, dtype=dtype, device=device)
        self.down_proj = nn.Linear(width, hidden, bias=False, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, H] -> [N, H]
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def route(logits: torch.Tensor, top_k: int, norm_topk_prob: bool, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k routing as transformers does it: softmax in float32, top-k, optional renormalisation."""
    # logits: [N, E] -> (weights [N, k] in dtype, expert ids [N, k] int64)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


class SparseMoeBlock(nn.Module):
    """Router + routed experts (through an expert cache) + optional shared expert, for one decoder layer.

    Sizes come from TargetConfig fields (`num_experts`, `num_experts_per_tok`,
    `moe_intermediate_size`, `norm_topk_prob`, `shared_expert_intermediate_size`), so any
    decoder (qwen3_moe, qwen3_next) can use it. `experts` is attached after loading
    (`ExpertCache.attach`); until then the block cannot run.
    """

    def __init__(self, cfg: TargetConfig, dtype: torch.dtype, device: torch.device | str | None) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.num_experts, bias=False, dtype=dtype, device=device)
        if cfg.shared_expert_intermediate_size:
            self.shared_expert = ExpertMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype, device)
            self.shared_expert_gate = nn.Linear(cfg.hidden_size, 1, bias=False, dtype=dtype, device=device)
        self.has_shared = bool(cfg.shared_expert_intermediate_size)
        self.top_k, self.norm_topk_prob = cfg.num_experts_per_tok, cfg.norm_topk_prob
        self.experts: LayerExperts | None = None

    def norm_and_route(self, x: torch.Tensor, delta: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                       offset: bool, kernels) -> tuple[torch.Tensor, torch.Tensor, tuple | None]:
        """The residual add and post-attention norm before this block: (x + delta, its RMSNorm, routing or None).

        With the Triton elementwise kernels on the device path, the norm and this block's routing are one launch
        (`moe_kernels.add_rms_route`) and the routing is passed to `forward`; otherwise `kernels.add_rms` and None.
        """
        if (kernels.elementwise and self.experts is not None and self.experts.cache.device_path and x.is_cuda
                and x.is_contiguous() and delta.is_contiguous() and delta.dtype == x.dtype):
            from draftflow.layers.moe_router import add_rms_route, router_fits

            if router_fits(x, self.gate):
                return add_rms_route(x, delta, norm_weight, eps, offset, self.gate.weight, self.top_k,
                                     self.norm_topk_prob)
        return (*kernels.add_rms(x, delta, norm_weight, eps, offset), None)

    def forward(self, x: torch.Tensor, routing: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        # x: [B, T, H] -> [B, T, H]; all B*T tokens of the window are routed and served at once. routing: (weights,
        # ids) [N, k] from norm_and_route, already computed on the device.
        if self.experts is None:
            raise RuntimeError("MoE block has no expert cache attached; call TargetModel.set_expert_cache first")
        flat = x.reshape(-1, x.shape[-1])  # [N, H]
        if self.experts.cache.device_path:  # routing and experts on the device (expert_cache.py), no host sync
            from draftflow.layers.moe_router import route_topk, router_fits, router_topk

            if routing is not None:
                weights, ids = routing
            elif router_fits(flat, self.gate):  # router GEMV + routing in one launch
                weights, ids = router_topk(flat, self.gate.weight, self.top_k, self.norm_topk_prob)  # [N, k], [N, k]
            else:
                weights, ids = route_topk(self.gate(flat), self.top_k, self.norm_topk_prob, x.dtype)
            out = self.experts.compute_device(flat, ids, weights)  # [N, H]
        else:
            logits = self.gate(flat)  # [N, E]
            weights, ids = route(logits, self.top_k, self.norm_topk_prob, x.dtype)  # [N, k], [N, k]
            out = self.experts.compute(flat, ids, weights)  # [N, H]
        if self.has_shared:
            out = out + torch.sigmoid(self.shared_expert_gate(flat)) * self.shared_expert(flat)
        return out.view_as(x)


def expert_pool_vram(cfg: TargetConfig, dtype: torch.dtype, pinned: int, window: int = 512):
    """(ExpertPool, routed-expert bytes, extra scratch bytes) for a manifest; pinned 0 = autosize."""
    from draftflow.core.manifest import ExpertPool
    from draftflow.layers.expert_cache import min_resident

    if pinned < 0:
        raise ModelFormatError(f"param expert_cache is {pinned}; expected 0 (autosize) or a positive count of experts")
    per = bytes_per_expert(cfg, dtype)
    pool = ExpertPool(per, total_experts(cfg), min_resident(len(cfg.moe_layers), cfg.num_experts_per_tok), pinned or None)
    # Per window token: k rows of gate/up/activation and k output rows, plus routing; the device path's tally
    # (int32 tokens per expert, hits and misses, per MoE layer).
    rows = window * cfg.num_experts_per_tok * (3 * cfg.moe_intermediate_size + 2 * cfg.hidden_size)
    tally = len(cfg.moe_layers) * (cfg.num_experts + 2) * 4
    return pool, per * pool.total, rows * dtype.itemsize + tally

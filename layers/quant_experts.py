"""Routed experts kept in their GGUF blocks on the host; the expert cache uploads the blocks (issue 20, item 2).

A quantized MoE GGUF (Q4_K_M: `ffn_gate_exps` / `ffn_up_exps` Q4_K, `ffn_down_exps` Q4_K or Q6_K)
dequantized at load needs its experts in float on the host: 154.6 GB at bf16 for the
Qwen3-Next-80B-A3B shape, more than a 128 GiB host holds, against about 45 GB as Q4_K. With
`quantized: true` the loader keeps the merged expert tensors' bytes instead (`QuantHostExperts`,
pinned on CUDA), and the expert cache's device slots stay float: an upload copies one expert's
blocks (a Q4_K expert is 28% of its bf16 bytes) into a device staging buffer and dequantizes them
into the slot with quant_kernels' Triton kernel, so every slot holds exactly what a target
dequantized at load would hold (float32: gguf's values; bf16: the same rounding), and the
expert kernels are unchanged.

The price: the kernels cannot read a quantized miss straight from host memory, so a partly
resident cache takes the host-routed path (`ExpertCache.device_path` is off: one host sync per
MoE layer and window, misses uploaded once per window). With every expert resident nothing is
ever uploaded after the start and the device path runs as for float experts. Per layer a
projection may have its own type (llama-quantize's use_more_bits layers); types outside
quant_linear.LAYOUT keep the float path (the loader decides, `covered`).
"""

from __future__ import annotations

import attrs
import torch

from draftflow.layers.quant_linear import LAYOUT


def covered(types: list[str]) -> bool:
    """Whether merged expert tensors of these GGUF types can stay quantized (the Triton dequantizer reads them)."""
    return bool(types) and all(t in LAYOUT for t in types)


@attrs.define
class QuantHostExperts:
    """Per MoE layer row: the gate, up and down experts' bytes [E, rows, row bytes] uint8 and their GGUF types."""

    layers: tuple[int, ...]  # decoder layer index of each row
    gate: list[torch.Tensor]  # [E, I, H/BS*BB] per row
    up: list[torch.Tensor]  # [E, I, H/BS*BB]
    down: list[torch.Tensor]  # [E, H, I/BS*BB]
    types: list[tuple[str, str, str]]  # (gate, up, down) GGUF type per row
    hidden: int
    width: int  # the experts' intermediate size I
    dtype: torch.dtype  # what the slots hold
    _staging: dict = attrs.field(factory=dict, init=False)  # device -> uint8 buffer of one expert's bytes

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """(MoE layers, experts per layer, 2I, H): the float stacks' shape."""
        return len(self.layers), self.gate[0].shape[0], 2 * self.width, self.hidden

    @property
    def bytes_per_expert(self) -> int:
        """Bytes one upload moves (the largest over rows, whose types may differ)."""
        return max(g[0].nbytes + u[0].nbytes + d[0].nbytes for g, u, d in zip(self.gate, self.up, self.down))

    def readable_on_device(self) -> bool:
        """The expert kernels cannot read a quantized miss from host memory (the device path needs float stacks)."""
        return False

    def upload(self, row: int, expert: int, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        """Dequantize expert `expert` of row `row` into the float slot `gate_up` [2I, H] and `down` [H, I]: its bytes
        go to a staging buffer on the slot's device (non-blocking from pinned memory), then the Triton dequantizer
        writes the slot. Stream order keeps the staging buffer's reuse safe."""
        from draftflow.layers.quant_kernels import dequantize

        i, h = self.width, self.hidden
        staging = self._staging.get(gate_up.device)
        if staging is None:
            staging = self._staging[gate_up.device] = torch.empty(self.bytes_per_expert, dtype=torch.uint8,
                                                                  device=gate_up.device)
        start = 0
        for src, qtype, out, cols in ((self.gate[row][expert], self.types[row][0], gate_up[:i], h),
                                      (self.up[row][expert], self.types[row][1], gate_up[i:], h),
                                      (self.down[row][expert], self.types[row][2], down, i)):
            buf = staging[start:start + src.nbytes].view(src.shape)  # [rows, row bytes]
            buf.copy_(src, non_blocking=True)
            dequantize(buf, qtype, cols, out.dtype, out=out)
            start += src.nbytes


def available_host_memory() -> int | None:
    """MemAvailable from /proc/meminfo in bytes (None where there is no such file)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_memory_problem(cfg, dtype: torch.dtype, path: str, keep: bool, available: int | None) -> tuple[str, str] | None:
    """(message, fix) when a MoE target's routed experts need more host memory than `available`, else None.

    The experts live on the host whatever the device (the expert cache serves them from there): as float of
    `dtype`, or as their GGUF blocks when a kept-quantized load keeps them (`keep`: the target's `quantized`
    applies on this device; the merged expert tensors' types all covered)."""
    from draftflow.core.budget import fmt_bytes
    from draftflow.layers.gguf_quants import file_bytes, header_infos, kept_experts
    from draftflow.layers.moe import bytes_per_expert, total_experts

    if not cfg.moe_layers or available is None:
        return None
    quantized = kept_experts(header_infos(path) or [])
    blocks = sum(map(file_bytes, quantized))
    need = blocks if keep and quantized else total_experts(cfg) * bytes_per_expert(cfg, dtype)
    if need <= available:
        return None
    how = "as their GGUF blocks" if keep and quantized else f"as {str(dtype).removeprefix('torch.')}"
    message = (f"its {total_experts(cfg)} routed experts take {fmt_bytes(need)} of host memory {how}, and this machine "
               f"has {fmt_bytes(available)} available")
    if quantized and not keep and blocks <= available:
        fix = (f"set the target's `quantized: true` on a CUDA device: the experts then stay in their GGUF blocks on the "
               f"host ({fmt_bytes(blocks)})")
    else:
        fix = "use a quantized GGUF (e.g. Q4_K_M) with `quantized: true`, or a machine with more memory"
    return message, fix

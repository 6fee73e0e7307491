"""Random-weight models for the GPU benchmarks, drawn where they run: never on the CPU first, never written to disk.

Weights are N(0, 0.02) and norms 1, drawn by one seeded generator on the device in a fixed
(sorted) parameter order. Modules are built on the meta device and materialised uninitialised
(`to_empty`), so the device writes each weight once (no default init pass to overwrite).

Routed MoE experts live on the host (`HostExperts`, pinned on CUDA) as the loaders leave them;
`host_experts(alias=True)` makes every MoE layer's stack the *same* memory (one layer's experts,
an expanded view): a model whose experts do not fit host RAM (Qwen3-Next-80B: 155 GB of experts
on a 128 GiB host) can then still run with its misses read from, and its uploads copied out of,
real pinned memory. Routing is random either way, so values shared between layers change no
timing; what the expert cache moves and reads is the same per miss.
"""

from __future__ import annotations

import torch

DTYPE = torch.bfloat16


def fill_(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Norm weights 1, every other parameter N(0, 0.02), in sorted-name order from `gen`."""
    with torch.no_grad():
        for name, p in sorted(module.named_parameters()):
            p.fill_(1.0) if "norm" in name else p.normal_(0.0, 0.02, generator=gen)


def target(cfg, device: str, seed: int, dtype: torch.dtype = DTYPE):
    """(TargetModel with random weights on `device`, the device generator that drew them)."""
    from draftflow.layers.rope import rope_inv_freq
    from draftflow.plugins.target.model import TargetModel

    model = TargetModel(cfg, dtype=dtype, device="meta").to_empty(device=device).eval()
    model.inv_freq = rope_inv_freq(cfg).to(device)  # a buffer: to_empty left it uninitialised
    gen = torch.Generator(device=device).manual_seed(seed)
    fill_(model, gen)
    return model, gen


def drafter(dcfg, device: str, seed: int, dtype: torch.dtype = DTYPE):
    """A DFlashModel with random weights on `device`."""
    from draftflow.layers.rope import rope_inv_freq
    from draftflow.plugins.dflash.model import DFlashModel

    model = DFlashModel(dcfg, dtype=dtype, device="meta").to_empty(device=device).eval()
    model.inv_freq = rope_inv_freq(dcfg).to(device)
    fill_(model, torch.Generator(device=device).manual_seed(seed))
    return model


def host_experts(cfg, device: str, gen: torch.Generator, alias: bool = False, dtype: torch.dtype = DTYPE):
    """HostExperts stacks ([L, E, 2I, H], [L, E, H, I]) drawn on `device` layer by layer and copied to the host.

    Both stacks are views of one host block (pinned on CUDA): torch's pinned allocator rounds every
    allocation up to a power of two, so two allocations of 39 + 19 GB (Qwen3-30B-A3B) would pin 103 GB
    where one of 58 GB pins 69. `alias`: one layer's experts stand for every layer (module docstring).
    """
    from draftflow.layers.moe import HostExperts, host_block

    n, e, i, h = len(cfg.moe_layers), cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    rows = 1 if alias else n
    gate_up, down = host_block([((rows, e, 2 * i, h), dtype), ((rows, e, h, i), dtype)], pin=device == "cuda")
    for row in range(rows):
        gate_up[row].copy_(torch.empty((e, 2 * i, h), dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen))
        down[row].copy_(torch.empty((e, h, i), dtype=dtype, device=device).normal_(0.0, 0.02, generator=gen))
    if alias:  # (the expert cache's probe of host reads takes a view of the first row: no copy of the expansion)
        gate_up, down = gate_up.expand(n, e, 2 * i, h), down.expand(n, e, h, i)
    return HostExperts(tuple(cfg.moe_layers), gate_up, down)


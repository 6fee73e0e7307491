"""Tensor parallelism on torch.distributed: the process group of a sharded target and how its weights split.

A target over N ranks (docs/TENSOR_PARALLEL.md) keeps the layout of Megatron-LM / gpt-fast:

- attention: q/k/v column-parallel, each rank holds num_heads/N query heads and num_kv_heads/N KV
  heads (its KV cache too); o_proj row-parallel, then one all-reduce;
- MLP: gate/up column-parallel, down row-parallel, then one all-reduce; a MoE layer shards every
  expert's intermediate the same way (the router is replicated, so every rank routes alike), one
  all-reduce after the whole block; a Gated DeltaNet layer splits by key-head groups (its value
  heads, conv channels and recurrent state follow), out_proj row-parallel, one all-reduce;
- LM head: vocabulary-parallel (rank r multiplies rows [r*V/N, (r+1)*V/N) of the head) and one
  all-gather of the logits. The embedding and the head stay whole on every rank: drafters read
  both (``target_embed`` / ``target_head``) and run replicated.

All of it is a *local config*: the checkpoint's config with the split counts divided by N, so
every layer builds, loads and runs per rank without knowing about ranks; only the model's forward
adds the collectives. With one rank nothing here runs and no collective is issued.
"""

from __future__ import annotations

import atexit
import gc
import os
from datetime import timedelta
from typing import Any

import attrs
import torch
import torch.distributed as dist
import torch.nn.functional as F

from draftflow.core.errors import DraftflowError
from draftflow.layers.config import TargetConfig

LAUNCH_HINT = "run it with `draftflow generate/serve ... --tp {n}` or `torchrun --nproc-per-node {n} -m draftflow ...`"
# The control group carries rank 0's calls to idle followers (a server waits for requests): no timeout.
CONTROL_TIMEOUT = timedelta(days=365)


@attrs.frozen
class TPGroup:
    """This process's place in a tensor-parallel target: ``rank`` of ``size``; ``group`` moves tensors (NCCL on
    CUDA, gloo on the CPU), ``control`` (gloo) moves host objects (rank 0's calls, decisions)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    control: Any = None

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum over ranks of a row-parallel product's partial sums, in place."""
        dist.all_reduce(x, group=self.group)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab: int) -> torch.Tensor:
        """Every rank's vocabulary slice of the logits, joined: [..., ceil(V/N)] -> [..., V]."""
        parts = local.new_empty((self.size * local.shape[0], *local.shape[1:]))  # [N*B, ..., V/N]: one collective
        _gather_single(parts, local.contiguous(), group=self.group)
        return parts.unflatten(0, (self.size, -1)).movedim(0, -2).flatten(-2)[..., :vocab]

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's values of ``x`` on every rank, in place (same shape everywhere)."""
        dist.broadcast(x, src=0, group=self.group)
        return x

    def broadcast_object(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` on every rank (host objects, pickled; over the gloo control group)."""
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.control)
        return box[0]


_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor  # the newer name first

SINGLE = TPGroup()
_GROUPS: dict[int, TPGroup] = {}  # one process group per process, built on first use


def env_rank() -> tuple[int, int, int] | None:
    """(rank, world size, local rank) from torchrun's environment (or `--tp`'s spawner), or None outside one."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return rank, world, int(os.environ.get("LOCAL_RANK", rank))


def rank_device(device: str) -> str:
    """The device this rank runs on: 'cuda' / 'cuda:0' mean this rank's local GPU (cuda:LOCAL_RANK)."""
    if not device.startswith("cuda"):
        return device
    where = env_rank()
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + (where[2] if where else 0)}"


def group(size: int, device: str = "cpu") -> TPGroup:
    """The tensor-parallel group of ``size`` ranks this process belongs to (``SINGLE`` for one rank).

    Joins the process group from the environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) if no
    one has: NCCL for a CUDA device (``device`` is this rank's, see ``rank_device``), gloo for the CPU.
    """
    if size == 1:
        return SINGLE
    if size in _GROUPS:
        return _GROUPS[size]
    if not dist.is_initialized():
        where = env_rank()
        if where is None:
            raise DraftflowError(f"tensor_parallel {size} needs {size} processes, one per rank, but this is a single "
                                 f"process; {LAUNCH_HINT.format(n=size)}")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(torch.device(device))
        dist.init_process_group(backend, rank=where[0], world_size=where[1])
        # Ours to end: a group left to interpreter teardown can abort the process ("terminate called without an
        # active exception", gloo) after a clean run.
        atexit.register(_leave)
    if dist.get_world_size() != size:
        raise DraftflowError(f"tensor_parallel {size} but {dist.get_world_size()} processes were started; start "
                             f"one per rank: {LAUNCH_HINT.format(n=size)}")
    control = dist.new_group(backend="gloo", timeout=CONTROL_TIMEOUT)
    _GROUPS[size] = TPGroup(dist.get_rank(), size, None, control)
    return _GROUPS[size]


def _leave() -> None:
    """End this process's groups before interpreter teardown; our TPGroups hold the gloo control group, so drop
    them too, or its C++ side outlives the interpreter and its threads abort the exit."""
    _GROUPS.clear()
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()


# --- the local config and the weight slices ----------------------------------------------------
SPLIT = ("num_heads", "num_kv_heads", "intermediate_size", "linear_num_key_heads", "linear_num_value_heads",
         "moe_intermediate_size", "shared_expert_intermediate_size")
WHAT = {"num_heads": "attention heads (num_attention_heads)", "num_kv_heads": "KV heads (num_key_value_heads)",
        "intermediate_size": "the MLP width (intermediate_size)",
        "linear_num_key_heads": "Gated DeltaNet key heads (linear_num_key_heads)",
        "linear_num_value_heads": "Gated DeltaNet value heads (linear_num_value_heads)",
        "moe_intermediate_size": "each expert's width (moe_intermediate_size)",
        "shared_expert_intermediate_size": "the shared expert's width (shared_expert_intermediate_size)"}


def divisibility_problems(cfg: TargetConfig, size: int) -> list[tuple[str, str]]:
    """(message, fix) for every count a split over ``size`` ranks needs divisible and is not."""
    counts = [(field, getattr(cfg, field)) for field in SPLIT if getattr(cfg, field)]
    fits = ", ".join(str(n) for n in range(1, 65) if all(count % n == 0 for _, count in counts))
    return [(f"{WHAT[field]} = {count} is not divisible by tensor_parallel {size}",
             f"use a tensor_parallel that divides every split count of this model ({fits})")
            for field, count in counts if count % size]


def local_config(cfg: TargetConfig, size: int, rank: int = 0) -> TargetConfig:
    """What one rank of ``size`` builds: split counts divided by ``size``; the output bias on rank 0 only (the
    all-reduce would add it ``size`` times). Counts that do not divide are rounded up (sizing only: the check
    refuses such a plan before anything loads)."""
    if size == 1:
        return cfg
    split = {f: -(-getattr(cfg, f) // size) for f in SPLIT}
    return attrs.evolve(cfg, o_bias=cfg.o_bias and rank == 0, **split)


def shard_of(name: str, full: tuple[int, ...], local: tuple[int, ...], cfg: TargetConfig,
             rank: int, size: int) -> list[tuple[int, int, int]]:
    """How rank ``rank`` takes checkpoint tensor ``name``: (dim, start, stop) pieces to concatenate along ``dim``;
    [] when it is replicated. The split dimension is the one where the local shape is smaller; heads and
    channels are contiguous per rank, except a Gated DeltaNet conv, whose channels are [q | k | v] over all heads."""
    dims = [i for i, (a, b) in enumerate(zip(full, local)) if a != b]
    if not dims:
        return []
    dim = dims[0]
    if name.endswith("linear_attn.conv1d.weight"):
        key = cfg.linear_num_key_heads * cfg.linear_key_head_dim
        spans = [(0, key), (key, key), (2 * key, cfg.linear_num_value_heads * cfg.linear_value_head_dim)]
    else:
        spans = [(0, full[dim])]
    return [(dim, at + rank * n // size, at + (rank + 1) * n // size) for at, n in spans]


def take(read, pieces: list[tuple[int, int, int]]):
    """Read ``pieces`` of ``read`` (a safetensors slice or a tensor) and join them into a tensor of its own (a
    view would keep the whole tensor alive)."""
    parts = [read[(slice(None),) * dim + (slice(a, b),)] for dim, a, b in pieces]
    if len(parts) > 1:
        return torch.cat(parts, dim=pieces[0][0])
    return parts[0].clone(memory_format=torch.contiguous_format) if isinstance(read, torch.Tensor) else parts[0]


def vocab_logits(rows: torch.Tensor, head: torch.Tensor, tp: TPGroup) -> torch.Tensor:
    """The LM head vocabulary-parallel: this rank's rows of ``head``, then an all-gather.

    rows: [B, R, H]; head: [V, H] (whole, replicated) -> [B, R, V] float32.
    """
    vocab = head.shape[0]
    per = -(-vocab // tp.size)
    part = head[tp.rank * per:min((tp.rank + 1) * per, vocab)]
    local = F.linear(rows, part).float()  # [B, R, <= per]
    if local.shape[-1] < per:  # the last rank's slice of an uneven vocabulary: pad, cut after the gather
        local = F.pad(local, (0, per - local.shape[-1]))
    return tp.gather_vocab(local, vocab)

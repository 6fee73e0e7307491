"""Checks the executor runs on requests and cycles: request validation, finite logits, buffer ownership (debug)."""

from __future__ import annotations

from typing import Any

import torch

from draftflow.core.errors import ModelFormatError, OwnershipError, RequestError
from draftflow.core.node import SamplingParams
from draftflow.core.ports import TargetOutput


def validate_request(prompt_ids: list[int], sampling: SamplingParams, vocab: int | None, context: int | None) -> None:
    """Refuse, before anything runs, a request that cannot work: empty, ids outside the vocabulary, past the context."""
    if not prompt_ids:
        raise RequestError("the prompt is empty; pass --prompt TEXT or --prompt-ids 1,2,3")
    if vocab:
        bad = [t for t in prompt_ids if not 0 <= t < vocab]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {vocab}); fix the prompt ids")
        bad = [t for t, _ in sampling.logit_bias if t >= vocab]
        if bad:
            raise RequestError(f"sampling field 'logit_bias' names token id {bad[0]}, outside the vocabulary "
                               f"[0, {vocab}); use token ids of this model's tokenizer")
    need = len(prompt_ids) + sampling.max_new_tokens
    if context is not None and need > context:
        raise RequestError(f"prompt ({len(prompt_ids)} tokens) + max_new_tokens ({sampling.max_new_tokens}) = {need} "
                           f"exceeds the context of {context} tokens; shorten the prompt or lower --max-new-tokens")


def check_finite(plan, target: str, out: dict[str, Any], rows: list[int]) -> None:
    """Refuse NaN/inf target logits (corrupt weights, float16 overflow) instead of emitting garbage.

    Checked on the first window of each request only (``rows``): one extra host sync per joining
    request, none per cycle.
    """
    for value in out.values():
        if isinstance(value, TargetOutput) and not bool(torch.isfinite(value.logits[rows]).all()):
            node = plan.nodes[target]
            path = node.params.get("path")
            where = f"node '{target}' ({node.node_type.name}" + (f", {path})" if path else ")")
            dtype = plan.spec.dtype
            fix = "check the checkpoint's weights" + (", or run in --dtype bfloat16 or float32" if dtype == "float16" else "")
            raise ModelFormatError(f"{where} produced NaN or infinite logits for the prompt: its weights are corrupt "
                                   f"or overflow in {dtype}; {fix}")


def buffer_versions(owned: dict[str, dict[str, torch.Tensor]], name: str) -> dict[tuple[str, str], int]:
    """Version counters of every buffer not owned by node `name` (debug: taken before it steps)."""
    return {(owner, b): t._version for owner, bufs in owned.items() if owner != name for b, t in bufs.items()}


def check_writes(plan, owned: dict[str, dict[str, torch.Tensor]], name: str, before: dict[tuple[str, str], int]) -> None:
    """Debug: node `name` must not have written a buffer another node owns."""
    for (owner, b), version in before.items():
        if owned[owner][b]._version != version:
            raise OwnershipError(f"node '{name}' ({plan.nodes[name].node_type.name}) wrote buffer {b!r}, "
                                 f"which is owned by '{owner}'; only the owner may write it")

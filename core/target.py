"""The declared target interface: what drafters and core may use of the target, and nothing else.

Two halves, one per phase:

- ``TargetInfo`` is check-time data in the target's manifest (``Manifest.target``): sizes
  read from config.json or the GGUF header, so checks such as ``wrong_target_check`` run
  before a weight is loaded.
- ``TargetHandle`` is the run-time half, built by the target node after loading
  (``Node.target_handle``) and handed to every node whose manifest requires
  ``TARGET_HANDLE`` (as ``NodeContext.target``). It carries the tokenizer, EOS ids, the
  embedding and LM head (as functions and as the weight tensors, which the target also
  declares as read-only buffers ``target_embed`` / ``target_head``), the feature taps and
  the model's config object.

Core reads the target only through the handle; no node is inspected with ``getattr``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

import attrs

from draftflow.core.problems import Problem

if TYPE_CHECKING:
    import torch

# The capability a target provides and a node requires to be handed a TargetHandle.
TARGET_HANDLE = "target.handle"
# Read-only buffers every target declares (views of its weights; only the target writes them).
EMBED_BUFFER, HEAD_BUFFER = "target_embed", "target_head"


@attrs.frozen
class TargetInfo:
    """What the checks know about the target before loading it (from its config alone)."""

    hidden_size: int
    vocab_size: int
    num_layers: int
    max_context: int | None = None  # the model's position limit
    tap_layers: tuple[int, ...] = attrs.field(default=(), converter=tuple)  # layers whose features are carried
    path: str = ""  # the checkpoint, for messages


@attrs.frozen
class TargetHandle:
    """The loaded target, as drafters, selectors and core may use it.

    ``embed(ids [B, T] int64) -> [B, T, H]`` and ``lm_head(hidden [B, T, H]) -> [B, T, V]``
    (float32, no final norm applied: pass final-normed states). ``embed_weight`` and
    ``head_weight`` are the same matrices ([V, H]; one tensor when tied), read-only.
    ``features`` is the ``[B, kv_tokens, len(tap_layers) * H]`` tap buffer (None without
    taps). ``config`` is the model's own config object (e.g. a layers.DecoderConfig), for
    heads that extend the target (MTP); treat it as read-only. A target without an
    embedding (a toy or remote target) leaves those fields None; a drafter that needs them
    says so when it is built.
    """

    info: TargetInfo
    tokenizer: Any = None  # .encode(str) -> list[int], .decode(ids) -> str; None when the checkpoint has none
    eos_ids: tuple[int, ...] = attrs.field(default=(), converter=tuple)
    dtype: Any = None  # torch.dtype of activations
    device: Any = None  # torch.device
    embed: Callable[[torch.Tensor], torch.Tensor] | None = None
    lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None
    embed_weight: torch.Tensor | None = None
    head_weight: torch.Tensor | None = None
    features: torch.Tensor | None = None
    config: Any = None
    hf_tokenizer: Any = None  # the `tokenizers.Tokenizer` itself (grammar engines build their token tables from it)

    @property
    def vocab_size(self) -> int:
        return self.info.vocab_size

    @property
    def hidden_size(self) -> int:
        return self.info.hidden_size

    @property
    def tap_layers(self) -> tuple[int, ...]:
        return self.info.tap_layers


def target_info(plan) -> tuple[str, TargetInfo] | None:
    """The graph's target node and its ``TargetInfo``, also when the target's own manifest failed.

    None when the graph has no single target that can describe itself (its own problem then says why).
    """
    from draftflow.core.errors import DraftflowError

    found = [(n, r.manifest.target) for n, r in plan.nodes.items() if r.manifest.target is not None]
    for name, u in plan.unresolved.items():
        describe = u.node_type.target_info
        if describe is not None and u.params is not None:
            try:
                found.append((name, describe(u.params)))
            except (DraftflowError, OSError, KeyError, TypeError, ValueError):
                continue
    return found[0] if len(found) == 1 else None


def wrong_target_check(kind: str, trained_for: Callable[[dict], dict]):
    """A check that every node of plugin ``kind`` was trained for the graph's target.

    ``trained_for(params)`` returns what the drafter's files record about its target:
    ``{"hidden": int, "vocab": int | None, "layers": int | None}`` (None: not recorded).
    One problem per drafter names both sides, so a wrong pairing is not left to be guessed
    from its knock-on problems (missing features, out-of-range tap layers).
    """
    from draftflow.core.errors import DraftflowError

    def check(plan):
        found = target_info(plan)
        if found is None:
            return
        target_name, info = found
        have = {"hidden": info.hidden_size, "vocab": info.vocab_size, "layers": info.num_layers}
        for name, r in plan.nodes.items():
            if r.node_type.name != kind:
                continue
            try:
                trained = {k: v for k, v in trained_for(r.params).items() if v is not None}
            except (DraftflowError, OSError):
                continue  # its manifest read the same files; a file changed since is the run's problem
            if all(have[k] == v for k, v in trained.items()):
                continue
            spec = plan.spec.node(name)
            yield Problem(name, "wrong-target",
                          f"drafter '{name}' was trained for a target with {_describe(trained)}; target '{target_name}' "
                          f"({info.path}) has {_describe({k: have[k] for k in trained})}",
                          f"use a drafter trained for this target (draftflow train {kind} --target {info.path} --out DIR)",
                          kind, spec.where if spec else "")

    return check


def _describe(facts: dict) -> str:
    words = {"hidden": "hidden {}", "vocab": "vocab {}", "layers": "{} layers"}
    return ", ".join(words[k].format(v) for k, v in facts.items())

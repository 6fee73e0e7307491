"""The `mixer` node: one proposal chosen per row of each cycle from several drafters.

A verifier (and the target's verify window) take exactly one proposal. With two drafters
both inputs would have two producers; the mixer becomes their single producer. It is a
drafter in the role sense: it sits before the target and its time counts as draft time.

Policies (chosen per row from the proposals' lengths only, so no host sync):
- ``first-nonempty``: the first input, in ``inputs`` order, with at least ``min_tokens``
  drafts in that row; if none has, the last input. E.g. prompt lookup when it matched, MTP otherwise.
- ``longest``: the input with the most drafts in that row, the earlier one on ties.

When every input's row lengths are known on the host (no ``Proposal.lengths``: every row
has the full width, the usual batch-1 case) the choice is one for the whole batch and that
proposal passes unchanged. Otherwise the rows are chosen on the device: the output is
``[n, K']`` (K' = the widest input, narrower ones padded with token 0) with per-row lengths,
and the draft probabilities are brought to one form (none; candidates; else full-vocabulary
q, where a deterministic row is one-hot).
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from draftflow.plugin import Manifest, Node, NodeType, ParamSpec, Port, Proposal, SpecError, hookimpl

POLICIES = ("first-nonempty", "longest")
_PORT = re.compile(r"^[a-z_][a-z0-9_]*$")
PARAMS = (
    ParamSpec("inputs", "str_list", ["a", "b"], "names of the proposal input ports, in order of preference"),
    ParamSpec("policy", "str", "first-nonempty", "how to choose among the proposals each cycle", choices=POLICIES),
    ParamSpec("min_tokens", "int", 1, "first-nonempty: drafts an input needs to be chosen", minimum=1),
)


def manifest(params, env) -> Manifest:
    names = params["inputs"]
    if len(names) < 2 or len(set(names)) != len(names) or not all(_PORT.match(n) for n in names):
        raise SpecError(f"inputs {list(names)!r}: need two or more distinct lowercase port names, e.g. [a, b]")
    k, need = env.num_draft, params["min_tokens"]
    if params["policy"] == "first-nonempty" and 0 < k < need:  # no proposal is wider than the graph's K
        raise SpecError(f"min_tokens {need} is more than the graph's num_draft {k}: no input can offer that many drafts, "
                        f"so every cycle takes the last input '{names[-1]}'; set min_tokens to {k} or less, or "
                        f"num_draft to {need} or more")
    return Manifest(role="drafter",
                    inputs=tuple(Port(n, "proposal", doc=f"proposal #{i + 1} in order of preference") for i, n in enumerate(names)),
                    outputs=(Port("proposal", "proposal", doc="the chosen input's proposal, unchanged"),))


def choose(proposals: list, policy: str, min_tokens: int) -> int:
    """Index of the chosen proposal, from full-width proposals (None entries count as empty)."""
    sizes = [p.num_draft if p is not None else 0 for p in proposals]
    if policy == "longest":
        return max(range(len(sizes)), key=lambda i: (sizes[i], -i))
    return next((i for i, n in enumerate(sizes) if n >= min_tokens), len(sizes) - 1)


def choose_rows(
    sizes: torch.Tensor,  # [A, n] int64: drafts each input proposes in each row
    policy: str,
    min_tokens: int,
) -> torch.Tensor:  # [n] int64: the chosen input per row (argmax takes the first of ties)
    """``choose`` per row, on the device."""
    if policy == "longest":
        return sizes.argmax(dim=0)
    enough = sizes >= min_tokens  # [A, n]
    last = torch.full_like(sizes[0], sizes.shape[0] - 1)
    return torch.where(enough.any(dim=0), enough.long().argmax(dim=0), last)


def _padded(p: Proposal | None, n: int, width: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens [n, width] padded with 0, lengths [n]) of one input; an absent one proposes nothing."""
    if p is None:
        return torch.zeros(n, width, dtype=torch.long, device=device), torch.zeros(n, dtype=torch.long, device=device)
    k = p.tokens.shape[1]
    lengths = p.lengths if p.lengths is not None else torch.full((n,), k, dtype=torch.long, device=device)
    return F.pad(p.tokens, (0, width - k)), lengths


def _q(p: Proposal | None, tokens: torch.Tensor, form: str, width: int, vocab: int | None):
    """One input's q as (probs, ids): [n, width, V] full, or [n, width, C] over candidate ids."""
    n, k = tokens.shape
    if p is None or p.probs is None:  # deterministic drafts: q is one-hot at the draft
        if form == "full":
            return torch.zeros(n, width, vocab, device=tokens.device).scatter_(-1, tokens[..., None], 1.0), None
        return torch.ones(n, width, 1, device=tokens.device), tokens[..., None]
    probs = F.pad(p.probs, (0, 0, 0, width - p.probs.shape[1]))
    if p.candidate_ids is None:
        return probs, None
    ids = F.pad(p.candidate_ids, (0, 0, 0, width - p.candidate_ids.shape[1]))
    if form == "full":
        return torch.zeros(n, width, vocab, dtype=probs.dtype, device=probs.device).scatter_add_(-1, ids, probs), None
    return probs, ids


class Mixer(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.names = ctx.params["inputs"]
        self.policy, self.min_tokens = ctx.params["policy"], ctx.params["min_tokens"]
        self._host_counts = [0] * len(self.names)
        self._device_counts: torch.Tensor | None = None  # [A], rows chosen on the device

    @property
    def chosen(self) -> list[int]:
        """Stepped rows each input was chosen for (for tests and debugging: reading it syncs)."""
        extra = self._device_counts.tolist() if self._device_counts is not None else [0] * len(self.names)
        return [a + b for a, b in zip(self._host_counts, extra)]

    def step(self, batch, inputs):
        proposals = [inputs.get(n) for n in self.names]
        if all(p is None or p.lengths is None for p in proposals):
            i = choose(proposals, self.policy, self.min_tokens)
            self._host_counts[i] += len(batch.active())
            return {"proposal": proposals[i]}
        return {"proposal": self._mix_rows(batch, proposals)}

    def _mix_rows(self, batch, proposals: list) -> Proposal:
        """Each row from the input the policy picks for it, as one [n, K'] proposal with lengths."""
        n, device = batch.size, self.ctx.device
        width = max(p.tokens.shape[1] for p in proposals if p is not None)
        padded = [_padded(p, n, width, device) for p in proposals]
        tokens = torch.stack([t for t, _ in padded])  # [A, n, K']
        sizes = torch.stack([ln for _, ln in padded])  # [A, n]
        pick = choose_rows(sizes, self.policy, self.min_tokens)  # [n]
        rows = torch.arange(n, device=device)
        out = Proposal(tokens[pick, rows], lengths=sizes[pick, rows])
        active = torch.tensor([r is not None for r in batch.rows]).to(device, non_blocking=True)  # pad rows do not count
        if self._device_counts is None:
            self._device_counts = torch.zeros(len(proposals), dtype=torch.long, device=device)
        self._device_counts.index_add_(0, pick, active.long())
        with_q = [p for p in proposals if p is not None and p.probs is not None]
        if with_q:
            form = "candidates" if all(p.candidate_ids is not None for p in with_q) else "full"
            vocab = next((p.probs.shape[-1] for p in with_q if p.candidate_ids is None), None)
            qs = [_q(p, t, form, width, vocab) for p, (t, _) in zip(proposals, padded)]
            if form == "full":
                out.probs = torch.stack([q for q, _ in qs])[pick, rows]  # [n, K', V]
            else:
                c = max(q.shape[-1] for q, _ in qs)
                out.probs = torch.stack([F.pad(q, (0, c - q.shape[-1])) for q, _ in qs])[pick, rows]  # [n, K', C]
                out.candidate_ids = torch.stack([F.pad(ids, (0, c - ids.shape[-1])) for _, ids in qs])[pick, rows]
        return out


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="mixer", role="drafter", manifest=manifest, factory=Mixer, params=PARAMS,
        description="chooses one proposal per cycle among several drafters (single producer for the verifier)"))

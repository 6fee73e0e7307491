"""The `mixer` node: one proposal chosen per cycle from several drafters.

A verifier (and the target's verify window) take exactly one proposal. With two drafters
both inputs would have two producers; the mixer becomes their single producer. It is a
drafter in the role sense: it sits before the target and its time counts as draft time.

Policies (chosen per cycle from the proposals' lengths only, so no host sync):
- ``first-nonempty``: the first input, in ``inputs`` order, with at least ``min_tokens``
  drafts; if none has, the last input. E.g. prompt lookup when it matched, MTP otherwise.
- ``longest``: the input with the most drafts, the earlier one on ties.
"""

from __future__ import annotations

import re

from draftflow.plugin import Manifest, Node, NodeType, ParamSpec, Port, SpecError, hookimpl

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
    return Manifest(role="drafter",
                    inputs=tuple(Port(n, "proposal", doc=f"proposal #{i + 1} in order of preference") for i, n in enumerate(names)),
                    outputs=(Port("proposal", "proposal", doc="the chosen input's proposal, unchanged"),))


def choose(proposals: list, policy: str, min_tokens: int) -> int:
    """Index of the chosen proposal (None entries count as empty)."""
    sizes = [p.num_draft if p is not None else 0 for p in proposals]
    if policy == "longest":
        return max(range(len(sizes)), key=lambda i: (sizes[i], -i))
    return next((i for i, n in enumerate(sizes) if n >= min_tokens), len(sizes) - 1)


class Mixer(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.names = ctx.params["inputs"]
        self.policy, self.min_tokens = ctx.params["policy"], ctx.params["min_tokens"]
        self.chosen = [0] * len(self.names)  # cycles each input was chosen, for tests and debugging

    def step(self, req, inputs):
        proposals = [inputs.get(n) for n in self.names]
        i = choose(proposals, self.policy, self.min_tokens)
        self.chosen[i] += 1
        return {"proposal": proposals[i]}


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="mixer", role="drafter", manifest=manifest, factory=Mixer, params=PARAMS,
        description="chooses one proposal per cycle among several drafters (single producer for the verifier)"))

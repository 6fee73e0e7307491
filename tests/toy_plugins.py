"""Small CPU plugins for exercising the engine without a real model.

The toy target is a deterministic "language model": the most likely next token is
``(3 * prev + 1) % vocab``. It keeps the tokens it has seen in an owned KV-like buffer,
so a wrong commit or rollback shows up as a mismatch. The toy drafter proposes that same
rule with wrong tokens injected at chosen draft positions.
"""

from __future__ import annotations

import torch

from draftflow.plugin import (
    BufferSpec,
    Features,
    Incompatibility,
    Manifest,
    Node,
    NodeType,
    ParamSpec,
    Port,
    Proposal,
    TargetHandle,
    TargetInfo,
    TargetOutput,
    Vram,
    hookimpl,
)


def next_token(prev: int, vocab: int) -> int:
    return (3 * prev + 1) % vocab


def reference(prompt: list[int], n: int, vocab: int) -> list[int]:
    out, prev = [], prompt[-1]
    for _ in range(n):
        prev = next_token(prev, vocab)
        out.append(prev)
    return out


def target_manifest(params, env):
    provides = {"target.features"} | ({"kv.grow"} if params["kv_mode"] == "grow" else set())
    provides |= {"target.handle"} if params["handle"] else set()
    return Manifest(
        role="target",
        inputs=(Port("proposal", "proposal", required=False),),
        outputs=(Port("logits", "logits"), Port("features", "features")),
        owns=(BufferSpec("toy_kv", ("kv_tokens",), "int64", doc="tokens at their positions"),),
        vram=Vram(weights=params["weights_bytes"]),
        provides=provides,
        max_tokens=params["context"],
    )


class ToyTarget(Node):
    vocab_size = 32
    eos_ids = ()

    def __init__(self, ctx):
        super().__init__(ctx)
        self.vocab_size = ctx.params["vocab"]
        self.eos_ids = tuple(ctx.params["eos"])
        self.kv = ctx.buffers["toy_kv"]  # [kv_tokens]
        self.length = 0
        self.extra = torch.zeros(ctx.params["hidden_bytes"] // 4, dtype=torch.float32)

    def tensors(self):
        return (self.extra,)

    def target_handle(self):
        return TargetHandle(TargetInfo(hidden_size=1, vocab_size=self.vocab_size, num_layers=1), eos_ids=self.eos_ids,
                            dtype=self.ctx.dtype, device=self.ctx.device)

    def prefill(self, req):
        n = len(req.tokens) - 1
        self.kv[:n] = torch.tensor(req.tokens[:n])
        self.length = n
        return {"features": Features(torch.zeros(1, n, 4), 0)}

    def step(self, req, inputs):
        proposal = inputs.get("proposal")
        drafts = proposal.tokens[0].tolist() if proposal is not None else []
        window = [req.anchor] + drafts
        pos = req.position
        assert self.length == pos, f"toy target KV length {self.length} != anchor position {pos}"
        self.kv[pos:pos + len(window)] = torch.tensor(window)
        logits = torch.full((1, len(window), self.vocab_size), -5.0)
        for i, tok in enumerate(window):
            logits[0, i, next_token(tok, self.vocab_size)] = 5.0
        return {"logits": TargetOutput(logits), "features": Features(torch.ones(1, len(window), 4), pos)}

    def commit(self, req, info):
        self.length = len(req.tokens) - 1
        stored = self.kv[:self.length].tolist()
        assert stored == req.tokens[:self.length], "toy target KV disagrees with the committed tokens"
        return {"features": Features(torch.ones(1, info.accepted + 1, 4), info.position)}


def drafter_manifest(params, env):
    inc = (Incompatibility("kv.grow", "the toy drafter reads the KV buffer at fixed addresses"),) if params["forbid_grow"] else ()
    return Manifest(
        role="drafter",
        inputs=(Port("features", "features", carried=params["carried_features"], required=False),),
        outputs=(Port("proposal", "proposal"),),
        reads=tuple(params["reads"]),
        writes=tuple(params["writes"]),
        requires=frozenset(params["requires"]),
        incompatible=inc,
    )


class ToyDrafter(Node):
    def __init__(self, ctx):
        super().__init__(ctx)
        self.wrong_at = set(ctx.params["wrong_at"])
        self.vocab = ctx.params["vocab"]
        self.features_seen = []

    def step(self, req, inputs):
        feats = inputs.get("features")
        self.features_seen.append(None if feats is None else (feats.start, feats.hidden.shape[1]))
        out, prev = [], req.anchor
        for i in range(req.num_draft):
            prev = next_token(prev, self.vocab)
            out.append((prev + 1) % self.vocab if i in self.wrong_at else prev)
        if self.ctx.params["scribble"]:
            self.ctx.shared["toy_kv"].add_(0)  # an in-place write to a buffer it does not own
        return {"proposal": Proposal(torch.tensor([out], dtype=torch.long).reshape(1, len(out)))}


@hookimpl
def draftflow_register_nodes(registry):
    registry.add_node_type(NodeType(
        name="toy-target", role="target", manifest=target_manifest, factory=ToyTarget,
        params=(ParamSpec("vocab", "int", 32), ParamSpec("eos", "int_list", []), ParamSpec("context", "int", 512),
                ParamSpec("kv_mode", "str", "static", choices=("static", "grow")),
                ParamSpec("weights_bytes", "int", 0), ParamSpec("hidden_bytes", "int", 0),
                ParamSpec("handle", "bool", True, "provide target.handle (false: a target without the interface)")),
        capabilities=("target.features", "target.handle", "kv.grow"), description="deterministic toy target for engine tests"))
    registry.add_node_type(NodeType(
        name="toy-drafter", role="drafter", manifest=drafter_manifest, factory=ToyDrafter,
        params=(ParamSpec("vocab", "int", 32), ParamSpec("wrong_at", "int_list", []), ParamSpec("forbid_grow", "bool", False),
                ParamSpec("reads", "str_list", []), ParamSpec("writes", "str_list", []), ParamSpec("requires", "str_list", []),
                ParamSpec("scribble", "bool", False), ParamSpec("carried_features", "bool", True)),
        description="toy drafter with injected errors"))

"""Small CPU plugins for exercising the engine without a real model.

The toy target is a deterministic "language model": the most likely next token is
``(3 * prev + 1) % vocab``. It keeps the tokens it has seen in an owned KV-like buffer,
so a wrong commit or rollback shows up as a mismatch. The toy drafter proposes that same
rule with wrong tokens injected at chosen draft positions.
"""

from __future__ import annotations

import torch

from draftflow.plugin import (
    BATCH,
    KV_TOKENS,
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
        owns=(BufferSpec("toy_kv", (BATCH, KV_TOKENS), "int64", doc="tokens at their positions, one row per slot"),),
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
        self.kv = ctx.buffers["toy_kv"]  # [max_batch, kv_tokens]
        self.lengths = [0] * ctx.max_batch  # committed length per slot
        self.extra = torch.zeros(ctx.params["hidden_bytes"] // 4, dtype=torch.float32)

    def tensors(self):
        return (self.extra,)

    def target_handle(self):
        return TargetHandle(TargetInfo(hidden_size=1, vocab_size=self.vocab_size, num_layers=1), eos_ids=self.eos_ids,
                            dtype=self.ctx.dtype, device=self.ctx.device)

    def prefill(self, req):
        n = len(req.tokens) - 1
        self.kv[req.slot, :n] = torch.tensor(req.tokens[:n])
        self.lengths[req.slot] = n
        return {"features": Features(torch.zeros(1, n, 4), 0)}

    def step(self, batch, inputs):
        proposal = inputs.get("proposal")
        drafts = proposal.tokens if proposal is not None else torch.empty(batch.size, 0, dtype=torch.long)  # [n, K]
        anchors = torch.tensor([r.anchor if r is not None else 0 for r in batch.rows])  # [n]
        window = torch.cat([anchors[:, None], drafts], dim=1)  # [n, 1+K]
        for i, req in batch.active():  # pad rows write nothing: their slot's state stays as committed
            pos = req.position
            assert self.lengths[i] == pos, f"toy target KV length {self.lengths[i]} != anchor position {pos} in slot {i}"
            real = 1 + min(req.num_draft, drafts.shape[1])  # the padding columns past it are never committed
            self.kv[i, pos:pos + real] = window[i, :real]
        logits = torch.full((*window.shape, self.vocab_size), -5.0)  # [n, 1+K, V]
        logits.scatter_(-1, ((3 * window + 1) % self.vocab_size)[..., None], 5.0)  # next_token of every window token
        return {"logits": TargetOutput(logits)}

    def commit(self, req, info):
        self.lengths[req.slot] = len(req.tokens) - 1
        stored = self.kv[req.slot, :self.lengths[req.slot]].tolist()
        assert stored == req.tokens[:-1], f"toy target KV of slot {req.slot} disagrees with the committed tokens"
        return {"features": Features(torch.ones(1, info.accepted + 1, 4), info.position)}

    def release(self, req):
        self.lengths[req.slot] = 0


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
        self.features_seen = []  # (start, T) of each stepped row's carried features, in step order

    def draft(self, req) -> list[int]:
        out, prev = [], req.anchor
        for i in range(req.num_draft):
            prev = next_token(prev, self.vocab)
            out.append((prev + 1) % self.vocab if i in self.wrong_at else prev)
        return out

    def step(self, batch, inputs):
        feats = inputs.get("features") or [None] * batch.size  # carried: one value per row
        for i, _ in batch.active():
            f = feats[i]
            self.features_seen.append(None if f is None else (f.start, f.hidden.shape[1]))
        if self.ctx.params["scribble"]:
            self.ctx.shared["toy_kv"].add_(0)  # an in-place write to a buffer it does not own
        return {"proposal": Proposal.from_rows([self.draft(r) if r is not None else None for r in batch.rows], "cpu")}


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

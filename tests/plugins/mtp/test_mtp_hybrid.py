"""Qwen3-Next MTP heads whose block is gated attention + a sparse MoE (or dense) MLP, on a hybrid target."""

from __future__ import annotations

import pytest
import torch
from hybrid_testlib import VOCAB, add_mtp, build_hybrid, build_mtp_layer, mtp_tensors, save
from numerics import assert_close_to_scale, tiny_model_bound
from safetensors.torch import save_file
from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRotaryEmbedding

from draftflow.core.errors import ModelFormatError
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec
from draftflow.plugins.mtp.model import load_head
from draftflow.plugins.mtp.weights import find_mtp
from draftflow.layers.kv_cache import KVCache
from draftflow.layers.moe import SparseMoeBlock
from draftflow.testing import greedy_gate

MOE = {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
       "norm_topk_prob": True}


def _cyclic(ref, layer_scale: float = 2.0, seed: int = 9):
    """Aim the target at a fixed permutation of the vocabulary (unit-RMS embeddings, LM head rows = permuted
    embeddings, small layer outputs), so the next token mostly depends on the current one and an MTP head
    that reads only the embedding can predict it; the layers still break the pattern now and then."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "experts.down_proj")):
                p.mul_(layer_scale)
        emb = ref.model.embed_tokens.weight
        emb.copy_(torch.randn(emb.shape, generator=gen))
        emb.div_(emb.pow(2).mean(-1, keepdim=True).sqrt())
        order = torch.randperm(VOCAB, generator=gen)
        nxt = torch.empty(VOCAB, dtype=torch.long)
        nxt[order] = order.roll(-1)
        ref.lm_head.weight.copy_(emb[torch.argsort(nxt)] / 4)  # row j = Emb(t) where nxt[t] = j
    return ref


@pytest.fixture(scope="module")
def hybrid_mtp_dir(tmp_path_factory):
    """A hybrid MoE target checkpoint carrying a Qwen3-Next MTP head whose embedding half of fc is the identity."""
    ref = _cyclic(build_hybrid(seed=2, **MOE))
    path = save(ref, tmp_path_factory.mktemp("hybrid-mtp") / "m")
    h = ref.config.hidden_size
    fc = torch.zeros(h, 2 * h)
    fc[:, :h] = torch.eye(h)  # x = norm_e(Emb(t)) plus a little of the target's hidden
    fc[:, h:] = 0.02 * torch.randn(h, h, generator=torch.Generator().manual_seed(4)) / h ** 0.5
    zeros = torch.zeros(h)  # (1+w) norms: identity at w = 0
    layer = build_mtp_layer(ref.config, seed=5, out_scale=0.1)
    return add_mtp(path, mtp_tensors(layer, fc, zeros, zeros, ref.model.norm.weight))


def _standalone(tmp_path, ref, layer, seed: int = 11):
    """A standalone MTP directory (config.json + mtp.* tensors only) with random fc and norm weights."""
    gen = torch.Generator().manual_seed(seed)
    h = ref.config.hidden_size
    fc = torch.randn(h, 2 * h, generator=gen) / (2 * h) ** 0.5
    norm_e, norm_h, norm = (0.3 * torch.randn(h, generator=gen) for _ in range(3))
    tensors = mtp_tensors(layer, fc, norm_e, norm_h, norm)
    ref.config.save_pretrained(tmp_path)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    return tmp_path, tensors


def _reference(ref, layer, tensors, tokens, hidden):
    """fc(cat[norm_e(Emb(t)), norm_h(h)]) -> transformers' decoder layer -> x̂·(1+w) norm -> LM head, no cache."""
    # tokens: [T]; hidden: [T, H] -> (logits [T, V], next hidden [T, H])
    def rms1p(x, w):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + ref.config.rms_norm_eps) * (1.0 + w)

    t = tokens.shape[0]
    e = ref.model.embed_tokens.weight[tokens]
    x = torch.cat([rms1p(e, tensors["mtp.pre_fc_norm_embedding.weight"]),
                   rms1p(hidden, tensors["mtp.pre_fc_norm_hidden.weight"])], dim=-1) @ tensors["mtp.fc.weight"].T
    pos = torch.arange(t)[None]
    cos_sin = Qwen3NextRotaryEmbedding(ref.config)(x[None], pos)
    mask = torch.full((t, t), float("-inf")).triu(1)[None, None]  # [1, 1, T, T] additive causal
    y = layer(x[None], position_embeddings=cos_sin, attention_mask=mask, position_ids=pos)[0]
    normed = rms1p(y, tensors["mtp.norm.weight"])
    return normed @ ref.lm_head.weight.T, normed


@pytest.mark.parametrize("moe", [True, False], ids=["moe", "dense"])
def test_head_matches_independent_reference(tmp_path, moe):
    """Chunked pairs then 2 chained steps of a gated-attention (+MoE) MTP head give the reference's logits (1e-4)."""
    ref = build_hybrid(seed=3, **(MOE if moe else {}))
    layer = build_mtp_layer(ref.config, seed=6)
    mtp_dir, tensors = _standalone(tmp_path, ref, layer)
    ckpt = find_mtp(str(mtp_dir))
    assert ckpt.layout == "qwen3-next" and ckpt.block_config.attn_output_gate
    head = load_head(ckpt, torch.device("cpu"), torch.float32)
    assert isinstance(head.block.mlp, SparseMoeBlock) == moe
    embed, lm_head = ref.model.embed_tokens.weight.detach(), ref.lm_head.weight.detach()
    head.bind(embed, lm_head)
    cache = KVCache.from_static(torch.zeros(1, 2, 1, 64, ref.config.num_key_value_heads, ref.config.head_dim))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (10,), generator=gen)  # t_{i+1}
    hidden = torch.randn(10, ref.config.hidden_size, generator=gen)  # h_i
    with torch.no_grad():
        for s, e in ((0, 4), (4, 5), (5, 10)):
            logits, out = head(tokens[None, s:e], hidden[None, s:e], s, cache)
            cache.commit(e)
        got = [logits[0, -1]]
        for j in range(2):
            draft = logits[:, -1].argmax(-1, keepdim=True)  # [1, 1]
            tokens, hidden = torch.cat([tokens, draft[0]]), torch.cat([hidden, out[0, -1:]])
            logits, out = head(draft, out, 10 + j, cache)
            got.append(logits[0, -1])
        want, _ = _reference(ref, layer, tensors, tokens, hidden)
    assert_close_to_scale(torch.stack(got), want[-3:], tiny_model_bound(2), "draft logits")  # fc + block, head


def test_greedy_gate_hybrid_target_with_moe_mtp(hybrid_mtp_dir):
    """target(hybrid MoE) + mtp(gated attention + MoE block) + verifier is lossless, with drafts both accepted and rejected."""
    spec = GraphSpec.from_dict({"num_draft": 4, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(hybrid_mtp_dir), "tap_layers": [3]}},
        "mtp": {"plugin": "mtp", "params": {"path": str(hybrid_mtp_dir)}},
        "verify": {"plugin": "verifier"}}})
    report = greedy_gate(spec, [[5, 6, 7, 8, 9, 5, 6, 7], [11, 200, 31]], max_new_tokens=32, registry=load_registry())
    print(f"mtp hybrid acceptance: {report.accepted}/{report.drafted}")
    assert 0 < report.accepted < report.drafted, (report.accepted, report.drafted)  # acceptance and rejection both run


def test_missing_expert_tensor_is_named(tmp_path):
    """An MoE MTP head without one expert's weight fails with one error naming that tensor and its shape."""
    ref = build_hybrid(seed=3, **MOE)
    mtp_dir, tensors = _standalone(tmp_path, ref, build_mtp_layer(ref.config, seed=6))
    del tensors["mtp.layers.0.mlp.experts.1.up_proj.weight"]
    save_file(tensors, str(mtp_dir / "model.safetensors"))
    with pytest.raises(ModelFormatError, match=r"tensor 'mtp.layers.0.mlp.experts.1.up_proj.weight' is missing "
                                               r"\(expected shape \[32, 64\]\)"):
        find_mtp(str(mtp_dir))


"""MTP head parity with an independent reference from the published equations (random weights)."""

from __future__ import annotations

import pytest
import torch
from draft_models import VOCAB
from mtp_reference import draft_chain
from numerics import assert_close_to_scale, tiny_model_bound

from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.executor import Executor
from draftflow.core.registry import load_registry
from draftflow.core.spec import GraphSpec
from draftflow.plugins.mtp.model import load_head
from draftflow.plugins.mtp.weights import find_mtp
from draftflow.layers.kv_cache import KVCache

CASES = [("deepseek-v3", "qwen3"), ("qwen3-next", "qwen3"), ("deepseek-v3", "llama")]


@pytest.mark.parametrize("layout, arch", CASES)
def test_chunked_pairs_and_chained_steps_match_reference(random_dirs, layout, arch):
    """Pairs fed in chunks, then 3 chained steps, give the reference's logits (1e-4) and drafts."""
    model, _, mtp_dir, state = random_dirs(layout, arch)
    ckpt = find_mtp(str(mtp_dir))
    assert ckpt.layout == layout
    head = load_head(ckpt, torch.device("cpu"), torch.float32)
    embed, lm_head = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    head.bind(embed, lm_head)
    cfg = ckpt.config
    cache = KVCache.from_static(torch.zeros(1, 2, 1, 64, cfg.num_kv_heads, cfg.head_dim))
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (12,), generator=gen)  # t_{i+1}
    hidden = torch.randn(12, cfg.hidden_size, generator=gen)  # h_i
    want_drafts, want_logits = draft_chain(state, layout, model.config, embed, lm_head, tokens.tolist(), hidden, 4)
    with torch.no_grad():
        for s, e in ((0, 5), (5, 6), (6, 12)):
            logits, out = head(tokens[None, s:e], hidden[None, s:e], s, cache)
            cache.commit(e)
        got = [logits[0, -1]]
        for j in range(3):
            logits, out = head(logits[:, -1].argmax(-1, keepdim=True), out, 12 + j, cache)
            got.append(logits[0, -1])
    assert_close_to_scale(torch.stack(got), want_logits, tiny_model_bound(2), "draft logits")  # fc + block, head
    assert [int(g.argmax()) for g in got] == want_drafts


@pytest.mark.parametrize("layout", ["deepseek-v3", "qwen3-next"])
def test_node_drafts_equal_reference_on_target_hidden(random_dirs, layout):
    """In a running graph, every cycle's drafts equal the reference chain over the target's final hidden states."""
    model, target_dir, mtp_dir, state = random_dirs(layout)
    spec = GraphSpec.from_dict({"num_draft": 3, "nodes": {
        "target": {"plugin": "target", "params": {"path": str(target_dir), "tap_layers": [0, 1]}},
        "mtp": {"plugin": "mtp", "params": {"path": str(mtp_dir)}},
        "verify": {"plugin": "verifier"}}})
    plan = build_plan(spec, load_registry())
    plan.raise_if_problems()
    ex = Executor(plan)
    seen = []
    step = ex.nodes["mtp"].step

    def recording(batch, inputs):
        out = step(batch, inputs)
        seen.append((batch.rows[0].position, out["proposal"].tokens[0].tolist()))
        return out

    ex.nodes["mtp"].step = recording
    prompt = [3, 17, 42, 99, 5, 8, 250]
    result = ex.generate(prompt, SamplingParams(max_new_tokens=14, ignore_eos=True))
    seq = torch.tensor([prompt + list(result.token_ids)])
    with torch.no_grad():
        h = model(seq, output_hidden_states=True).hidden_states[-1][0]  # [S, H], after the final norm
    embed, lm_head = model.model.embed_tokens.weight.detach(), model.lm_head.weight.detach()
    assert len(seen) > 2
    for p, drafts in seen:
        want, _ = draft_chain(state, layout, model.config, embed, lm_head, seq[0, 1:p + 1].tolist(), h[:p], len(drafts))
        assert drafts == want, f"cycle at position {p}"

"""DFlash on a Qwen3-Next hybrid target: greedy gate, and per-cycle drafts equal to the dflash package's loop.

dflash 0.1.0's `dflash_generate` rolls its target back with `DynamicCache.crop`, which on a
hybrid cache crops KV and conv states but leaves every recurrent state at the end of the
verify window (shown below). So the reference here is dflash's own loop, step for step,
with that one line replaced: the transformers target recomputes the committed prefix
from scratch each cycle instead of cropping. The drafter and its cache are dflash's.
"""

from __future__ import annotations

import torch
from dflash.model import _crop_to, _make_cache, _output_head, _raw_input_embeddings, extract_context_feature
from dflash_testlib import BLOCK, MASK_ID, build_reference, save_reference, write_graph
from hybrid_testlib import build_hybrid, save

from draftflow.core.executor import Executor
from draftflow.core.node import SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import load_graph
from draftflow.testing import greedy_gate

TAPS = [0, 2]  # both after Gated DeltaNet layers


def agreeing_hybrid_pair(root, eps: float = 0.3, c: float = 5.0):
    """A hybrid target and a drafter that agree often but not always (dflash_testlib.agreeing_pair's recipe)."""
    tgt, ref = build_hybrid(seed=7), build_reference(taps=TAPS)
    with torch.no_grad():
        for layer in tgt.model.layers:
            mixer = layer.linear_attn.out_proj if hasattr(layer, "linear_attn") else layer.self_attn.o_proj
            mixer.weight.mul_(eps)
            layer.mlp.down_proj.weight.mul_(eps)
        for layer in ref.layers:
            layer.self_attn.o_proj.weight.mul_(eps)
            layer.mlp.down_proj.weight.mul_(eps)
        ref.norm.weight.copy_(1.0 + tgt.model.norm.weight)  # the target's (1 + w) norm as a plain weight
        u = (1.0 + tgt.model.norm.weight) * tgt.model.embed_tokens.weight[MASK_ID]
        tgt.lm_head.weight[MASK_ID] = c * u / u.norm()
    return save(tgt, root / "target"), save_reference(ref, root / "drafter"), tgt


def reference_loop(model, target, prompt: list[int], new: int):
    """dflash_generate's greedy loop; the target recomputes the committed prefix instead of cropping its cache."""
    out = target(torch.tensor([prompt]), output_hidden_states=True)
    ids, start, limit = prompt + [int(out.logits[0, -1].argmax())], len(prompt), len(prompt) + new
    ctx, cache, drafts = extract_context_feature(out.hidden_states, model.target_layer_ids), _make_cache(model.config), {}
    while start + 1 < limit:
        width = min(BLOCK, limit - start)
        block = [ids[start]] + [MASK_ID] * (width - 1)
        if width > 1:
            noise = _raw_input_embeddings(target, torch.tensor([block]), 1.0)
            hidden = model(target_hidden=ctx, noise_embedding=noise, past_key_values=cache, use_cache=True,
                           position_ids=torch.arange(start - ctx.shape[1], start + width)[None])[:, 1 - width:]
            _crop_to(cache, start)
            block[1:] = model.compute_logits(hidden, _output_head(target)).argmax(-1)[0].tolist()
            drafts[start] = block[1:]
        out = target(torch.tensor([ids[:start] + block]), output_hidden_states=True)
        posterior = out.logits[0, start:].argmax(-1).tolist()
        accepted = next((j for j in range(width - 1) if block[j + 1] != posterior[j]), width - 1)
        produced = min(accepted + 1, limit - start - 1)
        ids = ids[:start] + block[:accepted + 1] + [posterior[accepted]]
        ctx = extract_context_feature(out.hidden_states, model.target_layer_ids)[:, start:start + produced]
        start += produced
    return ids[len(prompt):min(start + 1, limit)], drafts


def test_crop_leaves_hybrid_recurrent_state_at_window_end():
    """Evidence: transformers' DynamicCache.crop (what dflash 0.1.0 calls) does not roll back recurrent states."""
    target, prompt = build_hybrid(seed=7), torch.tensor([[5, 6, 7, 8, 9, 10]])
    with torch.no_grad():
        cache = _make_cache(target.config)
        target(prompt[:, :3], past_key_values=cache, use_cache=True)
        target(prompt[:, 3:], past_key_values=cache, use_cache=True)
        _crop_to(cache, 4)  # keep one of the three window tokens
        fresh = _make_cache(target.config)
        target(prompt[:, :4], past_key_values=fresh, use_cache=True)
    assert cache.get_seq_length() == 4
    assert not torch.allclose(cache.layers[0].recurrent_states[0], fresh.layers[0].recurrent_states[0], atol=1e-3)


def test_greedy_gate_and_drafts_match_reference_loop(tmp_path):
    """Greedy DFlash on the hybrid equals target-only, and every full-block draft equals the reference loop's."""
    target_dir, drafter_dir, target = agreeing_hybrid_pair(tmp_path)
    graph = write_graph(tmp_path / "g.yaml", target_dir, drafter_dir, tap_layers=TAPS)
    registry = load_registry()
    prompts = [[3, 4, 5, 6, 7], [10, 300, 11, 300]]
    report = greedy_gate(str(graph), prompts, max_new_tokens=40, registry=registry)
    stats = [r.stats for r in report.speculative]
    assert sum(s["accepted"] for s in stats) > 0 and any(s["acceptance_rate"] < 1 for s in stats)

    ref_model = build_reference(taps=TAPS).__class__.from_pretrained(drafter_dir, torch_dtype=torch.float32).eval()
    ex = Executor(build_plan(load_graph(graph), registry))
    node, got = ex.nodes["drafter"], {}
    step = node.step

    def spy(batch, inputs):
        out = step(batch, inputs)
        got[batch.rows[0].position] = out["proposal"].tokens[0].tolist()
        return out

    node.step = spy
    compared = 0
    for prompt in prompts:
        got.clear()
        with torch.no_grad():
            want_ids, want = reference_loop(ref_model, target, prompt, 40)
        result = ex.generate(prompt, SamplingParams(max_new_tokens=40, ignore_eos=True))
        assert list(result.token_ids) == want_ids
        # Our first window starts at the last prompt token, dflash's one token later, so the anchors
        # coincide only after a partial acceptance re-aligns them; compare at every shared anchor.
        common = [p for p in got if p in want and len(got[p]) == len(want[p]) == BLOCK - 1]
        assert all(got[p] == want[p] for p in common), [(p, got[p], want[p]) for p in common if got[p] != want[p]]
        compared += len(common)
    assert compared >= 4

"""Model parity with the z-lab `dflash` 0.1.0 reference (test-only oracle), float32."""

from __future__ import annotations

import pytest
import torch
from dflash_testlib import DRAFT_KW, build_reference, save_reference, spread
from dflash.model import _crop_to, _make_cache

from numerics import assert_close_to_scale, tiny_model_bound

from draftflow.plugins.dflash.config import kv_shape
from draftflow.plugins.dflash.loader import load_drafter
from draftflow.plugins.dflash.model import draft_logits
from draftflow.layers.kv_cache import KVCache

# (new context rows C, block width W) per cycle: prefill-sized context, partial acceptances, a short final block.
CYCLES = [(7, 6), (3, 6), (1, 6), (6, 6), (2, 4), (1, 2)]
VARIANTS = {
    "full-noncausal": {},
    "all-causal": {"is_causal": True},
    "sliding": {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 5},
    "scaled-softcapped": {"dflash": {"output_multiplier": 0.5, "final_logit_softcapping": 3.0}},
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_draft_logits_match_reference_across_cycles(tmp_path, variant):
    """Same weights, features and block embeddings: logits equal the reference within 1e-5 over cycles with cache crops."""
    extra = dict(VARIANTS[variant])
    ref = build_reference(seed=3, **extra.pop("dflash", {}))
    for key, value in extra.items():
        setattr(ref.config, key, value)
    ref = type(ref)(ref.config).eval()  # rebuild so per-layer causality / windows are read from the config
    spread(ref, 4)
    path = save_reference(ref, tmp_path / variant)
    ours, cfg = load_drafter(path, "cpu", torch.float32)
    gen = torch.Generator().manual_seed(0)
    head = torch.nn.Linear(64, 320, bias=False)
    torch.nn.init.normal_(head.weight, generator=gen)
    ref_cache = _make_cache(ref.config)
    cache = KVCache.from_static(torch.zeros(kv_shape(cfg, 64)))
    start = 0
    for ctx_rows, width in CYCLES:
        features = torch.randn(1, ctx_rows, 128, generator=gen)
        block = torch.randn(1, width, 64, generator=gen)
        start += ctx_rows
        with torch.no_grad():
            want_hidden = ref(position_ids=torch.arange(start - ctx_rows, start + width)[None], noise_embedding=block,
                              target_hidden=features, past_key_values=ref_cache, use_cache=True)[:, 1:]
            _crop_to(ref_cache, start)
            want = ref.compute_logits(want_hidden, head)
        got = draft_logits(ours.draft(features, start - ctx_rows, block, cache)[:, 1:], head.weight, cfg)
        assert cache.length == start
        assert_close_to_scale(got, want, tiny_model_bound(DRAFT_KW["num_hidden_layers"]), "draft logits")


def test_a_written_window_survives_the_reference_config():
    """A windowed config as draftflow writes it keeps its window in transformers' Qwen3Config (the reference's class).

    Qwen3Config drops `sliding_window` unless `use_sliding_window` is true, and the reference then fails to build its
    cache; the demo drafters are windowed.
    """
    from dflash.model import DFlashDraftModel

    from draftflow.plugins.dflash.config import DFlashConfig

    d = {**build_reference(seed=3).config.to_dict(), "layer_types": ["sliding_attention"] * 2, "sliding_window": 5,
         "is_causal": False}
    d.pop("use_sliding_window", None)
    ours = DFlashConfig.from_hf_dict(d, "config.json")
    theirs = DFlashDraftModel.config_class(**ours.to_hf_dict())
    assert theirs.sliding_window == 5 and list(theirs.layer_types) == ["sliding_attention"] * 2
    _make_cache(theirs)  # raises on a window of None

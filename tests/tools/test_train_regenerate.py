"""`--labels regenerate`: windows the target wrote itself give every block the target's own chain as labels."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, run_cli, SMALL_PAIR

from draftflow.plugins.dflash.model import DFlashModel
from draftflow.plugins.target.hf_loader import load_hf
from draftflow.tools.train.data import TokenData, WindowSampler, body_starts
from draftflow.tools.train.dflash_recipe import DFlashRecipe, new_config
from draftflow.tools.train.loop import greedy_continuation, init_weights
from draftflow.tools.train.regenerate import RegeneratedSampler, regenerate

DEMO = SMALL_PAIR / "target"
WIDTH, PROMPT, SEQ = 4, 12, 40


@pytest.fixture(scope="module")
def demo():
    """The shipped demo target (a trained model, so its greedy chain often disagrees with raw text)."""
    return load_hf(DEMO, "cpu", torch.float32)


@pytest.fixture(scope="module")
def stream(demo):
    text = (ROOT / "core" / "executor.py").read_text() + (ROOT / "core" / "registry.py").read_text()
    ids = [e.ids for e in demo.tokenizer.encode_batch([text], add_special_tokens=False)][0]
    return torch.tensor(ids, dtype=torch.long)


def _recipe(model, labels: str) -> DFlashRecipe:
    cfg = new_config(model, num_layers=1, block_size=WIDTH, tap_layers=(1, 2), mask_token_id=2047)
    drafter = DFlashModel(cfg)
    init_weights(drafter, seed=1)
    return DFlashRecipe(model, drafter, num_anchors=6, labels=labels, seed=2)


def _chain_mismatches(model, windows: torch.Tensor, recipe: DFlashRecipe, first=None) -> tuple[int, int]:
    """(blocks whose labels differ from the target's greedy chain after their anchor, blocks checked)."""
    state = recipe.generator.get_state()
    with torch.no_grad():
        blocks = recipe.forward_blocks(windows, first)
    recipe.generator.set_state(state)
    anchors = recipe._anchors(*windows.shape, first)  # the same draws forward_blocks made
    bad = total = 0
    for b in range(windows.shape[0]):
        for j, a in enumerate(anchors[b].tolist()):
            chain, _ = greedy_continuation(model, windows[b:b + 1, :a + 1], WIDTH - 1, (1,))
            bad += int(not torch.equal(chain, blocks.labels[b, j]))
            total += 1
    return bad, total


def test_regenerated_tail_is_the_targets_greedy_continuation(demo, stream):
    """Each pool row is its text prompt followed by exactly what single-sequence greedy decoding writes."""
    prompts = torch.stack([stream[s:s + PROMPT] for s in (0, 50, 333)])
    rows = regenerate(demo.model, prompts, SEQ, batch_size=2)  # two batches: 2 + 1 rows
    assert rows.shape == (3, SEQ) and torch.equal(rows[:, :PROMPT], prompts)
    for r in range(3):
        chain, _ = greedy_continuation(demo.model, prompts[r:r + 1], SEQ - PROMPT, (1,))
        assert torch.equal(rows[r, PROMPT:], chain), r


def test_block_labels_follow_the_targets_chain_only_when_regenerated(demo, stream):
    """Regenerated windows: every block's labels are the target's chain from its anchor. Raw text with the
    target's per-position predictions (`--labels target`): rows >= 2 are not, for some blocks."""
    data = TokenData(stream[:-200], stream[-200:], 1, 0)
    regen = RegeneratedSampler(WindowSampler(data, SEQ, seed=0), demo.model, (8, 20), windows=12, seed=0,
                               batch_size=4)
    assert regen.pool.shape == (12, SEQ) and len(set(regen.first_anchor.tolist())) > 1  # one P per batch of 4
    assert 7 <= int(regen.first_anchor.min()) and int(regen.first_anchor.max()) <= 19
    windows, first = regen.batch(5)
    assert all((regen.pool == w).all(1).any() for w in windows)
    bad, total = _chain_mismatches(demo.model, windows, _recipe(demo.model, "data"), first)
    assert total == 30 and bad == 0
    raw = torch.stack([stream[s:s + SEQ] for s in (0, 100, 200)])
    bad, total = _chain_mismatches(demo.model, raw, _recipe(demo.model, "target"))
    assert bad > 0, "raw-text target labels happened to follow the chain everywhere; pick other windows"


def test_anchors_start_at_each_rows_last_prompt_token(demo):
    recipe = _recipe(demo.model, "data")
    first = torch.tensor([PROMPT - 1] * 25 + [PROMPT + 9] * 25)
    anchors = recipe._anchors(50, SEQ, first)
    assert int(anchors[:25].min()) == PROMPT - 1 and int(anchors[25:].min()) == PROMPT + 9
    assert int(anchors.max()) == SEQ - WIDTH and bool((anchors >= first[:, None]).all())
    with pytest.raises(ValueError, match="no anchor"):
        recipe._anchors(1, SEQ, torch.tensor([SEQ]))


def test_cli_trains_dflash_on_regenerated_windows(tmp_path):
    """`draftflow train dflash --labels regenerate` regenerates the pool, trains, lowers the loss, writes the drafter."""
    summary = tmp_path / "s.json"
    r = run_cli(["train", "dflash", "--target", DEMO, "--out", tmp_path / "d", "--data", ROOT / "core",
                 "--labels", "regenerate", "--prompt-len", "12-20", "--regen-windows", "64", "--steps", "30",
                 "--seq-len", "48", "--batch-size", "8", "--block-size", "4", "--layers", "1", "--anchors", "8",
                 "--eval-every", "0", "--eval-windows", "2", "--save-every", "0", "--lr", "3e-3", "--warmup", "0.1",
                 "--max-data-mb", "0.2", "--device", "cpu", "--summary", summary])
    assert r.returncode == 0, r.stderr
    assert "regenerated 64 windows of 48 tokens (12-20 of text, the rest written by the target)" in r.stderr
    s = json.loads(summary.read_text())
    assert s["steps"] == 30 and s["last_loss"] < s["first_loss"] - 0.3, s
    assert s["regen_passes"] == 3.75 and "went over the" not in r.stderr  # 30 x 8 / 64: no note
    parts = s["read_text_seconds"] + s["load_target_seconds"] + s["tokenize_seconds"]
    assert 0 < parts <= s["setup_seconds"] + 0.2 and f"set up in {s['setup_seconds']:.1f} s" in r.stderr, s
    assert (tmp_path / "d" / "model.safetensors").exists()


def test_cli_rejects_a_window_with_no_room_after_the_prompt(tmp_path):
    r = run_cli(["train", "dflash", "--target", DEMO, "--out", tmp_path / "d", "--data", ROOT / "core",
                 "--labels", "regenerate", "--prompt-len", "60", "--seq-len", "64", "--block-size", "8",
                 "--steps", "1", "--max-data-mb", "0.1", "--device", "cpu"])
    assert r.returncode != 0 and "Traceback" not in r.stderr
    assert "--seq-len 64 leaves no block of 8 after --prompt-len 60" in r.stderr


def test_prompt_range_defaults_leave_room_for_every_anchor():
    from draftflow.core.errors import DraftflowError
    from draftflow.tools.train.cli import _prompt_range

    assert _prompt_range(None, 128, 8, 16) == (16, 106)  # 106-1 .. 120: 16 anchors
    assert _prompt_range("32", 128, 8, 16) == (32, 32) and _prompt_range("16-96", 128, 8, 16) == (16, 96)
    with pytest.raises(DraftflowError, match="expected a number like 32"):
        _prompt_range("many", 128, 8, 16)
    with pytest.raises(DraftflowError, match="1 <= MIN <= MAX"):
        _prompt_range("40-20", 128, 8, 16)


def test_held_out_loss_windows_are_regenerated_held_out_prompts(demo, stream):
    """The held-out loss is taken on held-out prompts continued by the target, blocks after the prompt only."""
    data = TokenData(stream[:-300], stream[-300:], 1, 0)
    regen = RegeneratedSampler(WindowSampler(data, SEQ, seed=0), demo.model, (8, 20), windows=4, seed=0)
    tokens, first = regen.held_out_loss(3)
    raw = regen.held_out(3)
    assert tokens.shape == (3, SEQ) and bool(((first >= 7) & (first <= 19)).all())
    assert len(set(first.tolist())) > 1  # ragged prompts, regenerated in one batch
    for i in range(3):
        p = int(first[i]) + 1
        assert torch.equal(tokens[i, :p], raw[i][:p])
        chain, _ = greedy_continuation(demo.model, raw[i][None, :p], SEQ - p, (1,))
        assert torch.equal(tokens[i, p:], chain)
    recipe = _recipe(demo.model, "data")
    out = recipe.evaluate(raw[:1], (tokens, first))
    assert {"loss", "tau", "acceptance"} <= set(out) and out["loss"] > 0
    short = RegeneratedSampler(WindowSampler(TokenData(stream[:-30], stream[-30:], 1, 0), SEQ), demo.model, (8, 20), 2)
    assert short.held_out_loss(3) is None  # held-out text shorter than a window: the raw windows are scored


def test_cli_trains_mtp_on_regenerated_windows(tmp_path):
    """MTP on regenerated windows (labels: the target's predictions, exact at every position) runs and learns."""
    summary = tmp_path / "s.json"
    r = run_cli(["train", "mtp", "--target", DEMO, "--out", tmp_path / "m", "--data", ROOT / "core",
                 "--labels", "regenerate", "--regen-windows", "32", "--steps", "20", "--seq-len", "48",
                 "--batch-size", "8", "--eval-every", "0", "--eval-windows", "2", "--save-every", "0", "--lr", "3e-3",
                 "--warmup", "0.1", "--max-data-mb", "0.2", "--device", "cpu", "--summary", summary])
    assert r.returncode == 0, r.stderr
    assert "regenerated 32 windows of 48 tokens (16-47 of text" in r.stderr
    s = json.loads(summary.read_text())
    assert s["last_loss"] < s["first_loss"] - 0.3 and s["evaluations"][-1][1]["loss"] > 0, s
    # 20 steps of 8 windows over a pool of 32: 5 passes, past POOL_PASSES; the note says how many windows would do
    assert s["regen_passes"] == 5.0
    assert ("note: 20 steps of 8 windows went over the 32 regenerated windows 5 times; past about 4 the held-out loss "
            "rose in the demo's runs (docs/TRAINING.md): for a run this long give --regen-windows 40 or more") in r.stderr


def test_sampled_regeneration_draws_from_the_targets_distribution(demo, stream):
    """--regen-temperature T: the written tokens are samples of softmax(logits / T) (the first written token of 4,000
    copies of one prompt: total variation from the target's distribution < 0.05), reproducible by seed, and not the
    greedy chain."""
    from draftflow.layers.kv_cache import KVCache, static_shape

    prompt = stream[:PROMPT]
    copies = prompt.expand(4000, PROMPT).contiguous()
    rows = regenerate(demo.model, copies, PROMPT + 1, batch_size=4000, temperature=0.7, seed=3)
    cache = KVCache.from_static(torch.empty(static_shape(demo.model.config, 1, PROMPT), dtype=torch.float32))
    logits, _ = demo.model(prompt[None], 0, cache, logit_rows=1)
    want = torch.softmax(logits[0, -1].float() / 0.7, -1)
    got = torch.bincount(rows[:, PROMPT], minlength=want.numel()).float() / rows.shape[0]
    assert 0.5 * (got - want).abs().sum() < 0.05
    prompts = torch.stack([stream[s:s + PROMPT] for s in (0, 50, 333)])
    a = regenerate(demo.model, prompts, SEQ, temperature=1.0, seed=5)
    assert torch.equal(a, regenerate(demo.model, prompts, SEQ, temperature=1.0, seed=5))
    assert not torch.equal(a, regenerate(demo.model, prompts, SEQ, temperature=1.0, seed=6))
    assert not torch.equal(a, regenerate(demo.model, prompts, SEQ))  # greedy


def _tiny_train(tmp_path) -> list:
    """A 2-step `draftflow train dflash` on the demo target writing to tmp_path/d (add the options under test)."""
    return ["train", "dflash", "--target", DEMO, "--out", tmp_path / "d", "--data", ROOT / "core", "--steps", "2",
            "--seq-len", "48", "--batch-size", "4", "--block-size", "4", "--layers", "1", "--anchors", "4",
            "--eval-every", "0", "--eval-windows", "1", "--save-every", "0", "--max-data-mb", "0.1", "--device", "cpu"]


@pytest.mark.parametrize(("flag", "good", "said", "bad", "refused"), [
    ("--regen-temperature", "1", "(12-12 of text, the rest sampled at T = 1 by the target)", "-1",
     "--regen-temperature -1.0: must be at least 0.0"),
    ("--regen-body-share", "1", "(12-12 of text, the rest written by the target; 1 of the prompts end where a body "
     "starts)", "2", "--regen-body-share 2.0: must be at most 1.0"),
])
def test_cli_regen_options_are_reported_and_checked(tmp_path, flag, good, said, bad, refused):
    """The CLI's pool line says how the windows were made; a value out of range, or the option without --labels
    regenerate, is one error line."""
    base = _tiny_train(tmp_path)
    r = run_cli(base + ["--labels", "regenerate", "--prompt-len", "12", "--regen-windows", "8", flag, good])
    assert r.returncode == 0, r.stderr
    assert f"regenerated 8 windows of 48 tokens {said}" in r.stderr
    wrong = run_cli(base + ["--labels", "regenerate", flag, bad, "--out", tmp_path / "e"])
    assert wrong.returncode != 0 and refused in wrong.stderr and "Traceback" not in wrong.stderr, wrong.stderr
    stray = run_cli(base + [flag, "0.5", "--out", tmp_path / "f"])
    assert stray.returncode != 0 and f"{flag} applies to --labels regenerate only" in stray.stderr


def test_pool_cache_is_read_back_only_for_the_same_run(demo, stream, tmp_path):
    """cache=FILE: the first sampler writes its pool; one made the same way reads that file back (a doctored file
    shows it is read, not regenerated); another seed, or reuse=False, regenerates and rewrites it."""
    data = TokenData(stream[:-60], stream[-60:], 1, 0)
    cache = tmp_path / "ckpt.pt.regen.pt"

    def sampler(seed: int = 0, reuse: bool = True) -> RegeneratedSampler:
        return RegeneratedSampler(WindowSampler(data, SEQ, seed=0), demo.model, (8, 20), windows=6, seed=seed,
                                  batch_size=3, cache=cache, reuse=reuse)

    first = sampler()
    assert not first.reused and cache.is_file()
    again = sampler()
    assert again.reused and torch.equal(again.pool, first.pool) and torch.equal(again.first_anchor, first.first_anchor)
    state = torch.load(cache, weights_only=True)
    torch.save({**state, "pool": torch.zeros_like(state["pool"])}, cache)
    assert sampler().reused and int(sampler().pool.abs().sum()) == 0  # what the file holds
    other = sampler(seed=1)
    assert not other.reused and int(other.pool.abs().sum()) > 0
    assert torch.equal(torch.load(cache, weights_only=True)["pool"].long(), other.pool)  # rewritten for seed 1
    assert not sampler(seed=1, reuse=False).reused
    cache.write_bytes(cache.read_bytes()[:100])  # truncated: generated again, and said why
    truncated = sampler(seed=1)
    assert not truncated.reused and "is unreadable" in truncated.cache_note and torch.equal(truncated.pool, other.pool)
    assert sampler(seed=1).reused  # rewritten whole
    text = [demo.tokenizer.decode([i]) for i in range(demo.tokenizer.get_vocab_size())]
    bodies = RegeneratedSampler(WindowSampler(data, SEQ, seed=0), demo.model, (8, 20), windows=6, seed=1,
                                batch_size=3, cache=cache, body_share=0.5, token_text=text)
    assert not bodies.reused and "made another way" in bodies.cache_note  # the share is part of the key


def test_cli_resume_reads_the_regenerated_pool_back(tmp_path):
    """`--resume` after a run: the pool kept next to the checkpoint is read back, not generated again."""
    args = ["train", "dflash", "--target", DEMO, "--out", tmp_path / "d", "--data", ROOT / "core", "--labels",
            "regenerate", "--prompt-len", "12-20", "--regen-windows", "8", "--steps", "2", "--seq-len", "48",
            "--batch-size", "2", "--block-size", "4", "--layers", "1", "--anchors", "4", "--eval-every", "0",
            "--eval-windows", "1", "--max-data-mb", "0.1", "--device", "cpu", "--resume"]
    first = run_cli(args)
    assert first.returncode == 0, first.stderr
    assert "read back" not in first.stderr and (tmp_path / "d" / "checkpoint.pt.regen.pt").is_file()
    second = run_cli(args)  # the folder holds only this recipe's files (the pool included): no --overwrite needed
    assert second.returncode == 0, second.stderr
    assert f"read back from {tmp_path / 'd' / 'checkpoint.pt.regen.pt'}" in second.stderr


SNIPPET = '''import os


def add(x, y):
    """Add two numbers.

    More text.
    """
    return x + y


class A(object):
    def f(self):  # note
        s = """not a doc
def g(): inside"""
        return s

    def h(self,
          y) -> int:
        """One line."""
        return 1
'''


def test_body_starts_mark_headers_and_docstring_ends(demo):
    """`data.body_starts`: the newline after a def/class line or after a docstring's closing quotes, and nothing in a
    string literal (`def g()` inside one) or after a string that is not a docstring."""
    ids = demo.tokenizer.encode(SNIPPET, add_special_tokens=False).ids
    text = [demo.tokenizer.decode([i]) for i in range(demo.tokenizer.get_vocab_size())]
    ends = [demo.tokenizer.decode(ids[:i + 1]).rstrip(" ").split("\n")[-2].strip() for i in body_starts(
        torch.tensor(ids), text)]
    assert ends == ["def add(x, y):", '"""', "class A(object):", "def f(self):  # note", '"""One line."""']


def test_regenerated_prompts_end_where_a_body_starts(demo, stream):
    """--regen-body-share 1: every pooled window's prompt ends at a body start of the training stream; 0.5: half of
    each generation batch does; without the option few do."""
    text = [demo.tokenizer.decode([i]) for i in range(demo.tokenizer.get_vocab_size())]
    data = TokenData(stream[:-200], stream[-200:], 1, 0)
    ends = set(body_starts(data.train, text))

    def prompt_ends(regen):  # how many rows' prompts are a stream slice that ends at a body start
        hits = 0
        for row, first in zip(regen.pool, regen.first_anchor.tolist()):
            prompt = row[:first + 1]
            hits += any(torch.equal(data.train[c - first:c + 1], prompt) for c in ends if c >= first)
        return hits

    every = RegeneratedSampler(WindowSampler(data, SEQ, seed=0), demo.model, (8, 20), windows=8, seed=0,
                               batch_size=4, body_share=1.0, token_text=text)
    assert prompt_ends(every) == 8
    half = RegeneratedSampler(WindowSampler(data, SEQ, seed=0), demo.model, (8, 20), windows=8, seed=0,
                              batch_size=4, body_share=0.5, token_text=text)
    plain = RegeneratedSampler(WindowSampler(data, SEQ, seed=0), demo.model, (8, 20), windows=8, seed=0, batch_size=4)
    assert prompt_ends(half) >= 4 and prompt_ends(plain) < 4
    with pytest.raises(ValueError, match="body_share needs token_text"):
        RegeneratedSampler(WindowSampler(data, SEQ, seed=0), demo.model, (8, 20), windows=2, body_share=0.5)

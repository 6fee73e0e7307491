"""`python -m draftflow.tools.convert_dflash --target`: the drafter GGUF carries its target's tokenizer keys, as llama.cpp's do."""

from __future__ import annotations

import json
import re

import pytest
from gguf import GGUFReader
from helpers import ROOT, SMALL_PAIR

from draftflow.plugins.dflash.loader import read_config
from draftflow.tools import convert_dflash, convert_gguf

DEMO = SMALL_PAIR


@pytest.fixture(scope="module")
def target_gguf(tmp_path_factory):
    """The demo target as a Q8_0 GGUF (its tokenizer.json embedded as llama.cpp's gpt2 tokenizer)."""
    out = tmp_path_factory.mktemp("target") / "target-q8_0.gguf"
    assert convert_gguf.main([str(DEMO / "target"), str(out), "--outtype", "q8_0"]) == 0
    return out


def _tokenizer_keys(reader: GGUFReader) -> dict[str, tuple]:
    """Every `tokenizer.*` key -> (value types, contents)."""
    return {k: (tuple(f.types), f.contents()) for k, f in reader.fields.items() if k.startswith("tokenizer.")}


def _variant(tmp_path, **config) -> str:
    """A copy of the demo DFlash drafter whose config.json has `config` merged in (same weights)."""
    out = tmp_path / "variant"
    out.mkdir()
    (out / "model.safetensors").symlink_to(DEMO / "dflash" / "model.safetensors")
    base = json.loads((DEMO / "dflash" / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**base, **config}))
    return str(out)


@pytest.mark.parametrize("drafter", ["dflash", "dflash2"])
def test_drafter_gguf_carries_every_tokenizer_key_of_the_target(target_gguf, tmp_path, drafter):
    """Each of the target file's tokenizer keys is in the drafter file with its type and value; the mask id stays the drafter's."""
    out = tmp_path / "d.gguf"
    assert convert_dflash.main([str(DEMO / drafter), str(out), "--target", str(target_gguf)]) == 0
    want, got = _tokenizer_keys(GGUFReader(target_gguf)), _tokenizer_keys(GGUFReader(out))
    assert {"tokenizer.ggml.model", "tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type",
            "tokenizer.ggml.pre", "tokenizer.ggml.eos_token_id"} <= want.keys()
    assert got == {**want, "tokenizer.ggml.mask_token_id": got["tokenizer.ggml.mask_token_id"]}
    assert got["tokenizer.ggml.mask_token_id"][1] == 2047
    assert read_config(out) == read_config(DEMO / drafter)  # draftflow reads the drafter as before


def test_target_hf_directory_gives_the_keys_convert_gguf_writes(target_gguf, tmp_path):
    """--target HF_DIR writes the same tokenizer keys as the target's own GGUF conversion."""
    out = tmp_path / "d.gguf"
    assert convert_dflash.main([str(DEMO / "dflash"), str(out), "--target", str(DEMO / "target")]) == 0
    got = _tokenizer_keys(GGUFReader(out))
    got.pop("tokenizer.ggml.mask_token_id")
    assert got == _tokenizer_keys(GGUFReader(target_gguf))


def test_without_target_the_file_has_no_tokenizer_and_says_so(tmp_path, capsys):
    """No --target: the conversion succeeds, the file has no tokenizer.ggml.model, and a note names --target."""
    out = tmp_path / "d.gguf"
    assert convert_dflash.main([str(DEMO / "dflash"), str(out)]) == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("note: ") and "llama.cpp refuses it" in err and "--target" in err
    assert GGUFReader(out).get_field("tokenizer.ggml.model") is None


@pytest.mark.parametrize("case, pattern", [
    ("text file", r"error: --target \S+README.md: not a readable GGUF file \(ValueError\); expected the target model's "
                  r".gguf file or HF directory"),
    ("directory without config.json", r"error: --target \S+docs: the directory has no config.json"),
    ("missing", r"error: --target \S+nope: no such file or directory"),
    ("drafter GGUF", r"error: --target \S+plain.gguf: the file has no tokenizer.ggml.model; expected the target "
                     r"model's GGUF"),
    ("vocab mismatch", r"error: --target \S+target-q8_0.gguf: the target's vocabulary has 2048 tokens but the drafter "
                       r"\S+variant has vocab_size 4096; expected the target the drafter was trained for"),
    ("mask id outside", r"error: --target \S+target-q8_0.gguf: the drafter's mask_token_id 5000 is outside the "
                        r"target's 2048-token vocabulary"),
    ("gguf source", r"error: --target \S+target-q8_0.gguf: applies to directory -> GGUF only"),
])
def test_bad_target_is_one_line_and_exit_1(target_gguf, tmp_path, capsys, case, pattern):
    """A non-model, a target without a tokenizer, or a drafter made for another vocabulary: one `error:` line, no file."""
    src, target = str(DEMO / "dflash"), str(target_gguf)
    if case == "text file":
        target = str(ROOT / "README.md")
    elif case == "directory without config.json":
        target = str(ROOT / "docs")
    elif case == "missing":
        target = str(tmp_path / "nope")
    elif case == "drafter GGUF":
        target = str(tmp_path / "plain.gguf")
        assert convert_dflash.main([src, target]) == 0
    elif case == "vocab mismatch":
        src = _variant(tmp_path, vocab_size=4096)
    elif case == "mask id outside":
        src = _variant(tmp_path, vocab_size=None, dflash_config={"mask_token_id": 5000, "target_layer_ids": [1, 2, 3]})
    elif case == "gguf source":
        src = str(tmp_path / "plain.gguf")
        assert convert_dflash.main([str(DEMO / "dflash"), src]) == 0
    capsys.readouterr()
    out = tmp_path / "out.gguf"
    assert convert_dflash.main([src, str(out), "--target", target]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1, err
    assert re.match(pattern, err), err
    assert not out.exists()

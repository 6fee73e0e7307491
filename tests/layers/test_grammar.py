"""Tests for layers.grammar: masks for a window of drafts, rollback, commits and compile errors."""

from __future__ import annotations

import json
import random

import pytest
import tokenizers
import torch

from draftflow.core.node import GrammarSpec
from draftflow.layers.grammar import GrammarCompiler
from draftflow.plugin import RequestError
from helpers import ROOT, SMALL_PAIR

TOKENIZER = SMALL_PAIR / "target" / "tokenizer.json"
VOCAB, EOS = 2048, 0
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "items": {"enum": ["a", "bc", "def"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
DOC = {"name": "Ada", "age": 36, "tags": ["bc", "a"], "ok": True}


@pytest.fixture(scope="module")
def tok():
    return tokenizers.Tokenizer.from_file(str(TOKENIZER))


@pytest.fixture(scope="module")
def compiler(tok):
    return GrammarCompiler(tok, VOCAB, (EOS,))


def _schema(schema=SCHEMA) -> GrammarSpec:
    return GrammarSpec("json_schema", json.dumps(schema))


def _ids(tok, text: str) -> list[int]:
    return tok.encode(text).ids


def _stepwise_masks(compiler, spec, tokens) -> list[torch.Tensor]:
    """Masks read one position at a time: mask before tokens[0], after tokens[:1], ..."""
    matcher = compiler.compile(spec)
    masks = []
    for t in tokens:
        masks.append(matcher.allowed([])[0])
        matcher.commit([t])
    masks.append(matcher.allowed([])[0])
    return masks


def _random_valid_walk(compiler, spec, seed: int, length: int) -> list[int]:
    """A grammar-valid token sequence picked uniformly among allowed tokens (ends at EOS or `length`)."""
    rng = random.Random(seed)
    matcher = compiler.compile(spec)
    tokens = []
    while len(tokens) < length:
        allowed = matcher.allowed([])[0].nonzero().flatten().tolist()
        tokens.append(rng.choice(allowed))
        matcher.commit(tokens[-1:])
        if tokens[-1] == EOS:
            break
    return tokens


def test_schema_valid_document_is_allowed_at_every_token(compiler, tok):
    """Every token of a schema-valid compact document, then EOS, is allowed; the grammar is then done."""
    ids = _ids(tok, json.dumps(DOC, separators=(",", ":")))
    matcher = compiler.compile(_schema())
    rows = matcher.allowed(ids + [EOS])
    assert rows.shape == (len(ids) + 2, VOCAB) and rows.dtype == torch.bool
    assert all(rows[j, t] for j, t in enumerate(ids + [EOS]))
    assert not matcher.done
    matcher.commit(ids)
    assert matcher.done
    only_eos = matcher.allowed([])[0]
    assert only_eos.nonzero().flatten().tolist() == [EOS]
    matcher.commit([EOS])
    assert matcher.done


def test_allowed_rows_equal_stepwise_masks(compiler, tok):
    """allowed(drafts) row j equals the mask of a matcher stepped one token at a time over drafts[:j]."""
    ids = _ids(tok, json.dumps(DOC, separators=(",", ":"))) + [EOS]
    reference = _stepwise_masks(compiler, _schema(), ids)
    matcher = compiler.compile(_schema())
    rows = matcher.allowed(ids)
    for j in range(len(ids) + 1):
        assert torch.equal(rows[j], reference[j]), f"row {j}"


@pytest.mark.parametrize("seed", range(4))
def test_windows_with_rejections_match_target_only_masks(compiler, seed):
    """Cycles of corrupted drafts, partial accepts and commits give, at every real row, the step-by-step mask."""
    spec = GrammarSpec("json_object")
    rng = random.Random(seed)
    truth = _random_valid_walk(compiler, spec, seed, length=60)
    reference = _stepwise_masks(compiler, spec, truth)
    matcher = compiler.compile(spec)
    pos = 0
    while pos < len(truth):
        k = rng.randint(0, 6)
        drafts = truth[pos:pos + k]
        if drafts and rng.random() < 0.6:  # corrupt one draft: the grammar may or may not forbid it
            drafts[rng.randrange(len(drafts))] = rng.randrange(VOCAB)
        rows = matcher.allowed(drafts)
        assert rows.shape == (len(drafts) + 1, VOCAB)
        for j in range(len(drafts) + 1):
            if pos + j > len(truth) or (j and drafts[j - 1] != truth[pos + j - 1]):
                break  # past the true path: row j is not a target-only position
            assert torch.equal(rows[j], reference[pos + j]), f"seed {seed} position {pos + j}"
            if j < len(drafts) and not rows[j, drafts[j]]:
                assert rows[j + 1:].all(), "rows after a forbidden draft must be all True"
                break
        accepted = 0  # the verifier accepts the drafts that agree with the true path, then emits its own token
        while accepted < len(drafts) and drafts[accepted] == truth[pos + accepted]:
            accepted += 1
        emitted = truth[pos:pos + accepted + 1]
        matcher.commit(emitted)
        pos += len(emitted)
    assert matcher.done == (truth[-1] == EOS)


def test_rollback_leaves_the_matcher_as_it_was(compiler, tok):
    """After allowed(drafts) the next mask and done are those before it, and committing still works."""
    ids = _ids(tok, json.dumps(DOC, separators=(",", ":")))
    matcher = compiler.compile(_schema())
    matcher.commit(ids[:5])
    before = matcher.allowed([])[0]
    matcher.allowed(ids[5:])  # the whole rest of the document, grammar complete at the end
    matcher.allowed(ids[5:] + [EOS, EOS])
    matcher.allowed([ids[5], 7, 7])  # a forbidden draft in the window
    assert torch.equal(matcher.allowed([])[0], before)
    assert not matcher.done
    matcher.commit(ids[5:] + [EOS])
    assert matcher.done


def test_rows_after_a_forbidden_draft_are_all_true(compiler, tok):
    """The first forbidden draft ends the real rows; the rest are all True (the masked target rejects there)."""
    matcher = compiler.compile(_schema())
    space = _ids(tok, " ")[0]  # compact JSON: no whitespace after '{'
    rows = matcher.allowed(_ids(tok, "{") + [space, 5, 6])
    assert not rows[1, space]
    assert rows[2:].all()
    assert not rows[:2].all()


def test_rows_after_an_eos_draft_allow_only_eos(compiler, tok):
    """Past an allowed EOS draft every row allows EOS alone, as a finished grammar does."""
    matcher = compiler.compile(GrammarSpec("regex", "ab|abc"))
    ab = _ids(tok, "ab")
    rows = matcher.allowed(ab + [EOS, 5])
    assert rows[len(ab), EOS]
    for row in rows[len(ab) + 1:]:
        assert row.nonzero().flatten().tolist() == [EOS]


def test_committing_a_forbidden_token_is_an_engine_error(compiler, tok):
    """A committed token the grammar forbids raises and leaves the matcher usable."""
    matcher = compiler.compile(GrammarSpec("json_object"))
    before = matcher.allowed([])[0]
    with pytest.raises(RuntimeError, match="not allowed by the grammar"):
        matcher.commit([_ids(tok, "[")[0]])
    assert torch.equal(matcher.allowed([])[0], before)
    matcher.commit(_ids(tok, "{}"))
    assert matcher.done


def test_padded_vocabulary_never_allows_the_extra_ids(tok):
    """With an LM head wider than the tokenizer, masks have its width and the extra ids are always False."""
    compiler = GrammarCompiler(tok, VOCAB + 64, (EOS,))
    matcher = compiler.compile(GrammarSpec("json_object"))
    ids = _ids(tok, '{"a":[1,2]}')
    rows = matcher.allowed(ids + [EOS])
    assert rows.shape == (len(ids) + 2, VOCAB + 64)
    assert not rows[:, VOCAB:].any()
    assert matcher.allowed([VOCAB + 3])[1].all()  # a padded-id draft is forbidden: the next row is not real
    with pytest.raises(RuntimeError, match="not allowed"):
        matcher.commit([VOCAB + 3])


@pytest.mark.parametrize("kind, source, text", [
    ("json_object", "", '{"x":[1,{"y":null}],"z":"w"}'),
    ("regex", r"[0-9]{3}-[a-z]+", "123-abc"),
    ("lark", 'start: "yes" | "no" " " NUM\nNUM: /[0-9]+/', "no 42"),
])
def test_each_kind_accepts_its_language(compiler, tok, kind, source, text):
    """json_object, regex and lark specs allow a text in their language, then EOS."""
    ids = _ids(tok, text)
    matcher = compiler.compile(GrammarSpec(kind, source))
    rows = matcher.allowed(ids + [EOS])
    assert all(rows[j, t] for j, t in enumerate(ids + [EOS]))


def test_schema_true_allows_any_json_value(compiler, tok):
    """The boolean schema `true` compiles and allows any JSON value, an array included."""
    ids = _ids(tok, '[1,"a",null]')
    rows = compiler.compile(GrammarSpec("json_schema", "true")).allowed(ids + [EOS])
    assert all(rows[j, t] for j, t in enumerate(ids + [EOS]))


def test_json_object_forbids_a_non_object(compiler, tok):
    """json_object allows '{' first and neither '[' nor a digit."""
    row = compiler.compile(GrammarSpec("json_object")).allowed([])[0]
    assert row[_ids(tok, "{")[0]]
    assert not row[_ids(tok, "[")[0]] and not row[_ids(tok, "1")[0]]


@pytest.mark.parametrize("kind, source, message", [
    ("json_schema", "{not json", r"'grammar' \(json_schema\): the schema is not valid JSON .*; fix the schema"),
    ("json_schema", "[1, 2]", r"'grammar' \(json_schema\): the schema is a JSON array, not an object"),
    ("json_schema", '{"type": "widget"}', r"'grammar' \(json_schema\): Invalid type: widget; fix the schema"),
    ("json_schema", '{"type": "string", "pattern": "a(b"}', r"'grammar' \(json_schema\): .*unclosed group"),
    ("json_schema", "  ", r"'grammar' \(json_schema\): the source is empty"),
    ("json_schema", '{"type": "array", "uniqueItems": true}', r"'grammar' \(json_schema\): Unimplemented keys: \[\"uniqueItems\"\]"),
    ("json_schema", "false", r"'grammar' \(json_schema\): the schema `false` allows no document; fix the schema"),
    ("regex", "a(b", r"'grammar' \(regex\): invalid regex .*unclosed group; fix the pattern"),
    ("lark", "start: missing_rule", r"'grammar' \(lark\): line 1, column 8: unknown name: \"missing_rule\"; fix the grammar"),
])
def test_compile_errors_name_the_field_and_the_fix(compiler, kind, source, message):
    """A spec the engine cannot compile raises one RequestError line naming the grammar field and its kind."""
    with pytest.raises(RequestError, match=message) as info:
        compiler.compile(GrammarSpec(kind, source))
    assert "\n" not in str(info.value)


def test_commit_off_the_last_window_is_checked_against_real_masks(compiler, tok):
    """Committed tokens that leave the last window's drafts are checked at their own positions."""
    a, b, c, d = (tok.token_to_id(ch) for ch in "abcd")
    matcher = compiler.compile(GrammarSpec("regex", "ab|cd"))
    matcher.allowed([a, b])
    matcher.commit([c, d])
    assert matcher.done
    matcher = compiler.compile(GrammarSpec("regex", "ab|cd"))
    matcher.allowed([c, d])  # its row 1 (after c) allows d; after a it must not
    with pytest.raises(RuntimeError, match=f"committed token {d} \\(token 1 of this commit\\)"):
        matcher.commit([a, d])


def test_a_target_without_eos_cannot_take_a_grammar(tok):
    """A grammar ends by allowing only EOS: no EOS id in the vocabulary is a RequestError naming 'grammar'."""
    with pytest.raises(RequestError, match=r"sampling field 'grammar': the target has no EOS token id"):
        GrammarCompiler(tok, VOCAB, (VOCAB + 5,))


def test_walk_masks_equal_allowed_rows_and_roll_back(compiler, tok):
    """walk hands `choose` the same rows allowed(picks) gives, stops after EOS, and leaves the matcher as it was."""
    ids = _ids(tok, json.dumps(DOC, separators=(",", ":")))
    matcher = compiler.compile(_schema())
    matcher.commit(ids[:3])
    script = ids[3:9]
    seen = []

    def choose(j, mask):
        seen.append(mask.clone())
        return script[j] if j < len(script) else None

    before = matcher.allowed([])[0]
    picks = matcher.walk(choose, max_tokens=len(script) + 2)
    assert picks == script and len(seen) == len(script) + 1  # the row after the last pick was offered, then None
    rows = compiler.compile(_schema())
    rows.commit(ids[:3])
    expected = rows.allowed(script)
    for j, mask in enumerate(seen):
        assert torch.equal(mask, expected[j]), f"row {j}"
    assert torch.equal(matcher.allowed([])[0], before)  # rolled back
    assert matcher.walk(lambda j, mask: EOS if mask[EOS] else None, 3) in ([], [EOS])
    matcher.commit(script)  # reuses the walked masks; still a valid prefix
    assert torch.equal(matcher.allowed([])[0], expected[len(script)])


def test_walk_refuses_a_pick_outside_the_mask(compiler, tok):
    matcher = compiler.compile(_schema())
    forbidden = int((~matcher.allowed([])[0]).nonzero()[0])
    with pytest.raises(ValueError, match="not an allowed token"):
        matcher.walk(lambda j, mask: forbidden, 2)
    first = _ids(tok, "{")[0]
    assert matcher.walk(lambda j, mask: first if j == 0 else None, 2) == [first]  # still usable after the refusal

"""Structured output end to end on the demo pair: schema-valid documents, exact under speculation."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from helpers import ROOT

from draftflow.core.executor import Executor
from draftflow.core.node import GrammarSpec, SamplingParams
from draftflow.core.plan import build_plan
from draftflow.core.registry import load_registry
from draftflow.core.spec import load_graph
from draftflow.layers.grammar import GrammarCompiler
from draftflow.plugin import Proposal, RequestError
from draftflow.testing import target_only

DEMO = ROOT / "graphs" / "models" / "demo"
NUM_DOCS = 50
# Short bounded strings, a bounded integer and enums: the demo target is a tiny code model, so every
# field must close within a few tokens for the document to end inside max_new_tokens.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "kind": {"enum": ["int", "str", "list"]},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["name", "size", "kind", "ok", "tags"],
    "additionalProperties": False,
}
GRAMMAR = GrammarSpec("json_schema", json.dumps(SCHEMA))
MAX_NEW_TOKENS = 128  # a document is at most ~60 tokens here


@pytest.fixture(scope="module")
def executors(tmp_path_factory):
    """Executors for DFlash (graphs/demo.yaml), prompt lookup and target-only decoding on the demo target."""
    registry = load_registry()
    dflash = load_graph(ROOT / "graphs" / "demo.yaml")
    lookup_yaml = tmp_path_factory.mktemp("graphs") / "demo-lookup.yaml"
    lookup_yaml.write_text(json.dumps({
        "name": "demo-lookup", "device": "cpu", "dtype": "float32", "num_draft": 4, "nodes": {
            "target": {"plugin": "target", "params": {"path": str(DEMO / "target")}},
            "lookup": {"plugin": "prompt-lookup"}, "verify": {"plugin": "verifier"}}}))
    specs = {"target-only": target_only(dflash, registry), "dflash": dflash, "lookup": load_graph(lookup_yaml)}
    out = {}
    for name, spec in specs.items():
        plan = build_plan(spec, registry)
        plan.raise_if_problems()
        out[name] = Executor(plan, hook=registry.pm.hook)
    return out


NAMES = ("parse load save read write open close split join merge sort count find match check build make run start "
         "stop send recv fetch push pop get put update delete insert apply reduce filter format encode decode pack "
         "unpack copy move walk scan lex eval exec call wrap clean reset emit").split()


@pytest.fixture(scope="module")
def prompts(executors):
    """50 distinct prompts; the grammar forces JSON whatever the prompt says."""
    tokenizer = executors["target-only"].handle.tokenizer
    return [tokenizer.encode(f"def {name}(x):\n    return ") for name in NAMES[:NUM_DOCS]]


def _generate(executor, prompts, grammar=GRAMMAR, **sampling):
    params = SamplingParams(grammar=grammar, **{"max_new_tokens": MAX_NEW_TOKENS, **sampling})
    return [executor.generate(p, params) for p in prompts]


def _assert_valid_documents(results):
    for i, r in enumerate(results):
        assert r.finish_reason == "stop", f"document {i} did not close in {MAX_NEW_TOKENS} tokens: {r.text!r}"
        jsonschema.validate(json.loads(r.text), SCHEMA)


@pytest.fixture(scope="module")
def reference(executors, prompts):
    """Target-only greedy documents with the grammar."""
    return _generate(executors["target-only"], prompts)


def test_target_only_documents_validate(reference):
    """All 50 greedy target-only documents parse and validate against the schema."""
    _assert_valid_documents(reference)
    assert len(reference) == NUM_DOCS
    assert len({r.text for r in reference}) >= 5, "the prompts should give different documents"


@pytest.mark.parametrize("drafter", ["lookup", "dflash"])
def test_speculative_documents_validate_and_equal_target_only(executors, prompts, reference, drafter):
    """With drafts, all 50 greedy documents validate and are token for token the target-only ones."""
    results = _generate(executors[drafter], prompts)
    _assert_valid_documents(results)
    for i, (r, ref) in enumerate(zip(results, reference)):
        assert r.token_ids == ref.token_ids, f"document {i}: {r.text!r} vs target-only {ref.text!r}"
    assert sum(r.stats["drafted"] for r in results) > 0


def test_dflash_accepts_drafts_under_the_grammar(executors, prompts):
    """DFlash drafts are still accepted with the grammar on (the mask does not reject everything)."""
    results = _generate(executors["dflash"], prompts[:10])
    assert sum(r.stats["accepted"] for r in results) > 0


@pytest.mark.parametrize("drafter", ["target-only", "dflash"])
def test_sampled_documents_validate(executors, prompts, drafter):
    """At temperature 1 (rejection sampling against the masked target) documents still validate."""
    results = _generate(executors[drafter], prompts[:10], temperature=1.0, seed=7)
    _assert_valid_documents(results)


@pytest.mark.parametrize("kind, source, check", [
    ("json_object", "", lambda text: isinstance(json.loads(text), dict)),
    ("regex", r"(yes|no), [0-9]{1,3}", lambda text: text.split(", ")[0] in ("yes", "no")),
])
def test_other_kinds_constrain_the_output(executors, prompts, kind, source, check):
    """json_object gives an object and a regex a full match, with DFlash drafting."""
    results = _generate(executors["dflash"], prompts[:5], grammar=GrammarSpec(kind, source), max_new_tokens=200)
    for r in results:
        assert r.finish_reason == "stop" and check(r.text), r.text


def test_an_invalid_schema_fails_the_request_naming_the_field(executors, prompts):
    """A schema the engine cannot compile is a RequestError naming 'grammar' before any token is generated."""
    with pytest.raises(RequestError, match=r"sampling field 'grammar' \(json_schema\): Invalid type: widget"):
        executors["dflash"].generate(prompts[0], SamplingParams(grammar=GrammarSpec("json_schema", '{"type": "widget"}')))
    assert executors["dflash"].generate(prompts[0], SamplingParams(max_new_tokens=4)).token_ids  # still serves


def _grammar_masked_drafter(executor, monkeypatch):
    """Prototype of drafter masking (not in plugins/dflash): DFlash's q at draft j is masked by the grammar
    given the committed tokens and drafts[:j], renormalised and sampled; the masked q goes to the verifier."""
    node, handle = executor.nodes["drafter"], executor.handle
    compiler = GrammarCompiler(handle.hf_tokenizer, handle.vocab_size, handle.eos_ids)
    live = {"id": None}
    step = node.step

    def masked_step(req, inputs):
        out = step(req, inputs)
        if live["id"] != req.request_id:
            live.update(id=req.request_id, matcher=compiler.compile(req.sampling.grammar), seen=req.prompt_len)
        matcher = live["matcher"]
        matcher.commit(req.tokens[live["seen"]:])
        live["seen"] = len(req.tokens)
        q = out["proposal"].probs  # [1, K, V]
        drafts, rows = [], []
        for j in range(q.shape[1]):
            allowed = matcher.allowed(drafts)[j]  # [V]
            row = q[0, j] * allowed
            row = row / row.sum() if row.sum() > 0 else allowed / allowed.sum()
            drafts.append(int(torch.multinomial(row, 1, generator=req.generator)))
            rows.append(row)
        masked = torch.stack(rows)[None] if rows else q
        out["proposal"] = Proposal(torch.tensor([drafts], dtype=torch.long).reshape(1, -1), probs=masked)
        return out

    monkeypatch.setattr(node, "step", masked_step)


def test_masking_the_drafter_keeps_documents_valid_and_accepts_more(executors, prompts, monkeypatch):
    """Prototype: masking DFlash's q with the grammar still gives valid documents and raises acceptance."""
    sampling = {"temperature": 1.0, "seed": 11}
    plain = _generate(executors["dflash"], prompts[:10], **sampling)
    _grammar_masked_drafter(executors["dflash"], monkeypatch)
    masked = _generate(executors["dflash"], prompts[:10], **sampling)
    _assert_valid_documents(masked)
    rate = [sum(r.stats["accepted"] for r in rs) / sum(r.stats["drafted"] for r in rs) for rs in (plain, masked)]
    assert rate[1] > rate[0] + 0.1, f"acceptance unmasked {rate[0]:.3f}, masked {rate[1]:.3f}"


def test_ignore_eos_pads_a_finished_document_with_eos(executors, prompts):
    """With ignore_eos a complete document is followed by EOS only, speculative equal to target-only."""
    eos = executors["target-only"].handle.eos_ids[0]
    ref = _generate(executors["target-only"], prompts[:3], ignore_eos=True)
    spec = _generate(executors["dflash"], prompts[:3], ignore_eos=True)
    for r, s in zip(ref, spec):
        assert r.finish_reason == "length" and s.token_ids == r.token_ids
        jsonschema.validate(json.loads(r.text), SCHEMA)
        first = r.token_ids.index(eos)
        assert set(r.token_ids[first:]) == {eos}

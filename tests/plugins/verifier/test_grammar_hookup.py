"""The verifier's grammar hook-up, with a small fake matcher in place of layers.grammar.

The fake grammar allows only even token ids and never the same token twice in a row, so its
mask depends on the drafts before each row. Speculative output must equal target-only
output under it, obey it at every position (greedy and sampled), and the matcher must be
committed exactly the emitted tokens.
"""

from __future__ import annotations

from typing import Sequence

import pytest
import torch
from test_processors_exact import DEMO, DRAFTERS, executor

from draftflow.core.errors import RequestError
from draftflow.core.node import GrammarSpec, SamplingParams
from draftflow.core.registry import load_registry
from draftflow.plugins.dflash import plugin as dflash_plugin
from draftflow.plugins.verifier import plugin as verifier_plugin

VOCAB = 2048


def legal(previous: int | None, token: int) -> bool:
    return token % 2 == 0 and token != previous


class FakeMatcher:
    def __init__(self, log: list):
        self.history: list[int] = []
        self.log = log  # every allowed() call's drafts

    def allowed(self, drafts: Sequence[int]) -> torch.Tensor:  # [len(drafts) + 1, VOCAB] bool
        self.log.append(list(drafts))
        rows = torch.ones(len(drafts) + 1, VOCAB, dtype=torch.bool)
        previous = self.history[-1] if self.history else None
        for j in range(len(drafts) + 1):
            ids = torch.arange(VOCAB)
            rows[j] = (ids % 2 == 0) & (ids != (previous if previous is not None else -1))
            if j < len(drafts):
                if not legal(previous, drafts[j]):
                    break  # rows after a disallowed draft stay all True
                previous = drafts[j]
        return rows

    def walk(self, choose, max_tokens: int) -> list[int]:  # a drafter's row-by-row picks (GrammarMatcher.walk)
        picks = []
        for j in range(max_tokens):
            token = choose(j, self.allowed(picks)[-1])
            if token is None:
                break
            picks.append(token)
        return picks

    def commit(self, tokens: Sequence[int]) -> None:
        for tok in tokens:
            assert legal(self.history[-1] if self.history else None, tok), f"committed illegal token {tok}"
            self.history.append(tok)


class FakeCompiler:
    def __init__(self):
        self.matchers = []

    def compile(self, spec: GrammarSpec) -> FakeMatcher:
        if spec.source == "broken":
            raise RequestError("sampling field 'grammar' does not compile: broken; fix the schema")
        self.matchers.append(FakeMatcher([]))
        return self.matchers[-1]


@pytest.fixture
def compiler(monkeypatch):
    fake = FakeCompiler()
    seen_handles = []
    monkeypatch.setattr(verifier_plugin, "grammar_compiler", lambda handle: seen_handles.append(handle) or fake)
    # The DFlash node masks its drafts with its own matcher: the same fake grammar there too.
    monkeypatch.setattr(dflash_plugin, "grammar_compiler", lambda handle: seen_handles.append(handle) or fake)
    fake.handles = seen_handles
    return fake


@pytest.fixture(scope="module")
def prompt():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(DEMO / "target" / "tokenizer.json"))
    return tok.encode("def fibonacci(n):\n    if n < 2:\n        return n\n", add_special_tokens=False).ids


def run(ex, prompt, **settings):
    return ex.generate(prompt, SamplingParams(max_new_tokens=20, ignore_eos=True, **settings))


@pytest.mark.parametrize("drafter", ["lookup", "dflash"])
def test_greedy_output_with_grammar_equals_target_only_and_obeys_it(drafter, compiler, prompt):
    """Every token obeys the grammar, speculative == target-only, and the matcher saw exactly the output."""
    registry = load_registry()
    num_draft, nodes = DRAFTERS[drafter]
    grammar = GrammarSpec("regex", "even")
    spec = run(executor(registry, nodes, num_draft), prompt, grammar=grammar)
    ref = run(executor(registry, {}, 0), prompt, grammar=grammar)
    free = run(executor(registry, {}, 0), prompt)
    assert spec.token_ids == ref.token_ids != free.token_ids
    assert all(legal(p, t) for p, t in zip((None,) + spec.token_ids, spec.token_ids))
    assert compiler.matchers[0].history == list(spec.token_ids)
    assert compiler.handles[0].hf_tokenizer is not None  # compiled against the target's tokenizer
    if drafter == "dflash":  # (prompt lookup finds no n-gram to draft in this constrained output)
        assert sum(map(len, compiler.matchers[0].log)) > 0 and spec.stats["accepted"] > 0


def test_sampled_output_obeys_the_grammar_at_every_position(compiler, prompt):
    """At T > 0 rejection sampling against the masked target never emits a disallowed token."""
    num_draft, nodes = DRAFTERS["dflash"]
    ex = executor(load_registry(), nodes, num_draft)
    for seed in range(3):
        out = run(ex, prompt, grammar=GrammarSpec("regex", "even"), temperature=1.0, seed=seed, logprobs=1)
        assert all(legal(p, t) for p, t in zip((None,) + out.token_ids, out.token_ids))
        assert all(lp.logprob > float("-inf") for lp in out.logprobs)


def test_grammar_that_does_not_compile_is_a_request_error(compiler, prompt):
    """The compiler's RequestError reaches the caller of generate unchanged."""
    ex = executor(load_registry(), {}, 0)
    with pytest.raises(RequestError, match="sampling field 'grammar' does not compile"):
        run(ex, prompt, grammar=GrammarSpec("regex", "broken"))

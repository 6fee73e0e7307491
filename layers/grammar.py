"""Structured output: a grammar compiled to a token-level matcher that masks the target.

The engine is llguidance (the one llama.cpp and vLLM ship): no torch dependency, it
compiles JSON Schema, regex and Lark to a matcher whose per-token advance and rollback
are cheap (it keeps the parser's rows, so rolling back pops them), and it builds its
token table straight from a ``tokenizers`` tokenizer.

``GrammarCompiler`` holds the token table of one target (built once); ``compile`` turns a
request's ``GrammarSpec`` into a ``GrammarMatcher`` that lives as long as the request.
Per cycle the verifier calls ``allowed(drafts)``: the matcher is advanced over the drafts,
one mask row is read at every position, and the drafts are rolled back. Row ``j`` is
exactly the mask target-only decoding would use after ``drafts[:j]``, which is what makes
masked speculative output equal masked target-only output. After the verifier accepts,
``commit(emitted)`` advances the matcher for good.
"""

from __future__ import annotations

import json
import re
from typing import Callable, Sequence

import llguidance
import numpy as np
import torch

from draftflow.core.errors import RequestError

__all__ = ["GrammarCompiler", "GrammarMatcher"]

# Compact JSON unless the schema's "x-guidance" says otherwise: with free whitespace a model
# can emit blanks forever and never close the document inside max_new_tokens.
JSON_DEFAULTS = {"whitespace_flexible": False}

_FIXES = {
    "json_object": "this is a bug in draftflow's grammar layer; report it",
    "json_schema": "fix the schema (JSON Schema as JSON text; see docs/STRUCTURED.md for what is supported)",
    "regex": "fix the pattern (Rust regex syntax, matched against the whole output; no look-around or backreferences)",
    "lark": "fix the grammar (llguidance's Lark dialect; the start rule is `start`)",
}


def _fail(kind: str, detail: str) -> RequestError:
    return RequestError(f"sampling field 'grammar' ({kind}): {detail}; {_FIXES[kind]}")


def _one_line(message: str, kind: str) -> str:
    """llguidance's message as one line: its first line plus the lines that say what the error is."""
    lines = [line.strip() for line in message.splitlines() if line.strip()]
    if not lines:
        return "the engine cannot compile it"
    head = lines[0]
    where = re.match(r"at (\d+)\((\d+)\): ", head)
    if where:  # regex and schemas are wrapped in Lark text by llguidance: a position there means nothing
        rest = head[where.end():]
        head = f"line {where[1]}, column {where[2]}: {rest}" if kind == "lark" else rest
    extra = [line[len("error:"):].strip() for line in lines[1:] if line.startswith("error:")]
    return " ".join([head.rstrip(":") + (":" if extra else "")] + extra)


class GrammarCompiler:
    """Compiles grammars against one target's vocabulary.

    Args:
        hf_tokenizer: the target's ``tokenizers.Tokenizer`` (``TargetHandle.hf_tokenizer``).
        vocab_size: rows of the target's LM head; may exceed the tokenizer (padded
            embedding): ids past the tokenizer are never allowed.
        eos_ids: the target's end-of-sequence ids, the only tokens allowed once the
            grammar is complete.
    """

    def __init__(self, hf_tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
        self.eos_ids = tuple(int(e) for e in eos_ids if 0 <= e < vocab_size)
        if not self.eos_ids:
            raise RequestError("sampling field 'grammar': the target has no EOS token id in its vocabulary, so a "
                               "grammar could never end; set eos_token_id in the model's generation_config.json")
        data = json.loads(hf_tokenizer.to_str())
        data["padding"] = data["truncation"] = None  # llguidance tokenizes single strings
        self.vocab_size = vocab_size
        self.tokenizer = llguidance.LLTokenizer(json.dumps(data), eos_token=list(self.eos_ids))

    def compile(self, spec) -> GrammarMatcher:
        """Build the matcher for ``spec`` (a ``GrammarSpec``); RequestError naming the field when it cannot."""
        matcher = llguidance.LLMatcher(self.tokenizer, self._grammar_text(spec), log_level=0)
        if matcher.is_error():  # llguidance reports a grammar it cannot compile this way, never by raising
            raise _fail(spec.kind, _one_line(matcher.get_error(), spec.kind))
        return GrammarMatcher(matcher, spec.kind, self.tokenizer.vocab_size, self.vocab_size, self.eos_ids)

    def _grammar_text(self, spec) -> str:
        kind, source = spec.kind, spec.source
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_DEFAULTS)
        if not source.strip():
            raise _fail(kind, "the source is empty")
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(source)
        if kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(source)
        try:
            schema = json.loads(source)
        except json.JSONDecodeError as e:
            raise _fail(kind, f"the schema is not valid JSON ({e})") from None
        if not isinstance(schema, (dict, bool)):  # true / false are JSON Schemas too (any value / none)
            name = {list: "array", str: "string", type(None): "null"}.get(type(schema), "number")
            raise _fail(kind, f"the schema is a JSON {name}, not an object")
        if schema is False:
            raise _fail(kind, "the schema `false` allows no document")
        schema = {} if schema is True else schema
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_DEFAULTS)
        except ValueError as e:
            raise _fail(kind, _one_line(str(e), kind)) from None


class GrammarMatcher:
    """One request's position in its grammar: token masks for a window of drafts, and commits.

    The matcher only ever moves forward by ``commit`` (tokens the verifier emitted);
    ``allowed`` advances over drafts and rolls them back before returning.
    """

    def __init__(self, matcher, kind: str, tokenizer_size: int, vocab_size: int, eos_ids: tuple[int, ...]):
        self._matcher = matcher
        self._eos_ids = frozenset(eos_ids)
        self._vocab_size = vocab_size
        self._width = min(tokenizer_size, vocab_size)  # ids that can be allowed at all
        self._kind = kind
        self._words = (tokenizer_size + 31) // 32
        self._bits = np.zeros((1, self._words), dtype=np.int32)  # [rows, words], grown on demand
        # The last window's drafts and how many got a real mask row, so commit can check
        # emitted tokens against masks already computed.
        self._drafts: tuple[int, ...] = ()
        self._masks: torch.Tensor | None = None  # [real rows, V] bool
        self._eos_committed = False

    @property
    def done(self) -> bool:
        """True once the grammar is complete (only EOS is allowed) or EOS was committed."""
        return self._eos_committed or self._matcher.is_stopped()

    def allowed(self, drafts: Sequence[int]) -> torch.Tensor:  # [len(drafts)+1, V] bool, CPU
        """Row j: the tokens allowed after the committed tokens and ``drafts[:j]``.

        After the first draft the grammar forbids, the remaining rows are all True: the
        masked target rejects at that draft, so what follows it is never used.
        """
        drafts = tuple(int(d) for d in drafts)
        rows = len(drafts) + 1
        if self._bits.shape[0] < rows:
            self._bits = np.zeros((rows, self._words), dtype=np.int32)
        bits = self._bits[:rows]
        advanced = 0  # drafts consumed (and rolled back below)
        ended = False  # an allowed EOS draft: the output ends there
        for j in range(rows):
            self._fill(bits[j])
            if j == len(drafts) or not self._bit(bits[j], drafts[j]):
                break
            if drafts[j] in self._eos_ids:
                # Not consumed: llguidance does not count EOS on a finished grammar as a token, so a
                # rollback by the number of drafts would undo one token too many.
                ended = True
                break
            if not self._matcher.consume_token(drafts[j]):
                raise RuntimeError(f"grammar engine: draft {drafts[j]} passed the mask but was refused: "
                                   f"{self._matcher.get_error()}")
            advanced += 1
        if advanced and not self._matcher.rollback(advanced):
            raise RuntimeError(f"grammar engine: rolling back {advanced} drafts failed: {self._matcher.get_error()}")
        real = advanced + 1
        out = torch.empty(rows, self._vocab_size, dtype=torch.bool)
        flags = np.unpackbits(bits[:real].view(np.uint8), axis=1, bitorder="little")  # [real, 32 * words] 0/1
        out[:real, :self._width] = torch.from_numpy(flags[:, :self._width].view(np.bool_))
        out[:real, self._width:] = False  # ids past the tokenizer (a padded LM head)
        out[real:] = True
        if ended:  # after EOS a finished grammar allows only EOS again
            out[real:] = False
            out[real:, list(self._eos_ids)] = True
            real = rows
        self._drafts, self._masks = drafts[:real - 1], out[:real]
        return out

    def walk(self, choose: Callable[[int, torch.Tensor], int | None], max_tokens: int) -> list[int]:
        """Pick up to ``max_tokens`` tokens one at a time (a drafter masking its drafts), in O(picks) mask reads.

        ``choose(j, allowed)`` gets the tokens allowed after the committed tokens and the picks
        before ([V] bool, CPU) and returns an allowed token, or None to stop. The walk ends after an
        EOS pick. The matcher advances over the picks and rolls them back before returning, as
        ``allowed`` does; ``commit`` then reuses the masks read here.
        """
        if self._bits.shape[0] < max_tokens:
            self._bits = np.zeros((max_tokens, self._words), dtype=np.int32)
        picks: list[int] = []
        masks: list[torch.Tensor] = []  # [V] bool per pick
        advanced = 0
        try:
            for j in range(max_tokens):
                bits = self._bits[j]
                self._fill(bits)
                mask = torch.zeros(self._vocab_size, dtype=torch.bool)  # ids past the tokenizer stay False
                flags = np.unpackbits(bits.view(np.uint8), bitorder="little")[:self._width]
                mask[:self._width] = torch.from_numpy(flags.view(np.bool_))
                token = choose(j, mask)
                if token is None:
                    break
                if not self._bit(bits, token):
                    raise ValueError(f"GrammarMatcher.walk: pick {j} ({token}) is not an allowed token")
                picks.append(token)
                masks.append(mask)
                if token in self._eos_ids:  # not consumed, as in allowed()
                    break
                if not self._matcher.consume_token(token):
                    raise RuntimeError(f"grammar engine: pick {token} passed the mask but was refused: "
                                       f"{self._matcher.get_error()}")
                advanced += 1
        finally:
            if advanced and not self._matcher.rollback(advanced):
                raise RuntimeError(f"grammar engine: rolling back {advanced} picks failed: {self._matcher.get_error()}")
        self._drafts, self._masks = tuple(picks), (torch.stack(masks) if masks else None)
        return picks

    def commit(self, tokens: Sequence[int]) -> None:
        """Advance over tokens the verifier emitted; each must be allowed where it stands."""
        drafts, masks = self._drafts, self._masks
        self._drafts, self._masks = (), None
        on_window = masks is not None  # the emitted tokens so far equal the last window's drafts
        for i, token in enumerate(int(t) for t in tokens):
            if on_window and i < masks.shape[0]:  # reuse the mask allowed() already read here
                ok = 0 <= token < self._vocab_size and bool(masks[i, token])
            else:
                self._fill(self._bits[0])
                ok = self._bit(self._bits[0], token)
            if not ok or not self._matcher.consume_token(token):
                raise RuntimeError(f"grammar engine: committed token {token} (token {i} of this commit) is not "
                                   f"allowed by the grammar; the verifier emitted a masked-out token (a bug)")
            on_window = on_window and i < len(drafts) and token == drafts[i]
            self._eos_committed = self._eos_committed or token in self._eos_ids

    def _fill(self, row: np.ndarray) -> None:
        """Write the current position's mask into ``row`` ([words] int32)."""
        self._matcher.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)
        if self._matcher.is_error():
            raise RequestError(f"sampling field 'grammar' ({self._kind}): the grammar engine stopped: "
                               f"{_one_line(self._matcher.get_error(), self._kind)}; simplify the grammar")

    def _bit(self, row: np.ndarray, token: int) -> bool:
        return 0 <= token < self._width and bool((int(row[token >> 5]) >> (token & 31)) & 1)

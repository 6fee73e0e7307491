"""The OpenAI-compatible request and response shapes of `draftflow serve`.

``Api.parse`` turns a decoded JSON body into token ids, ``SamplingParams`` (logit
processors and a grammar included), stop strings and the choices wanted (n, best_of), or
raises ``ApiError`` naming the field; the response builders produce the objects the OpenAI
clients expect. Chat prompts are rendered with the model's own chat template
(core/chat_template.py). Field-by-field reference: docs/SERVING.md.
"""

from __future__ import annotations

import json
import math
import re
import time

import attrs

from draftflow.core.chat_template import ChatTemplate, TemplateError
from draftflow.core.errors import DraftflowError, RequestError
from draftflow.core.node import MAX_LOGPROBS, MAX_SEED, GrammarSpec, SamplingParams
from draftflow.core.openai_logprobs import choice_logprobs

MAX_STOP_STRINGS = 16
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Accepted only at their "off" value: draftflow has no implementation of them.
UNSUPPORTED = {"echo": (None, False), "suffix": (None, ""), "tools": (None, []), "functions": (None, [])}
# A SamplingParams field -> the request field it came from (for the `param` of a RequestError).
FIELD_PARAMS = {"max_new_tokens": "max_tokens", "stop_token_ids": "stop_token_ids", "grammar": "response_format"}
# Other ways to ask for structured output (vLLM's extras) -> GrammarSpec kind.
GUIDED = {"guided_json": "json_schema", "guided_regex": "regex", "guided_grammar": "lark"}


class ApiError(Exception):
    """Raised for a request the server refuses; carries the HTTP status and an OpenAI-style error object."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type_: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type_

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@attrs.frozen
class Parsed:
    """A validated completion or chat request."""

    kind: str  # "completion" | "chat"
    model: str
    prompt_ids: list[int]
    sampling: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    spec_stats: bool
    user: str | None = None  # OpenAI's end-user id; refines the fairness key
    n: int = 1  # choices returned
    best_of: int = 1  # candidates generated (completions); the n with the highest total logprob are returned
    logprobs: int | None = None  # alternatives per token shown in the response; None: no logprobs in it
    grammar_param: str | None = None  # the request field that asked for a grammar (errors name it)


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


def _schema_text(schema, where: str) -> str:
    """A JSON schema (an object, or true / false) as the JSON text a GrammarSpec carries."""
    if not isinstance(schema, (dict, bool)):
        raise ApiError(400, f"'{where}' must be a JSON schema object, got {json.dumps(schema)[:60]}",
                       param=where.split(".")[0])
    return json.dumps(schema)


def _get(body: dict, key: str, types, default=None, check=None, why: str = ""):
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise ApiError(400, f"'{key}' must be {why or types}, got {value!r}", param=key)
    if not isinstance(value, types) or (check is not None and not check(value)):
        raise ApiError(400, f"'{key}' must be {why}, got {value!r}", param=key)
    return value


class Api:
    """Validates requests against one engine and its limits."""

    def __init__(self, engine, model_names: tuple[str, ...], max_tokens_limit: int, default_max_tokens: int,
                 spec_stats_default: bool = False, max_n: int = 8):
        self.engine = engine
        self.max_n = max_n
        self.model_names = model_names
        self.max_tokens_limit = max_tokens_limit
        self.default_max_tokens = default_max_tokens
        self.spec_stats_default = spec_stats_default
        executor = engine.executor
        self.vocab_size = executor.handle.vocab_size or None
        self.chat_template = ChatTemplate.from_model_dir(executor.plan.nodes[executor.target].params.get("path"))

    def models(self) -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "draftflow",
                                            "max_model_len": self.engine.context_tokens} for name in self.model_names]}

    def parse(self, kind: str, body: dict) -> Parsed:
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise ApiError(400, f"'model' is required; this server serves {list(self.model_names)}", param="model")
        if model not in self.model_names:
            raise ApiError(404, f"the model {model!r} does not exist; this server serves {list(self.model_names)}",
                           param="model", code="model_not_found")
        for key, off in UNSUPPORTED.items():
            if key in body and (body[key] not in off or isinstance(body[key], bool) != isinstance(off[-1], bool)):
                allowed = " or ".join(json.dumps(v) for v in off if v is not None)
                raise ApiError(400, f"'{key}' is not supported by draftflow serve (only {allowed}, got "
                                    f"{json.dumps(body[key])[:80]}); leave it out", param=key)
        prompt_ids = self._chat_prompt(body) if kind == "chat" else self._completion_prompt(body)
        max_key = "max_completion_tokens" if kind == "chat" and body.get("max_completion_tokens") is not None else "max_tokens"
        default = 16 if kind == "completion" else self.default_max_tokens  # 16: the OpenAI completions default
        max_tokens = _get(body, max_key, int, default, lambda v: 1 <= v <= self.max_tokens_limit,
                          f"an integer in [1, {self.max_tokens_limit}]")
        context = self.engine.context_tokens
        if context is not None and len(prompt_ids) + max_tokens > context:
            raise ApiError(400, f"the prompt ({len(prompt_ids)} tokens) + {max_key} ({max_tokens}) exceeds the context "
                                f"of {context} tokens; shorten the prompt or lower {max_key}", param=max_key)
        top_k = _get(body, "top_k", int, 0, lambda v: v >= -1, "an integer >= -1 (-1 or 0 = off)")
        stop_ids = _get(body, "stop_token_ids", list, [], lambda v: all(self._is_token_id(t) for t in v),
                        f"a list of token ids in [0, {self.vocab_size})" if self.vocab_size else "a list of token ids")
        stream = _get(body, "stream", bool, False, None, "true or false")
        n, best_of = self._choices(kind, body, stream)
        shown = self._logprobs(kind, body)
        grammar, grammar_param = self._grammar(body)
        number = (int, float)
        fields = dict(
            temperature=_get(body, "temperature", number, 1.0, lambda v: _finite(v) and v >= 0, "a finite number >= 0"),
            top_p=_get(body, "top_p", number, 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]"),
            presence_penalty=_get(body, "presence_penalty", number, 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
            frequency_penalty=_get(body, "frequency_penalty", number, 0.0, lambda v: -2 <= v <= 2, "a number in [-2, 2]"),
            repetition_penalty=_get(body, "repetition_penalty", number, 1.0, lambda v: _finite(v) and 0 < v <= 100,
                                    "a number in (0, 100] (1 = off)"),
            min_p=_get(body, "min_p", number, 0.0, lambda v: 0 <= v <= 1, "a number in [0, 1] (0 = off)"))
        try:
            sampling = SamplingParams(
                **{k: float(v) for k, v in fields.items()}, top_k=max(0, top_k),
                seed=_get(body, "seed", int, None, lambda v: 0 <= v <= MAX_SEED, f"an integer in [0, {MAX_SEED}]"),
                max_new_tokens=max_tokens, stop_token_ids=tuple(stop_ids),
                ignore_eos=_get(body, "ignore_eos", bool, False, None, "true or false"),
                logit_bias=self._logit_bias(body), grammar=grammar,
                # best_of ranks candidates by their total logprob: the engine computes it even when not shown
                logprobs=shown if shown is not None or best_of == n else 0)
        except RequestError as exc:  # a range SamplingParams knows better than this parser
            field = re.search(r"field '(\w+)'", str(exc))
            name = field.group(1) if field else None
            raise ApiError(400, str(exc).replace("sampling field", "field"),
                           param=grammar_param if name == "grammar" else FIELD_PARAMS.get(name, name)) from None
        stop = body.get("stop")
        stop = [stop] if isinstance(stop, str) else (stop or [])
        if not isinstance(stop, list) or len(stop) > MAX_STOP_STRINGS or not all(isinstance(s, str) and s for s in stop):
            raise ApiError(400, f"'stop' must be a non-empty string or a list of at most {MAX_STOP_STRINGS} of them",
                           param="stop")
        options = _get(body, "stream_options", dict, {}, None, "an object")
        include_usage = options.get("include_usage", False)
        if not isinstance(include_usage, bool):
            raise ApiError(400, f"'stream_options.include_usage' must be true or false, got {include_usage!r}",
                           param="stream_options")
        return Parsed(kind, model, prompt_ids, sampling, tuple(stop), stream=stream, include_usage=include_usage,
                      spec_stats=_get(body, "return_spec_stats", bool, self.spec_stats_default, None, "true or false"),
                      user=_get(body, "user", str, None, None, "a string"), n=n, best_of=best_of, logprobs=shown,
                      grammar_param=grammar_param)

    def _choices(self, kind: str, body: dict, stream: bool) -> tuple[int, int]:
        """(n, best_of): choices returned and candidates generated, each run as its own request."""
        n = _get(body, "n", int, 1, lambda v: 1 <= v <= self.max_n,
                 f"an integer in [1, {self.max_n}] (draftflow serve --max-n)")
        if kind == "chat":
            _get(body, "best_of", int, 1, lambda v: v == 1, "1 (best_of is a completions field)")
            return n, n
        best_of = _get(body, "best_of", int, n, lambda v: n <= v <= self.max_n,
                       f"an integer in [n, {self.max_n}] (here n = {n}; draftflow serve --max-n)")
        if best_of > n and stream:
            raise ApiError(400, f"'best_of' ({best_of}) above 'n' ({n}) cannot be streamed: the best are known only "
                                "at the end; leave out stream or best_of", param="best_of")
        return n, best_of

    def _logprobs(self, kind: str, body: dict) -> int | None:
        """Alternatives per token to return: completions `logprobs: N`; chat `logprobs: true` + `top_logprobs: N`."""
        limit = f"an integer in [0, {MAX_LOGPROBS}]"
        if kind == "completion":
            if body.get("top_logprobs") is not None:
                raise ApiError(400, "'top_logprobs' is a chat field; completions take 'logprobs': N (alternatives per "
                                    "token)", param="top_logprobs")
            return _get(body, "logprobs", int, None, lambda v: 0 <= v <= MAX_LOGPROBS, limit)
        wanted = _get(body, "logprobs", bool, False, None, "true or false")
        top = _get(body, "top_logprobs", int, None, lambda v: 0 <= v <= MAX_LOGPROBS, limit)
        if top is not None and not wanted:
            raise ApiError(400, "'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        return (top or 0) if wanted else None

    def _logit_bias(self, body: dict) -> dict[int, float]:
        """OpenAI's `{"token id": bias}` (keys are strings in JSON) -> {id: bias}; ids must lie in the vocabulary."""
        bias = _get(body, "logit_bias", dict, {}, None, 'an object {"token id": bias}')
        out = {}
        for key, value in bias.items():
            tid = int(key) if isinstance(key, str) and key.isascii() and key.isdigit() else None
            if tid is None or not self._is_token_id(tid):
                where = f"[0, {self.vocab_size})" if self.vocab_size else "the vocabulary"
                raise ApiError(400, f"'logit_bias' key {key[:40]!r} is not a token id in {where}", param="logit_bias")
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) or abs(value) > 100:
                raise ApiError(400, f"'logit_bias' value for token {tid} must be a number in [-100, 100], got "
                                    f"{json.dumps(value)[:40]}", param="logit_bias")
            out[tid] = float(value)
        return out

    def _grammar(self, body: dict) -> tuple[GrammarSpec | None, str | None]:
        """`response_format` (text, json_object, json_schema) or a vLLM `guided_*` extra -> (GrammarSpec, its field)."""
        fmt = _get(body, "response_format", dict, None, None, 'an object {"type": "text" | "json_object" | "json_schema"}')
        asked = [k for k in GUIDED if body.get(k) is not None]
        if fmt is not None and fmt.get("type") != "text":
            asked.insert(0, "response_format")
        if len(asked) > 1:
            raise ApiError(400, f"ask for one output format, not {' and '.join(asked)}", param=asked[1])
        if not asked:
            return None, None
        key = asked[0]
        if key == "guided_json":
            value = body[key]
            if isinstance(value, str):
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise ApiError(400, f"'guided_json' is not valid JSON: {exc}", param=key) from None
            return GrammarSpec("json_schema", _schema_text(value, key)), key
        if key in GUIDED:
            if not isinstance(body[key], str) or not body[key]:
                raise ApiError(400, f"'{key}' must be a non-empty string", param=key)
            return GrammarSpec(GUIDED[key], body[key]), key
        if fmt.get("type") == "json_object":
            return GrammarSpec("json_object"), key
        if fmt.get("type") != "json_schema":
            raise ApiError(400, "'response_format.type' must be \"text\", \"json_object\" or \"json_schema\", got "
                                f"{json.dumps(fmt.get('type'))[:40]}", param=key)
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ApiError(400, "'response_format.json_schema' must be an object with a 'name' and a 'schema'", param=key)
        if not isinstance(spec.get("name", ""), str) or not isinstance(spec.get("strict", False), (bool, type(None))):
            raise ApiError(400, "'response_format.json_schema': 'name' must be a string and 'strict' true or false",
                           param=key)
        return GrammarSpec("json_schema", _schema_text(spec["schema"], "response_format.json_schema.schema")), key

    def _is_token_id(self, t) -> bool:
        return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < (self.vocab_size or math.inf)

    def _encode(self, text: str, param: str) -> list[int]:
        try:
            return self.engine.session.encode(text)
        except DraftflowError as exc:
            raise ApiError(400, str(exc).replace("pass --prompt-ids 1,2,3", "send token ids as the prompt"), param=param) from None

    def _completion_prompt(self, body: dict) -> list[int]:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str) and prompt:
            return self._encode(prompt, "prompt")
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            if not all(self._is_token_id(t) for t in prompt):
                raise ApiError(400, f"prompt token ids must lie in [0, {self.vocab_size})", param="prompt")
            return list(prompt)
        raise ApiError(400, "'prompt' must be a non-empty string or a non-empty list of token ids "
                            "(batches of several prompts are not supported; send one request each)", param="prompt")

    def _chat_prompt(self, body: dict) -> list[int]:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects", param="messages")
        clean = []
        for i, m in enumerate(messages):
            content = m.get("content") if isinstance(m, dict) else None
            if isinstance(content, list):  # content parts: only text is understood
                if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str) for p in content):
                    raise ApiError(400, f"messages[{i}].content: only text parts are supported", param="messages")
                content = "".join(p["text"] for p in content)
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(content, (str, type(None))):
                raise ApiError(400, f"messages[{i}] must be an object with a string 'role' and string 'content'",
                               param="messages")
            if m["role"] not in ROLES:
                raise ApiError(400, f"messages[{i}].role {m['role']!r} is not one of {', '.join(ROLES)}", param="messages")
            clean.append({**m, "content": content or ""})
        kwargs = _get(body, "chat_template_kwargs", dict, {}, None, "an object of template variables")
        if "messages" in kwargs:
            raise ApiError(400, "'chat_template_kwargs' may not set 'messages'; send them in the 'messages' field",
                           param="chat_template_kwargs")
        if self.chat_template is None:
            raise ApiError(400, "this model has no chat template (no 'chat_template' in tokenizer_config.json and no "
                                "chat_template.jinja next to it); use /v1/completions or add a template", param="messages")
        try:
            text = self.chat_template.render(clean, kwargs)
        except TemplateError as exc:
            raise ApiError(400, str(exc), param="messages") from None
        return self._encode(text, "messages")


# --- responses ----------------------------------------------------------------------------
def _usage(info: dict) -> dict:
    p, c = info["prompt_tokens"], info["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


@attrs.define
class Choice:
    """One choice of a response as the handler collects it from the worker's events."""

    index: int
    text: str = ""
    finish: str | None = None
    pieces: list | None = None  # openai_logprobs.TokenText of its tokens; None without logprobs


def response(parsed: Parsed, req_id: str, created: int, choices: list[Choice], info: dict) -> dict:
    """The whole (non-streamed) response object."""
    out_choices = []
    for c in sorted(choices, key=lambda c: c.index):
        logprobs = choice_logprobs(parsed.kind, c.pieces)
        if parsed.kind == "chat":
            out_choices.append({"index": c.index, "message": {"role": "assistant", "content": c.text},
                                "logprobs": logprobs, "finish_reason": c.finish})
        else:
            out_choices.append({"index": c.index, "text": c.text, "logprobs": logprobs, "finish_reason": c.finish})
    out = {"id": req_id, "object": "chat.completion" if parsed.kind == "chat" else "text_completion",
           "created": created, "model": parsed.model, "choices": out_choices, "usage": _usage(info)}
    if parsed.spec_stats:
        out["speculative_decoding"] = info["stats"]
    return out


def chunk(parsed: Parsed, req_id: str, created: int, index: int = 0, text: str | None = None, pieces=None,
          finish: str | None = None, info: dict | None = None, role: bool = False) -> dict:
    """One server-sent event payload. ``info`` with ``finish`` adds the stats; ``info`` alone is the usage chunk."""
    base = {"id": req_id, "created": created, "model": parsed.model}
    if info is not None and finish is None:
        return {**base, "object": _chunk_object(parsed), "choices": [], "usage": _usage(info)}
    logprobs = choice_logprobs(parsed.kind, pieces)
    if parsed.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
    out = {**base, "object": _chunk_object(parsed), "choices": [choice]}
    if finish is not None and info is not None and parsed.spec_stats:
        out["speculative_decoding"] = info["stats"]
    return out


def _chunk_object(parsed: Parsed) -> str:
    return "chat.completion.chunk" if parsed.kind == "chat" else "text_completion"


def now() -> int:
    return int(time.time())

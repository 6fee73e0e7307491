"""The OpenAI-compatible request and response shapes of `draftflow serve`.

``Api.parse`` turns a decoded JSON body into token ids, ``SamplingParams`` and stop
strings, or raises ``ApiError`` naming the field; the response builders produce the
objects the OpenAI clients expect. Chat prompts are rendered with the model's own Jinja
chat template (``tokenizer_config.json`` ``chat_template``, or ``chat_template.jinja``).
Field-by-field reference: docs/SERVING.md.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import attrs

from draftflow.core.errors import DraftflowError
from draftflow.core.node import MAX_SEED, SamplingParams

MAX_STOP_STRINGS = 16
ROLES = ("system", "developer", "user", "assistant", "tool", "function")
# Accepted only at their "off" value: draftflow has no implementation of them.
UNSUPPORTED = {"n": (None, 1), "best_of": (None, 1), "echo": (None, False), "suffix": (None, ""),
               "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "logit_bias": (None, {}),
               "logprobs": (None, False), "top_logprobs": (None, 0), "tools": (None, []), "functions": (None, []),
               "min_p": (None, 0, 0.0), "repetition_penalty": (None, 1, 1.0)}


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


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    # Hugging Face templates expect plain json.dumps, not Jinja's HTML-escaping tojson.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


def _raise_exception(message):
    raise ApiError(400, f"the chat template refused the messages: {message}", param="messages")


class ChatTemplate:
    """A model's chat template, compiled once in a sandboxed Jinja environment."""

    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        self.template = env.from_string(source)
        self.bos_token, self.eos_token = bos_token, eos_token

    @classmethod
    def from_model_dir(cls, path: str | None) -> ChatTemplate | None:
        """The template of a Hugging Face model directory, or None when it ships none."""
        if not path or not Path(path).is_dir():
            return None
        root = Path(path)
        config = {}
        if (root / "tokenizer_config.json").is_file():
            try:
                config = json.loads((root / "tokenizer_config.json").read_text(encoding="utf-8"))
            except (OSError, ValueError) as exc:
                raise DraftflowError(f"{root / 'tokenizer_config.json'}: unreadable JSON ({exc}); fix or remove the file") from None
        source = config.get("chat_template")
        if isinstance(source, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        if (root / "chat_template.jinja").is_file():
            source = (root / "chat_template.jinja").read_text(encoding="utf-8")
        if not source:
            return None

        def token(key):
            value = config.get(key) or ""
            return value.get("content", "") if isinstance(value, dict) else str(value)

        return cls(source, token("bos_token"), token("eos_token"))

    def render(self, messages: list[dict], kwargs: dict) -> str:
        """The prompt text. The request's ``chat_template_kwargs`` override our defaults (as in vLLM), so
        ``{"add_generation_prompt": false}`` continues the last message; ``messages`` comes only from its field."""
        variables = {"add_generation_prompt": True, "bos_token": self.bos_token, "eos_token": self.eos_token,
                     "tools": None, **kwargs, "messages": messages}
        try:
            return self.template.render(variables)
        except ApiError:  # raise_exception() in the template
            raise
        except Exception as exc:  # noqa: BLE001 - the template ran on the request's data: a request error
            raise ApiError(400, f"rendering the chat template failed: {type(exc).__name__}: {exc}",
                           param="messages") from None


def _finite(value) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an integer too large for a float
        return False


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
                 spec_stats_default: bool = False):
        self.engine = engine
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
        fmt = body.get("response_format")
        if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type", "text") != "text"):
            raise ApiError(400, "'response_format' other than {\"type\": \"text\"} is not supported", param="response_format")
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
        sampling = SamplingParams(
            temperature=float(_get(body, "temperature", (int, float), 1.0, lambda v: _finite(v) and v >= 0,
                                   "a finite number >= 0")),
            top_p=float(_get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")),
            top_k=max(0, top_k),
            seed=_get(body, "seed", int, None, lambda v: 0 <= v <= MAX_SEED, f"an integer in [0, {MAX_SEED}]"),
            max_new_tokens=max_tokens,
            stop_token_ids=tuple(stop_ids),
            ignore_eos=_get(body, "ignore_eos", bool, False, None, "true or false"))
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
        return Parsed(kind, model, prompt_ids, sampling, tuple(stop),
                      stream=_get(body, "stream", bool, False, None, "true or false"),
                      include_usage=include_usage,
                      spec_stats=_get(body, "return_spec_stats", bool, self.spec_stats_default, None, "true or false"),
                      user=_get(body, "user", str, None, None, "a string"))

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
        return self._encode(self.chat_template.render(clean, kwargs), "messages")


# --- responses ----------------------------------------------------------------------------
def _usage(info: dict) -> dict:
    p, c = info["prompt_tokens"], info["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def response(parsed: Parsed, req_id: str, created: int, text: str, finish: str, info: dict) -> dict:
    """The whole (non-streamed) response object."""
    if parsed.kind == "chat":
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None, "finish_reason": finish}
        obj = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        obj = "text_completion"
    out = {"id": req_id, "object": obj, "created": created, "model": parsed.model, "choices": [choice],
           "usage": _usage(info)}
    if parsed.spec_stats:
        out["speculative_decoding"] = info["stats"]
    return out


def chunk(parsed: Parsed, req_id: str, created: int, text: str | None = None, finish: str | None = None,
          info: dict | None = None, role: bool = False) -> dict:
    """One server-sent event payload. ``info`` with ``finish`` adds the stats; ``info`` alone is the usage chunk."""
    base = {"id": req_id, "created": created, "model": parsed.model}
    if info is not None and finish is None:
        return {**base, "object": _chunk_object(parsed), "choices": [], "usage": _usage(info)}
    if parsed.kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
    else:
        choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish}
    out = {**base, "object": _chunk_object(parsed), "choices": [choice]}
    if finish is not None and info is not None and parsed.spec_stats:
        out["speculative_decoding"] = info["stats"]
    return out


def _chunk_object(parsed: Parsed) -> str:
    return "chat.completion.chunk" if parsed.kind == "chat" else "text_completion"


def now() -> int:
    return int(time.time())

"""A model's own chat template (Jinja, from its Hugging Face directory), as `draftflow serve` renders it.

Chat prompts are rendered with ``tokenizer_config.json``'s ``chat_template``, or
``chat_template.jinja`` beside it, in a sandboxed Jinja environment; a template or request
error is a ``TemplateError`` (the server's 400 naming ``messages``).
"""

from __future__ import annotations

import json
from pathlib import Path

from draftflow.core.errors import DraftflowError


def _tojson(value, indent=None, ensure_ascii=False, separators=None, sort_keys=False):
    # Hugging Face templates expect plain json.dumps, not Jinja's HTML-escaping tojson.
    return json.dumps(value, indent=indent, ensure_ascii=ensure_ascii, separators=separators, sort_keys=sort_keys)


class TemplateError(Exception):
    """Raised when rendering fails on the request's messages (a request error: the server answers 400)."""


def _raise_exception(message):
    raise TemplateError(f"the chat template refused the messages: {message}")


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
        except TemplateError:  # raise_exception() in the template
            raise
        except Exception as exc:  # noqa: BLE001 - the template ran on the request's data: a request error
            raise TemplateError(f"rendering the chat template failed: {type(exc).__name__}: {exc}") from None

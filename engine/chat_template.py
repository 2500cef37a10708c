"""The GGUF's chat template (`tokenizer.chat_template`), rendered with jinja2 the way transformers renders it:
a sandboxed environment with trim_blocks and lstrip_blocks, the loop-control extension, `raise_exception`,
`strftime_now`, a `tojson` filter that does not escape HTML, and the special tokens (bos_token, eos_token, ...)
as variables."""

from __future__ import annotations

import json
import re
import uuid
from datetime import datetime
from typing import Any, Callable

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.errors import EngineError
from engine.gguf_file import GGUFFile

_SPECIAL_TOKEN_KEYS = {
    "bos_token": "tokenizer.ggml.bos_token_id",
    "eos_token": "tokenizer.ggml.eos_token_id",
    "unk_token": "tokenizer.ggml.unknown_token_id",
    "pad_token": "tokenizer.ggml.padding_token_id",
}


class _GenerationTag(Extension):
    """Accepts `{% generation %}...{% endgeneration %}` (used to mark assistant text for training masks)
    and renders its body unchanged."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent=None, separators=None, sort_keys: bool = False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class ChatTemplate:
    """A compiled chat template plus the special-token strings it may refer to."""

    def __init__(self, source: str, special_tokens: dict[str, str], model_name: str = "the model"):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationTag, loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        env.globals["strftime_now"] = _strftime_now
        try:
            self._template = env.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise EngineError(
                f"The chat template of {model_name} has a syntax error ({exc.message}, line {exc.lineno}); "
                "use plain completion instead of chat for this model."
            ) from None
        self.source = source
        self.special_tokens = special_tokens
        self._model_name = model_name

    @classmethod
    def from_gguf(cls, gguf: GGUFFile) -> ChatTemplate | None:
        """The file's template, or None if it has none."""
        source = gguf.get("tokenizer.chat_template")
        if not source:
            return None
        tokens = gguf.get("tokenizer.ggml.tokens") or []
        special = {}
        for name, key in _SPECIAL_TOKEN_KEYS.items():
            token_id = gguf.get(key)
            if token_id is not None and 0 <= token_id < len(tokens):
                special[name] = tokens[token_id]
        return cls(source, special, gguf.path.name)

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text for a conversation. Raises EngineError for malformed messages or when the template
        rejects the conversation (e.g. roles that do not alternate)."""
        check_messages(messages)
        try:
            return self._template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **{**self.special_tokens, **variables},
            )
        except jinja2.TemplateError as exc:
            raise EngineError(
                f"The chat template of {self._model_name} rejected this conversation: {exc}. "
                "Change the messages to fit what the model expects."
            ) from None

    def render_segments(
        self,
        messages: list[dict[str, Any]],
        is_control_text: Callable[[str], bool],
        add_generation_prompt: bool = True,
        **variables: Any,
    ) -> list[tuple[str, bool]]:
        """The rendered prompt as (text, from_content) pieces, so that the caller can encode what a message says as
        plain text and parse special tokens only where the template itself writes them.

        A message whose content holds control-token text (is_control_text) is rendered through a placeholder that
        is swapped back for its content afterwards; other messages render as they are, so a template that rewrites
        content (trims it, drops a reasoning block) still does so wherever no forged control token is at stake."""
        marker = f"\ue000{uuid.uuid4().hex}:"
        protected: dict[str, str] = {}
        shown = []
        for index, message in enumerate(messages):
            content = message.get("content") if isinstance(message, dict) else None
            if isinstance(content, str) and is_control_text(content):
                placeholder = f"{marker}{index}\ue001"
                protected[placeholder] = content
                message = {**message, "content": placeholder}
            shown.append(message)
        text = self.render(shown, add_generation_prompt, **variables)
        if not protected:
            return [(text, False)]
        pieces = re.split(f"({re.escape(marker)}\\d+\ue001)", text)
        return [(protected[p], True) if p in protected else (p, False) for p in pieces if p]


def check_messages(messages: Any) -> None:
    """Raise EngineError unless messages is a non-empty list of {"role": str, "content": str} dicts."""
    if not isinstance(messages, list) or not messages:
        raise EngineError("Messages must be a non-empty list of {'role': ..., 'content': ...} objects.")
    for index, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise EngineError(f"Message {index} must be an object with a text 'role' (system, user or assistant).")
        if not isinstance(message.get("content"), str):
            raise EngineError(f"Message {index} ({message['role']}) must have a text 'content'.")

"""Tool calls in the text a model writes, in the Hermes form that Qwen's chat templates ask for:

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"
_CALL = re.compile(re.escape(OPEN) + r"\s*(.*?)\s*(?:" + re.escape(CLOSE) + r"|$)", re.DOTALL)


@dataclass
class ToolCall:
    id: str
    name: str
    arguments: dict[str, Any]


def template_supports_tools(source: str) -> bool:
    """Whether a chat template renders tool definitions (it refers to the `tools` variable)."""
    return re.search(r"\btools\b", source) is not None


def new_call_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def parse_tool_calls(text: str, id_prefix: str = "call_") -> tuple[str, list[ToolCall]]:
    """(the text before the first tool call, the calls). A block that is not a JSON object with a name
    stays text: a model that writes the tag in prose has not called anything."""
    start = text.find(OPEN)
    if start < 0:
        return text, []
    calls = []
    for match in _CALL.finditer(text, start):
        try:
            body = json.loads(match.group(1))
        except json.JSONDecodeError:
            return text, []
        if not isinstance(body, dict) or not isinstance(body.get("name"), str):
            return text, []
        arguments = body.get("arguments") or {}
        if isinstance(arguments, str):  # some models write the arguments as a JSON string
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return text, []
        if not isinstance(arguments, dict):
            return text, []
        calls.append(ToolCall(new_call_id(id_prefix), body["name"], arguments))
    return text[:start].rstrip(), calls


class ToolCallHold:
    """Passes streamed text on until a tool call may be starting, then holds the rest back: the calls are
    sent whole once the answer is complete."""

    def __init__(self) -> None:
        self._text = ""
        self._sent = 0
        self._holding = False

    def feed(self, piece: str) -> str:
        """The part of the text so far that is safe to send now."""
        self._text += piece
        if self._holding:
            return ""
        found = self._text.find(OPEN, self._sent)
        if found >= 0:
            self._holding = True
            return self._release(found)
        keep = next((k for k in range(min(len(OPEN) - 1, len(self._text) - self._sent), 0, -1)
                     if self._text.endswith(OPEN[:k])), 0)
        return self._release(len(self._text) - keep)

    def _release(self, end: int) -> str:
        out, self._sent = self._text[self._sent : end], max(self._sent, end)
        return out

    def rest(self) -> str:
        """The text not sent yet: to send when the finished answer turned out to hold no tool call."""
        return self._release(len(self._text))

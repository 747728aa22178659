"""Tool calling on /v1/chat/completions: ``tools`` rendered by the chat template, replies parsed
for calls by the model family's parser (``model.tool_call_parser``, vLLM's
``--tool-call-parser``).

``tool_choice``: ``none`` (tools shown to the model, reply is text), ``auto`` (the default when
tools are given; needs a parser). ``required`` and a named function need the reply constrained
to a call (structured output), which this server does not have yet: 400.

Parsers turn reply text into content and calls, whole or streamed: ``feed(text)`` returns the
content that is safe to send and the calls completed so far; text that may open a call is held
back until it is known. ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Hermes, Qwen2.5, Qwen3 templates).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from tetri_server.api.errors import bad_param
from tetri_server.api.fields import Fields

MAX_TOOLS = 128
TOOL_PARSERS = ("hermes",)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": self.arguments}}


def check_tools(f: Fields) -> list[dict[str, Any]] | None:
    """``tools``, checked (None when absent or empty)."""
    tools = f.raw("tools")
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise bad_param("tools", "expected a list of tools")
    if len(tools) > MAX_TOOLS:
        raise bad_param("tools", f"at most {MAX_TOOLS} tools, got {len(tools)}")
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (not isinstance(tool, dict) or tool.get("type") != "function"
                or not isinstance(fn, dict) or not isinstance(fn.get("name"), str)):
            raise bad_param(f"tools[{i}]", "expected {'type': 'function', 'function': "
                                           "{'name': ..., 'parameters': {...}}}")
    return tools


def parse_tools(f: Fields, parser: str) -> tuple[list[dict[str, Any]] | None, bool]:
    """(tools for the chat template or None, whether replies are parsed for calls)."""
    tools = check_tools(f)
    if tools is None:
        f.require_absent("tool_choice", ("none", "auto"), "a tool_choice without tools")
        return None, False
    choice = f.raw("tool_choice")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return tools, False
    if choice != "auto":
        raise bad_param("tool_choice", "only 'none' and 'auto' are supported; 'required' and "
                                       "named functions need structured output")
    if parser == "none":
        raise bad_param("tool_choice", "'auto' needs a tool call parser: start the server "
                                       "with --tool-call-parser (model.tool_call_parser)")
    return tools, True


class HermesParser:
    """``<tool_call>{json}</tool_call>`` blocks; everything else is content."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""  # text not yet classified: inside a block, or maybe an opening tag
        self.calls: list[ToolCall] = []

    def feed(self, text: str, *, final: bool = False) -> tuple[str, list[ToolCall]]:
        """(content to send now, calls completed by this text)."""
        self._buf += text
        content, done = "", []
        while True:
            start = self._buf.find(self.OPEN)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buf, self.OPEN)
                content += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep:]
                break
            content += self._buf[:start]
            end = self._buf.find(self.CLOSE, start)
            if end < 0:
                self._buf = self._buf[start:]
                if final:  # an unterminated block: the model's text, as it wrote it
                    content, self._buf = content + self._buf, ""
                break
            call = self._call(self._buf[start + len(self.OPEN): end])
            if call is None:  # not a call after all: keep it as text
                content += self._buf[: end + len(self.CLOSE)][start:]
            else:
                done.append(call)
            self._buf = self._buf[end + len(self.CLOSE):]
        self.calls += done
        return content, done

    @staticmethod
    def _call(body: str) -> ToolCall | None:
        try:
            obj = json.loads(body)
        except ValueError:
            return None
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return None
        args = obj.get("arguments", obj.get("parameters", {}))
        text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
        return ToolCall(obj["name"], text, "chatcmpl-tool-" + uuid.uuid4().hex)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def make_parser(name: str) -> HermesParser:
    if name == "hermes":
        return HermesParser()
    raise ValueError(f"unknown tool call parser {name!r}")

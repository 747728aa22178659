"""Tool calling on /v1/chat/completions: ``tools`` rendered by the chat template, replies parsed
for calls by the model family's parser (``model.tool_call_parser``, vLLM's
``--tool-call-parser``).

``tool_choice``: ``none`` (tools shown to the model, reply is text), ``auto`` (the default when
tools are given; needs a parser), ``required`` and a named function
(``{"type": "function", "function": {"name": ...}}``): the reply is constrained to a call by a
JSON schema built from the tools' ``parameters`` (structured output, as vLLM does): for
``required`` a JSON array of ``{"name", "parameters"}`` (one item at most with
``parallel_tool_calls: false``), for a named function its arguments object. No parser is needed
for those; the reply is returned as ``tool_calls`` (``finish_reason`` ``tool_calls`` for
``required``, ``stop`` for a named function, as OpenAI and vLLM).

Parsers turn reply text into content and calls, whole or streamed: ``feed(text)`` returns the
content that is safe to send and the calls completed so far; text that may open a call is held
back until it is known. ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
(Hermes, Qwen2.5, Qwen3 templates). ``llama3_json``: a reply that is ``{"name": ...,
"parameters": {...}}`` (``;``-separated for several, optionally after ``<|python_tag|>``), as
Llama 3.1-3.3's templates ask. ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}]``
after any content.
"""

from __future__ import annotations

import dataclasses
import json
import secrets
import string
import uuid
from dataclasses import dataclass
from typing import Any

from tetri_server.api.errors import bad_param
from tetri_server.api.fields import Fields
from tetri_server.api.guides import schema_guide, sub_schemas
from tetri_server.messages import Guide

MAX_TOOLS = 128
TOOL_PARSERS = ("hermes", "llama3_json", "mistral")
_ALNUM = string.ascii_letters + string.digits


def new_call_id(parser: str = "") -> str:
    """A tool call's id: 9 letters and digits for the ``mistral`` parser (Mistral's chat
    templates refuse any other id when the call comes back in the next turn; vLLM's parser
    makes the same), else ``chatcmpl-tool-`` and 32 hex digits."""
    if parser == "mistral":
        return "".join(secrets.choice(_ALNUM) for _ in range(9))
    return "chatcmpl-tool-" + uuid.uuid4().hex


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


@dataclass(frozen=True)
class ForcedCall:
    """``tool_choice`` ``required`` (``name`` None) or a named function, and the guide that
    makes the reply a valid call."""

    name: str | None
    guide: Guide
    parser: str = ""  # the served tool call parser: the style of the calls' ids


@dataclass(frozen=True)
class ToolChoice:
    """What ``parse_tools`` decided: tools for the template, whether replies are parsed for
    calls (``auto``), and the forced call, if any."""

    tools: list[dict[str, Any]] | None = None
    parse_calls: bool = False
    forced: ForcedCall | None = None


def _parameters(tool: dict[str, Any]) -> Any:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}


DEF_KEYS = ("$defs", "definitions")


def _hoisted(tools: list[dict[str, Any]]) -> tuple[list[Any], dict[str, dict[str, Any]]]:
    """Each tool's parameters without their ``$defs`` / ``definitions``, and those gathered
    for the root of a schema that nests the parameters (their ``#/$defs/...`` refs then
    resolve there, as vLLM does); a name two tools define differently, or a ref to another
    part of a tool's schema, is a 400."""
    defs: dict[str, dict[str, Any]] = {k: {} for k in DEF_KEYS}
    params = []
    refs_ok = tuple(f"#/{k}/" for k in DEF_KEYS)
    for t in tools:
        p = _parameters(t)
        if isinstance(p, dict):
            for key in DEF_KEYS:
                if not isinstance(p.get(key) or {}, dict):
                    raise bad_param("tools", f"{key} of {t['function']['name']!r} must be an "
                                             "object of schemas")
                for name, sub in (p.get(key) or {}).items():
                    if defs[key].get(name, sub) != sub:
                        raise bad_param("tools", f"two tools define {key} {name!r} differently")
                    defs[key][name] = sub
            for where, node in sub_schemas(p):  # its own defs too, once
                ref = node.get("$ref")
                if isinstance(ref, str) and not ref.startswith(refs_ok):
                    raise bad_param("tools", f"the $ref {ref!r} at {where} of "
                                             f"{t['function']['name']!r} cannot be resolved "
                                             "with tool_choice 'required' (use $defs)")
            p = {k: v for k, v in p.items() if k not in DEF_KEYS}
        params.append(p)
    return params, {k: v for k, v in defs.items() if v}


def _forced(tools: list[dict[str, Any]], choice: Any, parallel: bool) -> ForcedCall:
    if choice == "required":
        params, defs = _hoisted(tools)
        items = [{"type": "object", "properties": {
                     "name": {"type": "string", "enum": [t["function"]["name"]]},
                     "parameters": p}, "required": ["name", "parameters"]}
                 for t, p in zip(tools, params, strict=True)]
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": items},
                                  **defs}
        if not parallel:
            schema["maxItems"] = 1
        return ForcedCall(None, schema_guide(schema, "tools"))
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str):
        raise bad_param("tool_choice", "expected 'none', 'auto', 'required' or "
                                       "{'type': 'function', 'function': {'name': ...}}")
    tool = next((t for t in tools if t["function"]["name"] == name), None)
    if tool is None:
        raise bad_param("tool_choice", f"no tool named {name!r} in tools")
    params = _parameters(tool)
    if not isinstance(params, dict):
        raise bad_param("tools", f"the parameters of {name!r} must be a JSON schema object")
    return ForcedCall(name, schema_guide(params, "tools"))


def parse_tools(f: Fields, parser: str) -> ToolChoice:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked."""
    tools = check_tools(f)
    if tools is None:
        f.require_absent("tool_choice", ("none", "auto"), "a tool_choice without tools")
        return ToolChoice()
    parallel = f.boolean("parallel_tool_calls", True)
    choice = f.raw("tool_choice")
    choice = "auto" if choice is None else choice
    if choice == "none":
        return ToolChoice(tools)
    if choice == "required" or isinstance(choice, dict):
        forced = dataclasses.replace(_forced(tools, choice, parallel), parser=parser)
        return ToolChoice(tools, forced=forced)
    if choice != "auto":
        raise bad_param("tool_choice", "expected 'none', 'auto', 'required' or "
                                       "{'type': 'function', 'function': {'name': ...}}")
    if parser == "none":
        raise bad_param("tool_choice", "'auto' needs a tool call parser: start the server "
                                       "with --tool-call-parser (model.tool_call_parser)")
    return ToolChoice(tools, parse_calls=True)


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
        return ToolCall(obj["name"], _arguments_json(args), new_call_id())


def _arguments_json(args: Any) -> str:
    """A call's ``arguments`` as the JSON text clients ``json.loads``: a string that already
    is JSON stays as the model wrote it, any other value (a plain string too, as in
    ``"arguments": "Oslo"``) is encoded, as vLLM's parsers do."""
    if isinstance(args, str):
        try:
            json.loads(args)
            return args
        except ValueError:
            pass
    return json.dumps(args, ensure_ascii=False)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ForcedCallParser:
    """The reply of a forced call: JSON shaped by its guide, parsed whole when it ends. A reply
    cut short (``max_tokens``) is returned as the text it is, with no call."""

    def __init__(self, forced: ForcedCall) -> None:
        self.forced = forced
        self._text = ""
        self.calls: list[ToolCall] = []

    def feed(self, text: str, *, final: bool = False) -> tuple[str, list[ToolCall]]:
        self._text += text
        if not final:
            return "", []
        try:
            obj = json.loads(self._text)
            if self.forced.name is not None:
                pairs = [(self.forced.name, obj)]
            else:
                pairs = [(c["name"], c["parameters"]) for c in obj]
        except (ValueError, TypeError, KeyError):
            return self._text, []
        self.calls = [ToolCall(name, json.dumps(args, ensure_ascii=False),
                               new_call_id(self.forced.parser)) for name, args in pairs]
        return "", self.calls


def _json_values(text: str) -> list[Any] | None:
    """The JSON values in ``text``, apart by ``;`` or whitespace (Llama 3's parallel calls; a
    ``;`` inside a string is the string's); None if anything else is there."""
    decoder, values, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or text[i] == ";"):
            i += 1
        if i == len(text):
            return values
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        values.append(value)


def _calls(objs: Any) -> list[ToolCall] | None:
    """``[{"name", "arguments" | "parameters"}, ...]`` as calls; None if that is not what it is."""
    if not isinstance(objs, list) or not objs:
        return None
    calls = [HermesParser._call(json.dumps(o)) if isinstance(o, dict) else None for o in objs]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


class Llama3JsonParser:
    """A reply that is a JSON call (or ``;``-separated calls), maybe after ``<|python_tag|>``:
    held whole until it ends, then returned as calls, or as text if it is not one. A reply that
    starts otherwise is content, streamed."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._mode = ""  # "", "call" (held until the end) or "text"
        self.calls: list[ToolCall] = []

    def feed(self, text: str, *, final: bool = False) -> tuple[str, list[ToolCall]]:
        self._buf += text
        if not self._mode:
            head = self._buf.lstrip()
            if head.startswith(("{", self.TAG)):
                self._mode = "call"
            elif head and not self.TAG.startswith(head):
                self._mode = "text"
        if self._mode == "text" or (final and self._mode != "call"):
            out, self._buf = self._buf, ""
            return out, []
        if not final:
            return "", []
        body = self._buf.strip().removeprefix(self.TAG)
        calls = _calls(_json_values(body) or [])
        if calls is None:
            out, self._buf = self._buf, ""
            return out, []
        self.calls, self._buf = calls, ""
        return "", calls


class MistralParser:
    """Content, then ``[TOOL_CALLS]`` and a JSON array of calls (held until the reply ends)."""

    TAG = "[TOOL_CALLS]"

    def __init__(self) -> None:
        self._buf = ""
        self._in_calls = False
        self.calls: list[ToolCall] = []

    def feed(self, text: str, *, final: bool = False) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content = ""
        if not self._in_calls:
            start = self._buf.find(self.TAG)
            if start < 0:
                keep = 0 if final else _partial_suffix(self._buf, self.TAG)
                cut = len(self._buf) - keep
                content, self._buf = self._buf[:cut], self._buf[cut:]
                return content, []
            content, self._buf = self._buf[:start], self._buf[start + len(self.TAG):]
            self._in_calls = True
        if not final:
            return content, []
        try:
            calls = _calls(json.loads(self._buf))
        except ValueError:
            calls = None
        if calls is None:  # not calls after all: the model's text, as it wrote it
            out, self._buf = content + self.TAG + self._buf, ""
            return out, []
        calls = [dataclasses.replace(c, id=new_call_id("mistral")) for c in calls]
        self.calls, self._buf = calls, ""
        return content, calls


ReplyParser = HermesParser | Llama3JsonParser | MistralParser


def make_parser(name: str) -> ReplyParser:
    if name == "hermes":
        return HermesParser()
    if name == "llama3_json":
        return Llama3JsonParser()
    if name == "mistral":
        return MistralParser()
    raise ValueError(f"unknown tool call parser {name!r}")

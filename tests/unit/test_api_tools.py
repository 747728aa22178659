"""Tool calling: tools reach the chat template, replies are parsed for Hermes-style calls
(whole and streamed, in any split), and the real `openai` client reads the calls; a scripted
reply stands in for a model that calls tools (a random model never does)."""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Iterator

import openai
import pytest

from tests.unit.test_api_double import MODEL_NAME
from tests.unit.test_api_support import ApiHarness, double
from tetri_server.api.app import default_served_model
from tetri_server.api.tools import HermesParser

pytest_plugins = ["tests.unit.test_api_support"]

CALL = '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
REPLY = "Let me check. " + CALL + "\n" + CALL.replace("Oslo", "Bergen")
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}}}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": PARAMS}}]
MSG = [{"role": "user", "content": "Weather in Oslo and Bergen?"}]


def test_parser_whole_and_in_any_split_agree() -> None:
    content, calls = HermesParser().feed(REPLY, final=True)
    assert content == "Let me check. \n"
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("weather", {"city": "Bergen"})]
    for step in (1, 2, 5, 13):
        p, sent, got = HermesParser(), "", []
        for i in range(0, len(REPLY), step):
            text, done = p.feed(REPLY[i : i + step], final=i + step >= len(REPLY))
            assert "tool_call>" not in text  # tags never leak into content
            sent += text
            got += done
        assert sent == content and [c.arguments for c in got] == [c.arguments for c in calls]


def test_parser_keeps_what_is_not_a_call_as_text() -> None:
    bad = "a <tool_call>not json</tool_call> b <tool_"
    assert HermesParser().feed(bad, final=True) == (bad, [])
    text, calls = HermesParser().feed("x <tool_call>{\"name\": \"f\"", final=True)
    assert (text, calls) == ("x <tool_call>{\"name\": \"f\"", [])  # unterminated at the end


def test_call_arguments_are_always_json_text() -> None:
    """Regression: a model that wrote ``"arguments": "Oslo"`` got the string passed through as
    the arguments, which clients ``json.loads`` (openai agents, LangChain): an error. vLLM
    encodes it; a string that already is JSON stays as written."""
    [call] = HermesParser().feed(
        '<tool_call>{"name": "weather", "arguments": "Oslo"}</tool_call>', final=True)[1]
    assert json.loads(call.arguments) == "Oslo"
    [call] = HermesParser().feed(
        '<tool_call>{"name": "weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}'
        '</tool_call>', final=True)[1]
    assert call.arguments == '{"city": "Oslo"}'


@contextlib.contextmanager
def scripted(api: ApiHarness, text: str) -> Iterator[None]:
    backend = double(api)
    backend.script = backend.tokenizer.encode(text, add_special_tokens=False)
    try:
        yield
    finally:
        backend.script = None


@pytest.fixture(scope="module")
def hermes(api: ApiHarness) -> openai.OpenAI:
    served = dataclasses.replace(default_served_model(api.backend), tool_call_parser="hermes")
    return openai.OpenAI(base_url=api.serve(served=served) + "/v1", api_key="x", max_retries=0)


def test_tool_calls_whole_and_streamed_through_the_openai_client(
    api: ApiHarness, hermes: openai.OpenAI
) -> None:
    with scripted(api, REPLY):
        out = hermes.chat.completions.create(model=MODEL_NAME, messages=MSG, tools=TOOLS)
        chunks = list(hermes.chat.completions.create(model=MODEL_NAME, messages=MSG,
                                                     tools=TOOLS, stream=True))
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check. \n"
    calls = choice.message.tool_calls
    assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == [
        ("weather", {"city": "Oslo"}), ("weather", {"city": "Bergen"})]
    assert len({c.id for c in calls}) == 2 and all(c.type == "function" for c in calls)
    text = "".join(c.choices[0].delta.content or "" for c in chunks)
    streamed = [t for c in chunks for t in (c.choices[0].delta.tool_calls or [])]
    assert text == "Let me check. \n"
    assert [(t.index, t.function.name, json.loads(t.function.arguments)) for t in streamed] == [
        (0, "weather", {"city": "Oslo"}), (1, "weather", {"city": "Bergen"})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_tool_choice_none_and_no_parser_leave_the_reply_as_text(
    api: ApiHarness, hermes: openai.OpenAI
) -> None:
    plain = openai.OpenAI(base_url=api.base_url + "/v1", api_key="x", max_retries=0)
    with scripted(api, REPLY):
        for client in (hermes, plain):
            out = client.chat.completions.create(model=MODEL_NAME, messages=MSG, tools=TOOLS,
                                                 tool_choice="none")
            assert out.choices[0].message.content == REPLY and not out.choices[0].message.tool_calls
            assert out.choices[0].finish_reason == "stop"
        with pytest.raises(openai.BadRequestError, match="tool call parser"):
            plain.chat.completions.create(model=MODEL_NAME, messages=MSG, tools=TOOLS)


def test_tools_reach_the_chat_template() -> None:
    from tests.unit.test_api_vllm import _RecordingTokenizer
    from tetri_server.api.fields import Fields
    from tetri_server.api.prompts import PromptLimits, chat_prompt

    tok = _RecordingTokenizer()
    chat_prompt(Fields({"messages": MSG}), tok, PromptLimits(10, 100, 10_000), TOOLS)
    assert tok.calls[0][1]["tools"] == TOOLS


def _fed(parser, text: str, rng) -> tuple[str, list]:  # noqa: ANN001
    """Feed ``text`` in random pieces; (all content sent, all calls)."""
    sent, calls, i = "", [], 0
    while i < len(text):
        j = min(len(text), i + rng.randint(1, 7))
        out, done = parser.feed(text[i:j], final=j == len(text))
        sent, calls, i = sent + out, calls + done, j
    return sent, calls


@pytest.mark.parametrize(("name", "reply", "content", "calls"), [
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Paris"}}', "",
     [("get_weather", {"city": "Paris"})]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", '
     '"parameters": {"x": 1}}', "", [("a", {}), ("b", {"x": 1})]),
    ("llama3_json", "The weather is {fine} today.", "The weather is {fine} today.", []),
    # a ";" inside an argument is the argument's (review of session 62: the call came back
    # as text, no tool_calls)
    ("llama3_json", '{"name": "sql", "parameters": {"q": "SELECT 1; SELECT 2"}}', "",
     [("sql", {"q": "SELECT 1; SELECT 2"})]),
    ("llama3_json", '{"not": "a call"}', '{"not": "a call"}', []),
    ("mistral", 'Sure. [TOOL_CALLS][{"name": "f", "arguments": {"q": "x"}}]', "Sure. ",
     [("f", {"q": "x"})]),
    ("mistral", "No tools [TOOLS] here", "No tools [TOOLS] here", []),
    ("mistral", "[TOOL_CALLS]not json", "[TOOL_CALLS]not json", []),
])
def test_family_parsers_whole_and_streamed(name, reply, content, calls):
    import random

    from tetri_server.api.tools import make_parser

    for seed in range(5):
        sent, got = _fed(make_parser(name), reply, random.Random(seed))
        assert sent == content
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.fixture(scope="module")
def tagged(model_dir, tmp_path_factory) -> Iterator[ApiHarness]:  # noqa: ANN001
    """The tiny model with a tokenizer whose call tags are special tokens, as Qwen2.5's
    ``<tool_call>`` and Mistral's ``[TOOL_CALLS]`` are."""
    import shutil

    from transformers import AutoTokenizer

    from tests.unit.test_api_double import make_engine_backend

    path = tmp_path_factory.mktemp("tagged") / "model"
    shutil.copytree(model_dir("llama", "tiny"), path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.add_special_tokens({"additional_special_tokens": [
        "<tool_call>", "</tool_call>", "[TOOL_CALLS]"]})
    tok.save_pretrained(path)
    harness = ApiHarness(make_engine_backend, path)
    yield harness
    harness.close()


@pytest.mark.parametrize(("name", "reply"), [
    ("hermes", CALL), ("mistral", '[TOOL_CALLS][{"name": "weather", "arguments": '
                                  '{"city": "Oslo"}}]')])
def test_calls_whose_tags_are_special_tokens_are_parsed(tagged: ApiHarness, name: str,
                                                         reply: str) -> None:
    """Regression: the reply was decoded without special tokens, so the parser never saw the
    tag: the call came back as the message's text, with no ``tool_calls``."""
    served = dataclasses.replace(default_served_model(tagged.backend), tool_call_parser=name)
    client = openai.OpenAI(base_url=tagged.serve(served=served) + "/v1", api_key="x",
                           max_retries=0)
    backend = double(tagged)
    backend.script = backend.tokenizer.encode(reply, add_special_tokens=False)
    assert len(backend.script) < len(backend.tokenizer.encode(
        reply.replace("[TOOL_CALLS]", "[TOOL CALLS]").replace("tool_call", "tool call"),
        add_special_tokens=False))  # each tag is one (special) token here
    out = client.chat.completions.create(model=MODEL_NAME, messages=MSG, tools=TOOLS)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    assert [(c.function.name, json.loads(c.function.arguments))
            for c in choice.message.tool_calls] == [("weather", {"city": "Oslo"})]


def _matches(guide_spec: str, text: str) -> bool:
    """Whether the compiled JSON schema ``guide_spec`` accepts ``text`` whole (a character
    vocabulary: one token per printable ASCII character)."""
    import xgrammar as xgr

    from tetri_server.engine.grammar import Grammars
    from tetri_server.messages import Guide

    vocab = [chr(i) for i in range(32, 127)] + ["</s>"]
    compiled = Grammars(None, len(vocab), (len(vocab) - 1,), vocab=vocab).compile(
        Guide("json_schema", guide_spec))
    m = xgr.GrammarMatcher(compiled)
    return all(m.accept_token(vocab.index(ch)) for ch in text) and m.is_completed()


def test_required_tool_calls_keep_each_tools_defs() -> None:
    """Regression (review of session 62): with tool_choice "required" each tool's parameters
    were nested in one array schema, so their ``#/$defs/...`` refs (pydantic's nested models)
    pointed at its root, which has none: a 400 "does not compile" for a tool a named choice
    took. The defs now go to the root; two tools defining one name differently are a 400."""
    from tetri_server.api.errors import APIError
    from tetri_server.api.tools import _forced

    loc = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    params = {"type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}},
              "required": ["loc"], "$defs": {"Loc": loc}}
    tools = [{"type": "function", "function": {"name": "w", "parameters": params}}]
    spec = _forced(tools, "required", True).guide.spec
    assert _matches(spec, '[{"name": "w", "parameters": {"loc": {"city": "Oslo"}}}]')
    assert not _matches(spec, '[{"name": "w", "parameters": {"loc": 5}}]')
    other = {**params, "$defs": {"Loc": {"type": "integer"}}}
    clash = [*tools, {"type": "function", "function": {"name": "v", "parameters": other}}]
    with pytest.raises(APIError, match="differently"):
        _forced(clash, "required", True)
    inner = {"type": "object", "properties": {"a": {"$ref": "#/properties/b"}}}
    in_def = {**params, "$defs": {"Loc": {"$ref": "#/properties/loc"}}}
    for bad in (inner, in_def):  # a ref the array's root cannot resolve, in a def too
        with pytest.raises(APIError, match="cannot be resolved"):
            _forced([{"type": "function", "function": {"name": "u", "parameters": bad}}],
                    "required", True)
    with pytest.raises(APIError, match="must be an object"):  # was an AttributeError: a 500
        _forced([{"type": "function", "function": {"name": "u", "parameters": {
            "type": "object", "$defs": ["x"]}}}], "required", True)


@pytest.mark.parametrize("schema", [
    {"type": "array", "items": {"type": "integer"}, "uniqueItems": True},
    {"type": "object", "properties": {"a": {"not": {"const": 0}}}},
    {"type": "object", "if": {"required": ["a"]}, "then": {"required": ["b"]}},
    {"type": "object", "dependentSchemas": {"a": {"required": ["b"]}}},
    {"allOf": [{"type": "integer"}, {"minimum": 5}]},
    {"$ref": "https://example.com/s.json"},
    # beside $ref / anyOf / oneOf / allOf the compiler drops every other keyword
    {"$ref": "#/$defs/A", "maximum": 3, "$defs": {"A": {"type": "integer"}}},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "anyOf": [{"required": ["a"]}]},
    {"type": "number", "multipleOf": 0.5},
    {"type": "integer", "multipleOf": 3, "minimum": 0},
    {"type": "array", "items": {"type": "integer"}, "maxContains": 1},
    {"type": "object", "dependencies": {"a": ["b"]}},
    # review of session 63: each accepted, then part of it ignored by xgrammar 0.2.9
    {"type": "string", "pattern": "^[0-9]+$", "maxLength": 5},  # "1234567" passed
    {"type": "string", "format": "uri", "minLength": 1, "maxLength": 2083},  # pydantic HttpUrl
    {"type": "string", "format": "email", "pattern": "^[a-z]+$"},  # "abc@x.com" passed
    {"type": "array", "items": {"type": "string"}, "contains": {"const": "x"}},  # [] passed
    {"type": "object", "required": ["b"]},  # {} passed
    {"type": "integer", "minimum": 5, "enum": [1, 7]},  # 1 passed
    {"type": "string", "enum": ["a", 1]},  # 1 passed
    {"type": "string", "enum": ["ab", "abcdef"], "maxLength": 5},  # "abcdef" breaks it
    # review of session 64: the client's pattern was run here on the listed values: this
    # one backtracks for hours (a thread of the parsing pool each)
    {"type": "string", "enum": ["a" * 40 + "!"], "pattern": "^(a+)+$"},
])
def test_a_schema_keyword_the_grammar_would_not_enforce_is_a_400(schema) -> None:
    """Regression (review of session 62): the compiler accepted these and did not enforce
    them, so a reply breaking the schema came back with HTTP 200 ([1, 1] for uniqueItems)."""
    from tetri_server.api.errors import APIError
    from tetri_server.api.guides import schema_guide
    from tetri_server.api.tools import _forced

    with pytest.raises(APIError, match="cannot enforce"):
        schema_guide(schema, "response_format")
    with pytest.raises(APIError, match="cannot enforce"):
        _forced([{"type": "function", "function": {"name": "f", "parameters": schema}}],
                {"type": "function", "function": {"name": "f"}}, True)
    # a property named like a keyword, allOf of one schema, pydantic's Optional and a $ref
    # with a description are fine
    schema_guide({"type": "object", "properties": {
        "not": {"type": "integer"},
        "x": {"anyOf": [{"type": "integer"}, {"type": "null"}], "default": None, "title": "X"},
        "y": {"$ref": "#/$defs/A", "description": "a y"},
        "z": {"allOf": [{"$ref": "#/$defs/A"}], "default": 1},
        "n": {"type": "integer", "multipleOf": 3},
        "e": {"enum": ["a", "b"], "title": "E", "type": "string"},  # pydantic's Enum
        "c": {"const": 3, "type": "integer"}, "s": {"type": "string", "maxLength": 9},
        "p": {"type": "string", "pattern": "^a"}}, "required": ["e", "p"],
        "$defs": {"A": {"type": "integer"}}},
        "response_format")


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "unevaluatedProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}},
     "unevaluatedProperties": {"type": "string"}},
    {"type": "array", "prefixItems": [{"type": "integer"}], "unevaluatedItems": {"type": "string"}},
    {"enum": ["a", "b"], "maxLength": 5, "type": "string"},  # pydantic Literal, max_length=5
    {"type": "integer", "enum": [3, 7], "minimum": 1, "exclusiveMaximum": 8},
])
def test_a_schema_the_grammar_enforces_is_served(schema) -> None:  # type: ignore[no-untyped-def]
    """Regression (review of session 63): refused with a 400, though xgrammar 0.2.9 enforces
    unevaluatedProperties / unevaluatedItems, and listed values that all meet their sibling
    constraints leave nothing unenforced; vLLM serves each."""
    from tetri_server.api.guides import schema_guide

    schema_guide(schema, "response_format")


def test_mistral_calls_get_ids_its_chat_template_takes_back() -> None:
    """Regression (review of session 63): calls had ``chatcmpl-tool-`` ids of 46 characters;
    Mistral's chat templates (v0.3, Nemo) raise "Tool call IDs should be alphanumeric strings
    with length 9!" on them, so the turn that sends a call's result back was a 400. The
    mistral parser's calls, parsed or forced, get 9 letters and digits, as vLLM's do."""
    import re

    from tetri_server.api.tools import ForcedCall, ForcedCallParser, make_parser
    from tetri_server.messages import Guide

    _, [call] = make_parser("mistral").feed(
        '[TOOL_CALLS][{"name": "f", "arguments": {"q": "x"}}]', final=True)
    forced = ForcedCallParser(ForcedCall("f", Guide("json_object"), parser="mistral"))
    _, [named] = forced.feed('{"q": "x"}', final=True)
    for c in (call, named):
        assert re.fullmatch(r"[A-Za-z0-9]{9}", c.id), c.id
    _, [other] = make_parser("hermes").feed(CALL, final=True)
    assert other.id.startswith("chatcmpl-tool-")


def test_a_streamed_forced_call_opens_its_stream_at_the_first_token(api: ApiHarness) -> None:
    """Regression (review of session 63): the forced call's reply is held whole, and nothing,
    not even the headers, went out before the last token: a proxy's idle timeout could cut a
    long call, and the first chunk came as late as the whole reply."""
    import time

    from tests.unit.test_api_support import slow_generation

    double(api)
    client = openai.OpenAI(base_url=api.base_url + "/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "function": {"name": "many", "parameters": {
        "type": "object", "properties": {"n": {"type": "array", "items": {"type": "integer"},
                                               "minItems": 24}}, "required": ["n"]}}}]
    with slow_generation(api, 0.02):
        t0 = time.monotonic()
        stream = client.chat.completions.create(
            model=MODEL_NAME, messages=MSG, tools=tools, stream=True, max_tokens=100,
            tool_choice={"type": "function", "function": {"name": "many"}})
        chunks = iter(stream)
        first = next(chunks)
        first_s = time.monotonic() - t0
        rest = list(chunks)
        total_s = time.monotonic() - t0
    assert first.choices[0].delta.role == "assistant"
    assert first_s < total_s / 3, (first_s, total_s)
    assert rest[-1].choices[0].finish_reason is not None

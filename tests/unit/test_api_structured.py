"""Structured output and forced tool calls through the real `openai` client: whatever a
random-weight model would write, the reply is valid JSON matching the schema (a regex, one of
the choices, a valid call). Bounded schemas (string lengths, integer ranges, enums) make every
reply end within max_tokens, whatever the seed; ``json_object`` is unbounded, so there every
reply that ended is checked and some must end. Also run against the real cluster, coupled and
disaggregated (tests/integration/test_api_structured_cluster.py)."""

from __future__ import annotations

import json
import math
import re
from typing import Any, Literal

import openai
import pydantic
import pytest

from tests.unit.test_api_double import MODEL_NAME
from tests.unit.test_api_support import ApiHarness, raw_request
from tetri_server.api.fields import Fields
from tetri_server.api.tools import ForcedCall, ForcedCallParser, parse_tools
from tetri_server.messages import Guide

pytest_plugins = ["tests.unit.test_api_support"]

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"enum": ["Oslo", "Bergen"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 6}, "maxItems": 2},
    "ok": {"type": "boolean"}}, "required": ["name", "age", "city", "tags", "ok"]}
WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 10},
    "days": {"type": "integer", "minimum": 1, "maximum": 14}}, "required": ["city", "days"]}
TIME = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "time", "parameters": TIME}}]
MSG = [{"role": "user", "content": "Tell me about a person, as JSON."}]
FORMAT = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}
REGEX = r"[a-z]{3}-[0-9]{2,4}"


def conforms(value: Any, schema: dict[str, Any]) -> bool:
    """The JSON-schema subset used here, written out (strict: no extra properties)."""
    if "enum" in schema:
        return value in schema["enum"]
    kind = schema["type"]
    if kind == "object":
        props = schema["properties"]
        return (isinstance(value, dict) and set(schema["required"]) <= set(value) <= set(props)
                and all(conforms(v, props[k]) for k, v in value.items()))
    if kind == "array":
        return (isinstance(value, list) and len(value) <= schema.get("maxItems", len(value))
                and all(conforms(v, schema["items"]) for v in value))
    if kind == "string":
        return isinstance(value, str) and len(value) <= schema.get("maxLength", len(value))
    if kind == "integer":
        return (isinstance(value, int) and not isinstance(value, bool)
                and schema.get("minimum", value) <= value <= schema.get("maximum", value))
    return kind == "boolean" and isinstance(value, bool)


def test_schema_checker_can_fail() -> None:
    good = {"name": "a", "age": 3, "city": "Oslo", "tags": [], "ok": True}
    assert conforms(good, SCHEMA)
    for bad in ({**good, "age": 151}, {**good, "city": "Paris"}, {**good, "extra": 1},
                {**good, "ok": 1}, {k: v for k, v in good.items() if k != "name"}):
        assert not conforms(bad, SCHEMA)


@pytest.fixture(scope="module")
def client(api: ApiHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.base_url + "/v1", api_key="x", max_retries=0,
                         timeout=120)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_json_schema_replies_match_the_schema(client: openai.OpenAI, temperature: float) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=MSG, response_format=FORMAT,
                                         temperature=temperature, seed=7, n=3, max_tokens=200)
    for choice in out.choices:
        assert choice.finish_reason == "stop", choice.message.content
        assert conforms(json.loads(choice.message.content), SCHEMA), choice.message.content


def test_json_schema_streamed(client: openai.OpenAI) -> None:
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=MSG, response_format=FORMAT, temperature=1.0, seed=3,
        max_tokens=200, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert conforms(json.loads(text), SCHEMA), text


def test_json_object_replies_are_objects(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MSG, response_format={"type": "json_object"},
        temperature=1.0, seed=11, n=16, max_tokens=160)
    ended = [c.message.content for c in out.choices if c.finish_reason == "stop"]
    assert ended, [c.message.content for c in out.choices]
    assert all(isinstance(json.loads(text), dict) for text in ended), ended


def test_regex_choice_and_structured_outputs_on_completions(client: openai.OpenAI) -> None:
    for body in ({"guided_regex": REGEX}, {"structured_outputs": {"regex": REGEX}}):
        out = client.completions.create(model=MODEL_NAME, prompt="An id:", temperature=1.0,
                                        seed=5, n=4, max_tokens=40, extra_body=body)
        for choice in out.choices:
            assert choice.finish_reason == "stop" and re.fullmatch(REGEX, choice.text), body
    out = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=40,
                                         extra_body={"guided_choice": ["yes", "no", "maybe"]})
    assert out.choices[0].message.content in ("yes", "no", "maybe")


def test_a_guided_replys_logprobs_give_no_probability_to_what_the_grammar_forbids(
        client: openai.OpenAI) -> None:
    """Regression (review of session 63): logprobs came from the logits before the grammar's
    mask, so the chosen "no" looked less likely than tokens that could never be drawn ('box',
    ' prof'), and was missing from its own top 5. vLLM applies the mask first; a forbidden
    token's logprob is its floor, -9999 (JSON has no infinity)."""
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=MSG, max_tokens=4, temperature=0, logprobs=True,
        top_logprobs=5, extra_body={"guided_choice": ["yes", "no"]})
    [first, *_] = out.choices[0].logprobs.content
    tops = first.top_logprobs
    assert tops[0].token == first.token and tops[0].logprob == first.logprob
    alive = [t for t in tops if t.logprob > -9999]
    assert {t.token for t in alive} <= {"yes", "no", "y", "n", "ye"}, tops
    assert sum(math.exp(t.logprob) for t in alive) == pytest.approx(1.0, abs=1e-3)


def test_guided_json_extension(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(model=MODEL_NAME, messages=MSG, max_tokens=200,
                                         temperature=1.0, seed=2,
                                         extra_body={"guided_json": json.dumps(SCHEMA)})
    assert conforms(json.loads(out.choices[0].message.content), SCHEMA)


class Person(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=12)
    age: int = pydantic.Field(ge=0, le=150)
    city: Literal["Oslo", "Bergen"]


def test_openai_parse_helper_gets_its_pydantic_model(client: openai.OpenAI) -> None:
    """``chat.completions.parse`` sends a strict json_schema and validates the reply."""
    out = client.chat.completions.parse(model=MODEL_NAME, messages=MSG, response_format=Person,
                                        temperature=1.0, seed=1, max_tokens=200)
    person = out.choices[0].message.parsed
    assert isinstance(person, Person) and person.city in ("Oslo", "Bergen")


def _check_calls(calls: Any, names: set[str]) -> None:
    assert calls and len({c.id for c in calls}) == len(calls)
    for c in calls:
        assert c.type == "function" and c.function.name in names
        params = WEATHER if c.function.name == "weather" else TIME
        assert conforms(json.loads(c.function.arguments), params), c.function.arguments


@pytest.mark.parametrize("stream", [False, True])
def test_tool_choice_required_always_calls(client: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": MSG, "tools": TOOLS,
                              "tool_choice": "required", "parallel_tool_calls": False,
                              "temperature": 1.0, "seed": 4, "max_tokens": 120}
    if not stream:
        out = client.chat.completions.create(**kwargs)
        choice = out.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        _check_calls(choice.message.tool_calls, {"weather", "time"})
        assert len(choice.message.tool_calls) == 1  # parallel_tool_calls: false
        return
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    calls = [t for c in chunks for t in c.choices[0].delta.tool_calls or []]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not "".join(c.choices[0].delta.content or "" for c in chunks)
    _check_calls(calls, {"weather", "time"})


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_calls_that_function(client: openai.OpenAI, stream: bool) -> None:
    kwargs: dict[str, Any] = {"model": MODEL_NAME, "messages": MSG, "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "weather"}},
                              "temperature": 1.0, "seed": 9, "max_tokens": 120}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.finish_reason == "stop"  # OpenAI's and vLLM's for a named function
        _check_calls(choice.message.tool_calls, {"weather"})
        return
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    _check_calls([t for c in chunks for t in c.choices[0].delta.tool_calls or []], {"weather"})


@pytest.mark.parametrize("stream", [False, True])
def test_chat_echo_stays_out_of_a_forced_call(client: openai.OpenAI, stream: bool) -> None:
    """Regression: chat ``echo`` put the final assistant message in front of the new text
    before the tool-call parser read it, so a forced call's JSON no longer parsed: a 200 whose
    content was the echo and the call's raw JSON, with no call. vLLM parses the new text alone
    and opens the content with the echo."""
    msgs = [*MSG, {"role": "assistant", "content": "Sure. "}]
    kwargs: dict[str, Any] = {
        "model": MODEL_NAME, "messages": msgs, "tools": TOOLS,
        "tool_choice": {"type": "function", "function": {"name": "weather"}},
        "temperature": 1.0, "seed": 9, "max_tokens": 120,
        "extra_body": {"echo": True, "continue_final_message": True,
                       "add_generation_prompt": False}}
    if not stream:
        choice = client.chat.completions.create(**kwargs).choices[0]
        assert choice.message.content == "Sure. "
        _check_calls(choice.message.tool_calls, {"weather"})
        return
    chunks = [c for c in client.chat.completions.create(**kwargs, stream=True) if c.choices]
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Sure. "
    _check_calls([t for c in chunks for t in c.choices[0].delta.tool_calls or []], {"weather"})


def _error(api: ApiHarness, body: dict[str, Any], path: str = "/v1/chat/completions"
           ) -> tuple[int, str, str]:
    reply = raw_request(api.base_url, "POST", path,
                        {"model": MODEL_NAME, "max_tokens": 20, "messages": MSG, **body})
    err = reply.json().get("error", {}) if reply.status != 200 else {}
    return reply.status, err.get("param"), err.get("message", "")


@pytest.mark.parametrize("stream", [False, True])
def test_a_schema_that_does_not_compile_is_a_400_naming_response_format(
    api: ApiHarness, stream: bool
) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}
    status, param, message = _error(api, {"response_format": bad, "stream": stream})
    assert (status, param) == (400, "response_format") and "foo" in message, message
    status, param, message = _error(api, {"guided_regex": "(ab", "stream": stream})
    assert (status, param) == (400, "guided_regex") and "regex" in message, message


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}},
     "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
    ({"guided_decoding_backend": "outlines", "guided_regex": "a"}, "guided_decoding_backend"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format"),
])
def test_bad_structured_fields_are_400s_naming_the_field(
    api: ApiHarness, body: dict[str, Any], param: str
) -> None:
    status, got, message = _error(api, body)
    assert (status, got) == (400, param), message


def test_required_schema_allows_parallel_calls_unless_turned_off() -> None:
    def schema(**body: Any) -> dict[str, Any]:
        forced = parse_tools(Fields({"tools": TOOLS, "tool_choice": "required", **body}),
                             "none").forced
        assert forced is not None and forced.name is None
        return json.loads(forced.guide.spec)

    assert schema()["minItems"] == 1 and "maxItems" not in schema()
    assert schema(parallel_tool_calls=False)["maxItems"] == 1
    items = schema()["items"]["anyOf"]
    assert [i["properties"]["name"]["enum"] for i in items] == [["weather"], ["time"]]
    assert items[1]["properties"]["parameters"] == TIME


def test_forced_call_parser_two_calls_and_a_cut_off_reply() -> None:
    forced = ForcedCall(None, Guide("json_object"))
    reply = '[{"name": "time", "parameters": {"zone": "UTC"}}, {"name": "weather", ' \
            '"parameters": {"city": "Oslo", "days": 2}}]'
    parser = ForcedCallParser(forced)
    assert parser.feed(reply[:20]) == ("", [])  # nothing until the reply ends
    content, calls = parser.feed(reply[20:], final=True)
    assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("time", {"zone": "UTC"}), ("weather", {"city": "Oslo", "days": 2})]
    cut = reply[:30]
    assert ForcedCallParser(forced).feed(cut, final=True) == (cut, [])

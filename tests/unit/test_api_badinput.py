"""Bad input: every case is a 4xx with an OpenAI-style error body that names the problem, and
the server keeps serving afterwards."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.test_api_double import MAX_MODEL_LEN
from tests.unit.test_api_support import ApiHarness, metric, raw_request

pytest_plugins = ["tests.unit.test_api_support"]

C, CHAT = "/v1/completions", "/v1/chat/completions"
OK: dict[str, Any] = {"prompt": "hi", "max_tokens": 2}
MSG: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]


def c(**kw: Any) -> dict[str, Any]:
    return {**OK, **kw}


def chat(**kw: Any) -> dict[str, Any]:
    return {"messages": MSG, "max_tokens": 2, **kw}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}

# (case id, path, body, status, the field named in error.param (None: none), text in message)
CASES: list[tuple[str, str, Any, int, str | None, str]] = [
    ("invalid-json", C, b'{"prompt": ', 400, None, "not valid JSON"),
    ("not-an-object", C, b"[1, 2]", 400, None, "must be a JSON object"),
    ("invalid-utf8", C, b'{"prompt": "\xff\xfe"}', 400, None, "not valid UTF-8"),
    ("empty-body", C, b"", 400, None, "empty"),
    ("nan-literal", C, b'{"prompt": "hi", "temperature": NaN}', 400, None, "not valid JSON"),
    ("missing-prompt", C, {"max_tokens": 2}, 400, "prompt", "required"),
    ("prompt-number", C, c(prompt=123), 400, "prompt", "expected a string"),
    ("prompt-empty-list", C, c(prompt=[]), 400, "prompt", "the prompt is empty"),
    ("prompt-batch-too-large", C, c(prompt=["a"] * 65), 400, "prompt", "at most 64 prompts"),
    # a lone surrogate (valid JSON) the tokenizer raises on: was a 500
    ("prompt-lone-surrogate", C, c(prompt="a\ud800b"), 400, "prompt", "lone UTF-16 surrogate"),
    ("chat-lone-surrogate", CHAT, chat(messages=[{"role": "user", "content": "a\ud800"}]),
     400, "messages[0].content", "lone UTF-16 surrogate"),
    # ... and msgspec raises on, sending it to a worker: it ended the channel's writer (the
    # worker got no message again); as a key too
    ("guide-lone-surrogate", C, c(guided_regex="a\udc00"), 400, "guided_regex",
     "lone UTF-16 surrogate"),
    ("schema-key-lone-surrogate", CHAT, chat(response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {
            "type": "object", "properties": {"\ud800": {"type": "string"}}}}}),
     400, "response_format.json_schema.schema.properties", "lone UTF-16 surrogate"),
    ("stop-lone-surrogate", C, c(stop=["ok", "\udfff"]), 400, "stop[1]",
     "lone UTF-16 surrogate"),
    ("prompt-batch-bad-member", C, c(prompt=["a", 5]), 400, "prompt[1]", "expected a string"),
    ("prompt-batch-times-n", C, c(prompt=["a"] * 40, n=2), 400, "n", "more than 64 choices"),
    ("prompt-id-out-of-vocab", C, c(prompt=[5, 999999]), 400, "prompt", "outside the vocab"),
    ("prompt-id-not-int", C, c(prompt=[[5, "x"]]), 400, "prompt", "not an integer"),
    ("prompt-too-long", C, c(prompt=[7] * (MAX_MODEL_LEN + 5)), 400, "prompt", "context"),
    ("max-tokens-zero", C, c(max_tokens=0), 400, "max_tokens", ">= 1"),
    ("max-tokens-negative", C, c(max_tokens=-5), 400, "max_tokens", ">= 1"),
    ("max-tokens-string", C, c(max_tokens="10"), 400, "max_tokens", "integer"),
    ("max-tokens-float", C, c(max_tokens=2.5), 400, "max_tokens", "integer"),
    ("max-tokens-too-large", C, c(max_tokens=10_000), 400, "max_tokens", "exceed the context"),
    ("temperature-negative", C, c(temperature=-0.5), 400, "temperature", ">= 0"),
    ("temperature-string", C, c(temperature="hot"), 400, "temperature", "number"),
    ("top-p-zero", C, c(top_p=0), 400, "top_p", "> 0"),
    ("top-p-above-one", C, c(top_p=1.5), 400, "top_p", "<= 1"),
    ("top-k-negative", C, c(top_k=-2), 400, "top_k", ">= -1"),
    ("n-above-cap", C, c(n=17), 400, "n", "<= 16"),
    ("n-zero", C, c(n=0), 400, "n", ">= 1"),
    ("best-of-not-n", C, c(n=2, best_of=3), 400, "best_of", "best_of = n"),
    ("echo-logprobs-above-cap", C, c(echo=True, logprobs=21), 400, "logprobs", "<= 20"),
    ("max-tokens-zero-echo-negative", C, c(echo=True, max_tokens=-1), 400, "max_tokens", ">= 0"),
    ("prompt-logprobs-above-cap", C, c(prompt_logprobs=21), 400, "prompt_logprobs", "<= 20"),
    ("prompt-logprobs-all-vocab", C, c(prompt_logprobs=-1), 400, "prompt_logprobs", ">= 0"),
    ("logprobs-above-cap", C, c(logprobs=21), 400, "logprobs", "<= 20"),
    ("logprobs-bool", C, c(logprobs=True), 400, "logprobs", "integer"),
    ("stop-empty-string", C, c(stop=[""]), 400, "stop", "must not be empty"),
    ("stop-number", C, c(stop=123), 400, "stop", "list of strings"),
    ("unknown-model", C, c(model="gpt-17"), 404, "model", "does not exist"),
    ("stream-string", C, c(stream="yes"), 400, "stream", "true or false"),
    (
        "stream-options-no-stream",
        C,
        c(stream_options={"include_usage": True}),
        400,
        "stream_options",
        "only allowed when stream",
    ),
    ("seed-string", C, c(seed="abc"), 400, "seed", "integer"),
    ("min-tokens-above-max", C, c(min_tokens=5), 400, "min_tokens", "<= 2"),
    ("ignore-eos-string", C, c(ignore_eos="true"), 400, "ignore_eos", "true or false"),
    ("frequency-penalty-range", C, c(frequency_penalty=2.5), 400, "frequency_penalty", "<= 2"),
    ("presence-penalty-string", C, c(presence_penalty="x"), 400, "presence_penalty", "number"),
    ("repetition-penalty-zero", C, c(repetition_penalty=0), 400, "repetition_penalty", "> 0"),
    ("min-p-above-one", C, c(min_p=1.5), 400, "min_p", "<= 1"),
    ("logit-bias-out-of-vocab", C, c(logit_bias={"999999": 5}), 400, "logit_bias", "outside"),
    ("logit-bias-not-id", C, c(logit_bias={"abc": 5}), 400, "logit_bias", "not a token id"),
    ("logit-bias-not-number", C, c(logit_bias={"5": "x"}), 400, "logit_bias.5", "a number"),
    ("max-tokens-fraction", C, c(max_tokens=5.5), 400, "max_tokens", "an integer"),
    (
        "logit-bias-too-many",
        C,
        c(logit_bias={str(i): 1 for i in range(1025)}),
        400,
        "logit_bias",
        "at most 1024",
    ),
    ("guided-json-not-object", C, c(guided_json=3), 400, "guided_json", "JSON object"),
    ("guided-whitespace", C, c(guided_whitespace_pattern=" "), 400, "guided_whitespace_pattern",
     "not supported"),
    ("skip-special-string", C, c(skip_special_tokens="no"), 400, "skip_special_tokens", "true"),
    ("stop-token-id-negative", C, c(stop_token_ids=[-1]), 400, "stop_token_ids", "outside"),
    ("chat-missing-messages", CHAT, {"max_tokens": 2}, 400, "messages", "required"),
    ("chat-empty-messages", CHAT, chat(messages=[]), 400, "messages", "non-empty"),
    (
        "chat-bad-role",
        CHAT,
        chat(messages=[{"role": "wizard", "content": "x"}]),
        400,
        "messages[0].role",
        "'wizard' is not one of",
    ),
    (
        "chat-content-number",
        CHAT,
        chat(messages=[{"role": "user", "content": 5}]),
        400,
        "messages[0].content",
        "expected a string",
    ),
    ("chat-message-not-object", CHAT, chat(messages=["hi"]), 400, "messages[0]", "object"),
    (
        "chat-image-part",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
        400,
        "messages[0].content[0]",
        "only parts of type 'text'",
    ),
    ("chat-top-logprobs-cap", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs",
     "<= 20"),
    ("chat-prompt-logprobs", CHAT, chat(prompt_logprobs=1), 400, "prompt_logprobs",
     "only supported on /v1/completions"),
    ("chat-top-logprobs-alone", CHAT, chat(top_logprobs=2), 400, "top_logprobs", "logprobs=true"),
    ("chat-tool-choice", CHAT, chat(tool_choice="required"), 400, "tool_choice", "not supported"),
    (
        "chat-template-kwargs-reserved",
        CHAT,
        chat(chat_template_kwargs={"chat_template": "{{ 'x' }}"}),
        400,
        "chat_template_kwargs.chat_template",
        "set by the server",
    ),
    (
        "chat-max-completion-zero",
        CHAT,
        chat(max_completion_tokens=0),
        400,
        "max_completion_tokens",
        ">= 1",
    ),
    (
        "chat-user-content-null",
        CHAT,
        chat(messages=[{"role": "user", "content": None}]),
        400,
        "messages[0].content",
        "required",
    ),
    ("chat-unknown-model", CHAT, chat(model="nope"), 404, "model", "does not exist"),
    ("chat-tools-malformed", CHAT, chat(tools=[{"type": "function"}]), 400, "tools[0]",
     "expected"),
    ("chat-tools-too-many", CHAT, chat(tools=[TOOL] * 129), 400, "tools", "at most 128"),
    ("chat-tools-auto-no-parser", CHAT, chat(tools=[TOOL]), 400, "tool_choice", "parser"),
    ("chat-tools-choice-unknown", CHAT, chat(tools=[TOOL], tool_choice="sometimes"), 400,
     "tool_choice", "expected"),
    ("chat-tools-named-missing", CHAT,
     chat(tools=[TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), 400,
     "tool_choice", "no tool named"),
]


@pytest.mark.parametrize(
    ("path", "body", "status", "param", "text"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_bad_input_is_a_clear_4xx(
    api: ApiHarness, path: str, body: Any, status: int, param: str | None, text: str
) -> None:
    reply = raw_request(api.base_url, "POST", path, body)
    assert reply.status == status, reply.body
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    assert err["param"] == param
    assert text in err["message"]


def test_table_is_big_enough() -> None:
    assert len(CASES) >= 30


def test_routing_errors_are_json(api: ApiHarness) -> None:
    reply = raw_request(api.base_url, "GET", C)
    assert reply.status == 405 and "POST" in reply.headers["allow"]
    assert "Method Not Allowed" in reply.json()["error"]["message"]
    reply = raw_request(api.base_url, "POST", "/v1/nothing-here", OK)
    assert reply.status == 404 and reply.json()["error"]["message"].startswith("Not Found")


def test_still_serving_after_bad_input(api: ApiHarness) -> None:
    for _, path, body, *_ in CASES:
        raw_request(api.base_url, "POST", path, body)
    reply = raw_request(api.base_url, "POST", C, c(unknown_field={"x": 1}, user="u1"))
    assert reply.status == 200, reply.body
    assert reply.json()["usage"]["completion_tokens"] >= 1
    reply = raw_request(
        api.base_url,
        "POST",
        CHAT,
        chat(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
    )
    assert reply.status == 200, reply.body
    assert metric(api.base_url, "tetri_request_errors_total", kind="invalid_parameter") >= 1

"""The API through the real ``openai`` client: completions and chat, streaming and not, usage,
stop strings, logprobs, and greedy output equal to transformers ``generate()``."""

from __future__ import annotations

import openai
import pytest

from tests.conftest import hf_greedy
from tests.unit.test_api_double import MODEL_NAME
from tests.unit.test_api_support import ApiHarness, raw_request

pytest_plugins = ["tests.unit.test_api_support"]

N = 12  # output tokens per request: short, the CPU is shared


@pytest.fixture(scope="module")
def client(api: ApiHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0)


def _text_of(api: ApiHarness, ids: list[int]) -> str:
    return api.backend.tokenizer.decode(ids, skip_special_tokens=True)


def _chat_ids(api: ApiHarness, messages: list[dict[str, str]]) -> list[int]:
    tok = api.backend.tokenizer
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def test_models_and_health(api: ApiHarness, client: openai.OpenAI) -> None:
    assert [m.id for m in client.models.list().data] == [MODEL_NAME]
    assert raw_request(api.base_url, "GET", "/health").status == 200


def test_completion_greedy_equals_transformers(
    api: ApiHarness, client: openai.OpenAI, model_dir
) -> None:
    prompt_ids = [5, 17, 300, 42, 1000, 77, 8]
    text_prompt = "The quick brown fox"
    text_ids = api.backend.tokenizer.encode(text_prompt)
    ref = hf_greedy(model_dir("llama", "tiny"), [prompt_ids, text_ids], N)
    for prompt, want in ((prompt_ids, ref[0]), (text_prompt, ref[1])):
        out = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=N,
            temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert out.choices[0].text == _text_of(api, want)
        assert out.choices[0].finish_reason == "length"
        assert out.usage.prompt_tokens == len(text_ids if prompt == text_prompt else prompt_ids)
        assert out.usage.completion_tokens == N
        assert out.usage.total_tokens == out.usage.prompt_tokens + N
        assert out.object == "text_completion" and out.model == MODEL_NAME


def test_completion_stream_equals_whole_and_reports_usage(client: openai.OpenAI) -> None:
    kwargs = dict(
        model=MODEL_NAME,
        prompt="Once upon a time",
        max_tokens=N,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == N
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    body = chunks[:-1]
    assert "".join(c.choices[0].text for c in body) == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in body][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in body[:-1])
    assert len({c.id for c in chunks}) == 1


def test_chat_greedy_equals_transformers(api: ApiHarness, client: openai.OpenAI, model_dir) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi é!"}]
    ids = _chat_ids(api, messages)
    want = _text_of(api, hf_greedy(model_dir("llama", "tiny"), [ids], N)[0])
    out = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_completion_tokens=N,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == want
    assert out.usage.prompt_tokens == len(ids) and out.usage.completion_tokens == N
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=messages,
        max_tokens=N,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].usage.completion_tokens == N and chunks[-1].object == "chat.completion.chunk"


def test_stop_string_cuts_text_and_finishes(client: openai.OpenAI) -> None:
    base = dict(
        model=MODEL_NAME,
        prompt="In the beginning",
        temperature=0,
        max_tokens=24,
        extra_body={"ignore_eos": True},
    )
    full = client.completions.create(**base).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    want = full[: full.index(stop)]
    out = client.completions.create(**base, stop=[stop, "never-generated-xyz"])
    assert out.choices[0].text == want and out.choices[0].finish_reason == "stop"
    assert out.usage.completion_tokens < 24
    chunks = list(client.completions.create(**base, stop=stop, stream=True))
    assert "".join(c.choices[0].text for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_stream_sends_a_chunk_for_every_token_even_with_its_text_held_back(
    api: ApiHarness, client: openai.OpenAI, model_dir
) -> None:
    """Like vLLM, a token whose text is held back (the start of a stop string here) still
    gets its chunk, with empty text: streaming clients count chunks as tokens (``vllm bench
    serve``'s ITL, our bench client) and would otherwise see two tokens as one gap."""
    prompt = "Once upon a time"
    want = hf_greedy(model_dir("llama", "tiny"), [api.backend.tokenizer.encode(prompt)], N)[0]
    full = _text_of(api, want)
    head = _text_of(api, want[:4])
    assert full.startswith(head) and head.strip()
    stop = head + "\x00never"  # held back from token 4 on, never completed
    chunks = list(client.completions.create(
        model=MODEL_NAME, prompt=prompt, temperature=0, max_tokens=N, stop=[stop],
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    body = chunks[:-1]
    assert "".join(c.choices[0].text for c in body) == full
    assert len(body) == N == chunks[-1].usage.completion_tokens
    assert any(c.choices[0].text == "" for c in body)
    chat = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": prompt}], temperature=0,
        max_tokens=N, stream=True, extra_body={"ignore_eos": True}))
    assert len([c for c in chat if c.choices[0].delta.role is None]) == N


def test_logprobs(client: openai.OpenAI) -> None:
    out = client.completions.create(
        model=MODEL_NAME,
        prompt="Hello",
        max_tokens=5,
        temperature=0,
        logprobs=1,
        extra_body={"ignore_eos": True},
    )
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == 5
    assert all(x <= 0 for x in lp.token_logprobs)
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hello"}],
        max_tokens=5,
        temperature=0,
        logprobs=True,
        extra_body={"ignore_eos": True},
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 5 and all(c.logprob <= 0 for c in content)


def test_seeded_sampling_repeats_and_default_max_tokens_fills_context(
    api: ApiHarness, client: openai.OpenAI
) -> None:
    kw = dict(
        model=MODEL_NAME,
        prompt="Tell me",
        max_tokens=8,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        extra_body={"ignore_eos": True, "top_k": 50},
    )
    assert client.completions.create(**kw).choices[0].text == (
        client.completions.create(**kw).choices[0].text
    )
    room = 6
    prompt = list(range(10, 10 + api.backend.max_model_len - room))
    out = client.completions.create(
        model=MODEL_NAME, prompt=prompt, temperature=0, extra_body={"ignore_eos": True}
    )
    assert out.usage.completion_tokens == room and out.choices[0].finish_reason == "length"


def test_long_sampled_stream_equals_whole(client: openai.OpenAI) -> None:
    """A random model emits tokens holding parts of UTF-8 characters: held back and joined
    correctly, the streamed text equals the whole response's."""
    kw = dict(
        model=MODEL_NAME,
        prompt="Write",
        max_tokens=150,
        temperature=1.0,
        seed=99,
        extra_body={"ignore_eos": True},
    )
    whole = client.completions.create(**kw).choices[0].text
    pieces = [c.choices[0].text for c in client.completions.create(**kw, stream=True)]
    assert "".join(pieces) == whole

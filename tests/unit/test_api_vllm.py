"""What vLLM users send, through the real ``openai`` client: ``n`` choices, penalties (greedy
repetition penalty equal to transformers), ``logit_bias``, ``min_p``, ``stop`` with
``include_stop_str_in_output``, ``skip_special_tokens``, the OpenAI ``max_tokens`` defaults,
``generation_config.json`` defaults, model names and cards, ``/tokenize``, ``/detokenize``,
``/version``, and vLLM-shaped metrics with a ``model_name`` label."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import openai
import pytest

from tests.unit.test_api_double import MODEL_NAME, make_engine_backend
from tests.unit.test_api_support import ApiHarness, metric, raw_request

pytest_plugins = ["tests.unit.test_api_support"]

EOS = {"ignore_eos": True}
STOP_ID = 300  # an ordinary token made an EOS id by generation_config.json below


@pytest.fixture(scope="module")
def client(api: ApiHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0)


def _tok(api: ApiHarness):  # noqa: ANN202 - a transformers tokenizer
    return api.backend.tokenizer


# ---------------------------------------------------------------- n choices


def test_n_choices_are_distinct_reproducible_and_seeded_per_choice(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL_NAME, prompt="Once", max_tokens=8, temperature=1.0, seed=7,
              extra_body=EOS)
    out = client.completions.create(**kw, n=3)
    assert [c.index for c in out.choices] == [0, 1, 2]
    texts = [c.text for c in out.choices]
    assert len(set(texts)) > 1  # derived seeds: the choices differ
    assert out.usage.completion_tokens == 3 * 8
    assert [c.text for c in client.completions.create(**kw, n=3).choices] == texts
    assert client.completions.create(**kw).choices[0].text == texts[0]  # choice 0 = seed itself
    streamed = {0: "", 1: "", 2: ""}
    chunks = list(client.completions.create(**kw, n=3, stream=True,
                                            stream_options={"include_usage": True}))
    for c in chunks[:-1]:
        streamed[c.choices[0].index] += c.choices[0].text
    assert list(streamed.values()) == texts
    assert chunks[-1].usage.completion_tokens == 24


def test_continuous_usage_stats_count_each_choices_tokens_on_every_chunk(
        client: openai.OpenAI) -> None:
    """vLLM's stream_options.continuous_usage_stats (guidellm sends it): every chunk carries
    the usage so far of its choice, so a client can count tokens of chunks that hold several.
    It was ignored: chunks said usage null."""
    kw = dict(model=MODEL_NAME, prompt="Once upon", max_tokens=7, temperature=1.0, seed=5,
              extra_body=EOS, stream=True)
    chunks = list(client.completions.create(
        **kw, n=2, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    final = chunks[-1].usage
    assert final.completion_tokens == 14
    seen: dict[int, list[int]] = {0: [], 1: []}
    for c in chunks[:-1]:
        assert c.usage is not None and c.usage.prompt_tokens == final.prompt_tokens
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        seen[c.choices[0].index].append(c.usage.completion_tokens)
    assert all(v == sorted(v) and v[-1] == 7 for v in seen.values())
    # as in vLLM, only together with include_usage
    plain = list(client.completions.create(**kw, stream_options={"continuous_usage_stats": True}))
    assert all(c.usage is None for c in plain)
    chat = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
        extra_body=EOS, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert chat[0].usage.completion_tokens == 0  # the role chunk
    assert chat[-2].usage.completion_tokens == chat[-1].usage.completion_tokens == 5


def test_n_choices_in_chat(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2,
        temperature=1.0, seed=3, extra_body=EOS)
    assert [c.index for c in out.choices] == [0, 1]
    assert all(c.message.role == "assistant" and c.message.content for c in out.choices)
    chunks = list(client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=6, n=2,
        temperature=1.0, seed=3, stream=True, extra_body=EOS))
    text = {0: "", 1: ""}
    for c in chunks:
        text[c.choices[0].index] += c.choices[0].delta.content or ""
    assert [text[0], text[1]] == [c.message.content for c in out.choices]


def test_batched_prompts_give_one_choice_per_prompt_and_sample(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL_NAME, max_tokens=5, temperature=0, extra_body=EOS)
    prompts = ["Once upon", "The cat", "Hello"]
    alone = [client.completions.create(prompt=p, **kw) for p in prompts]
    out = client.completions.create(prompt=prompts, **kw)
    assert [c.text for c in out.choices] == [a.choices[0].text for a in alone]
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert out.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    ids = client.completions.create(prompt=[[5, 6, 7], [8, 9]], **kw, n=2)
    assert [c.index for c in ids.choices] == [0, 1, 2, 3]
    assert ids.choices[0].text == ids.choices[1].text  # greedy: a prompt's n samples agree
    assert ids.usage.prompt_tokens == 5 and ids.usage.completion_tokens == 20
    streamed = [""] * 3
    for c in client.completions.create(prompt=prompts, stream=True, **kw):
        streamed[c.choices[0].index] += c.choices[0].text
    assert streamed == [c.text for c in out.choices]


# ---------------------------------------------------------------- penalties and bias


def test_greedy_repetition_penalty_equals_transformers(api: ApiHarness, client, model_dir) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir("llama", "tiny")),
                                                 dtype=torch.float32).eval()

    def hf(prompt: list[int], penalty: float) -> list[int]:
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            return model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=16, min_new_tokens=16, eos_token_id=None,
                                  repetition_penalty=penalty, pad_token_id=0)[0, len(prompt):]

    # a prompt whose greedy continuation the penalty changes (a random model seldom repeats)
    prompts = [[5 + k, 17, 300 + k, 42, 17, 5 + k, 8] * 3 for k in range(40)]
    prompt, ref = next((p, r.tolist()) for p in prompts
                       if not torch.equal(r := hf(p, 5.0), hf(p, 1.0)))
    out = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=16,
                                    temperature=0, extra_body={**EOS, "repetition_penalty": 5.0})
    assert out.choices[0].text == _tok(api).decode(ref, skip_special_tokens=True)


def test_integral_floats_and_out_of_range_biases_are_taken_as_vllm_takes_them(
        api: ApiHarness, client) -> None:
    """Regression: ``max_tokens: 5.0`` (an integer-valued float, which vLLM's pydantic models
    accept; some clients send them) was a 400, and a logit_bias beyond +-100 a 400 where vLLM
    and OpenAI clamp it."""
    tok = _tok(api).encode(" the", add_special_tokens=False)[-1]
    out = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=5.0,
                                    temperature=1.0, logit_bias={str(tok): 1000},
                                    extra_body=EOS)
    assert out.usage.completion_tokens == 5
    assert out.choices[0].text == _tok(api).decode([tok] * 5)  # 1000 is 100: still forced


def test_logit_bias_forces_a_token_even_when_sampling(api: ApiHarness, client) -> None:
    tok = _tok(api).encode(" the", add_special_tokens=False)[-1]
    out = client.completions.create(model=MODEL_NAME, prompt="Hi", max_tokens=6,
                                    temperature=1.0, logit_bias={str(tok): 100}, extra_body=EOS)
    assert out.choices[0].text == _tok(api).decode([tok] * 6)
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        logit_bias={str(tok): 100}, extra_body=EOS)
    assert chat.choices[0].message.content == _tok(api).decode([tok] * 4)


def test_penalties_and_min_p_are_accepted_by_both_routes(client: openai.OpenAI) -> None:
    kw = dict(max_tokens=4, presence_penalty=1.5, frequency_penalty=-0.5, seed=1,
              extra_body={**EOS, "min_p": 0.1, "repetition_penalty": 1.2})
    assert client.completions.create(model=MODEL_NAME, prompt="Hi", **kw).usage.completion_tokens
    chat = client.chat.completions.create(model=MODEL_NAME,
                                          messages=[{"role": "user", "content": "Hi"}], **kw)
    assert chat.usage.completion_tokens == 4


# ---------------------------------------------------------------- text options


def test_stop_string_included_on_request(client: openai.OpenAI) -> None:
    base = dict(model=MODEL_NAME, prompt="In the beginning", temperature=0, max_tokens=24)
    full = client.completions.create(**base, extra_body=EOS).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    cut = full.index(stop)
    body = {**EOS, "include_stop_str_in_output": True}
    out = client.completions.create(**base, stop=stop, extra_body=body)
    assert out.choices[0].text == full[: cut + len(stop)] and out.choices[0].finish_reason == "stop"
    chunks = list(client.completions.create(**base, stop=stop, stream=True, extra_body=body))
    assert "".join(c.choices[0].text for c in chunks) == full[: cut + len(stop)]


def test_min_tokens_holds_back_stop_strings(client: openai.OpenAI) -> None:
    """Regression: a stop string in the text of the first min_tokens tokens cut the reply
    there (finish "stop", fewer tokens than asked). vLLM matches none before min_tokens."""
    base = dict(model=MODEL_NAME, prompt="In the beginning", temperature=0, max_tokens=24)
    full = client.completions.create(**base, extra_body=EOS).choices[0].text
    stop = full[:3]
    assert stop.strip(), f"need a visible stop string in {full!r}"
    body = {**EOS, "min_tokens": 24}
    for stream in (False, True):
        out = client.completions.create(**base, stop=stop, stream=stream, extra_body=body)
        if stream:
            chunks = list(out)
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            reason = [c.choices[0].finish_reason for c in chunks if c.choices][-1]
        else:
            text, reason = out.choices[0].text, out.choices[0].finish_reason
        assert (text, reason) == (full, "length")


def test_stop_reason_names_the_stop_string_or_token(client: openai.OpenAI) -> None:
    """vLLM's ``stop_reason``: the stop string matched, the stop token id stopped on, else
    null (a length finish, an EOS); clients such as lm-eval and vLLM's own benchmarks read it."""
    base = dict(model=MODEL_NAME, prompt="In the beginning", temperature=0, max_tokens=24)
    full = client.completions.create(**base, extra_body=EOS)
    assert full.choices[0].model_extra["stop_reason"] is None  # length
    text = full.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = client.completions.create(**base, stop=stop, extra_body=EOS)
    assert cut.choices[0].model_extra["stop_reason"] == stop
    streamed = list(client.completions.create(**base, stop=stop, stream=True, extra_body=EOS))
    assert [c.choices[0].model_extra["stop_reason"] for c in streamed][-1] == stop
    by_token = client.completions.create(**base, logit_bias={"301": 100},
                                         extra_body={"stop_token_ids": [301]})
    assert by_token.choices[0].finish_reason == "stop"
    assert by_token.choices[0].model_extra["stop_reason"] == 301


def test_echo_opens_each_choice_with_its_prompt(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL_NAME, max_tokens=4, temperature=0, extra_body=EOS)
    plain = client.completions.create(prompt=["Once upon", "The cat"], **kw)
    echoed = client.completions.create(prompt=["Once upon", "The cat"], echo=True, **kw)
    assert [c.text for c in echoed.choices] == [
        p + c.text for p, c in zip(["Once upon", "The cat"], plain.choices, strict=True)]
    chunks = list(client.completions.create(prompt="Once upon", echo=True, stream=True, **kw))
    assert "".join(c.choices[0].text for c in chunks) == echoed.choices[0].text


def test_chat_echo_repeats_a_final_assistant_message(client: openai.OpenAI) -> None:
    """vLLM's chat ``echo``: the reply opens with the last message when it is the assistant's
    (continue_final_message). It was ignored: the content was the new text alone."""
    msgs = [{"role": "user", "content": "Tell me"}, {"role": "assistant", "content": "Once upon"}]
    kw = dict(model=MODEL_NAME, messages=msgs, max_tokens=5, temperature=0)
    body = {**EOS, "continue_final_message": True, "add_generation_prompt": False}
    plain = client.chat.completions.create(**kw, extra_body=body).choices[0].message.content
    echoed = client.chat.completions.create(**kw, extra_body={**body, "echo": True})
    assert echoed.choices[0].message.content == "Once upon" + plain
    chunks = list(client.chat.completions.create(**kw, extra_body={**body, "echo": True},
                                                 stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == "Once upon" + plain
    user_last = dict(model=MODEL_NAME, messages=msgs[:1], max_tokens=5, temperature=0)
    assert (client.chat.completions.create(**user_last, extra_body={**EOS, "echo": True})
            .choices[0].message.content
            == client.chat.completions.create(**user_last, extra_body=EOS)
            .choices[0].message.content)  # nothing to echo: the last message is the user's


def test_return_token_ids_gives_the_prompt_and_output_ids(api: ApiHarness,
                                                          client: openai.OpenAI) -> None:
    """vLLM's ``return_token_ids`` (RL and agent frameworks read them): each completion choice
    its ``prompt_token_ids`` and ``token_ids``, a chat response ``prompt_token_ids`` beside its
    choices; streamed, the prompt's ids on the first chunk, each chunk its tokens. They were
    missing (a KeyError in those clients)."""
    tok = _tok(api)
    kw = dict(model=MODEL_NAME, prompt="Once upon", max_tokens=6, temperature=0)
    body = {**EOS, "return_token_ids": True}
    out = client.completions.create(**kw, extra_body=body).choices[0].model_dump()
    assert out["prompt_token_ids"] == tok("Once upon")["input_ids"]
    assert len(out["token_ids"]) == 6 and tok.decode(out["token_ids"]) == out["text"]
    chunks = [c.choices[0].model_dump() for c in
              client.completions.create(**kw, extra_body=body, stream=True)]
    assert chunks[0]["prompt_token_ids"] == out["prompt_token_ids"]
    assert all(c.get("prompt_token_ids") is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"]] == out["token_ids"]
    plain = client.completions.create(**kw, extra_body=EOS).choices[0].model_dump()
    assert plain.get("token_ids") is None and plain.get("prompt_token_ids") is None

    ckw = dict(model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
               temperature=0)
    chat = client.chat.completions.create(**ckw, extra_body=body).model_dump()
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}],
                                   add_generation_prompt=True, tokenize=False)
    assert chat["prompt_token_ids"] == tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(chat["choices"][0]["token_ids"]) == chat["choices"][0]["message"]["content"]
    streamed = [c.model_dump() for c in
                client.chat.completions.create(**ckw, extra_body=body, stream=True)]
    assert streamed[0]["prompt_token_ids"] == chat["prompt_token_ids"]
    assert all(c.get("prompt_token_ids") is None for c in streamed[1:])
    assert ([t for c in streamed for t in (c["choices"][0].get("token_ids") or [])]
            == chat["choices"][0]["token_ids"])


def test_return_tokens_as_token_ids_names_logprobs_tokens_by_id(client: openai.OpenAI) -> None:
    """vLLM's ``return_tokens_as_token_ids``: logprobs name each token "token_id:N" (a byte
    that is no character stays apart). It was ignored: the tokens' text came back."""
    body = {**EOS, "return_tokens_as_token_ids": True, "return_token_ids": True}
    kw = dict(model=MODEL_NAME, prompt="Once upon", max_tokens=5, temperature=0, logprobs=2)
    out = client.completions.create(**kw, extra_body=body).choices[0]
    ids = out.model_dump()["token_ids"]
    assert out.logprobs.tokens == [f"token_id:{t}" for t in ids]
    assert all(f"token_id:{t}" in top for t, top in zip(ids, out.logprobs.top_logprobs,
                                                        strict=True))
    named = client.completions.create(**kw, extra_body=EOS).choices[0]
    assert out.logprobs.text_offset == named.logprobs.text_offset  # offsets: the text's
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
        temperature=0, logprobs=True, top_logprobs=2, extra_body=body).choices[0]
    assert [c.token for c in chat.logprobs.content] == [
        f"token_id:{t}" for t in chat.model_dump()["token_ids"]]
    assert all(a.token.startswith("token_id:") for c in chat.logprobs.content
               for a in c.top_logprobs)


@pytest.mark.parametrize("field,value", [("chat_template", "{{ messages[0]['content'] }}"),
                                         ("prompt_embeds", "AAAA"), ("vllm_xargs", {"a": 1})])
def test_request_fields_that_would_change_the_prompt_unseen_are_refused(
        api: ApiHarness, field: str, value: object) -> None:
    """A request's own chat template (vLLM refuses it unless told to trust them), prompt
    embeddings and custom-processor arguments: a 400 naming the field. They were ignored with
    a 200 (the server's template was used)."""
    reply = raw_request(api.base_url, "POST", "/v1/chat/completions", {
        "model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
        field: value})
    assert reply.status == 400 and reply.json()["error"]["param"] == field


def test_vllm_extras_at_their_defaults_are_taken_and_others_refused(api: ApiHarness) -> None:
    """Regression (review of session 64): a client that sends every field of vLLM's request
    model sends use_beam_search false, length_penalty 1.0 and bad_words [] (vLLM's defaults,
    which change nothing); each was a 400. A value that would change the output still is."""
    noop = {"use_beam_search": False, "length_penalty": 1, "bad_words": [],
            "logits_processors": []}
    for route, body in (("/v1/completions", {"prompt": "Hi"}),
                        ("/v1/chat/completions", {"messages": [{"role": "user",
                                                                "content": "Hi"}]})):
        reply = raw_request(api.base_url, "POST", route, {"model": MODEL_NAME, "max_tokens": 2,
                                                          **body, **noop})
        assert reply.status == 200, reply.json()
    for field, value in (("use_beam_search", True), ("length_penalty", 0.5),
                         ("bad_words", ["Hi"]), ("use_beam_search", 0)):
        reply = raw_request(api.base_url, "POST", "/v1/completions", {
            "model": MODEL_NAME, "prompt": "Hi", "max_tokens": 2, field: value})
        assert reply.status == 400 and reply.json()["error"]["param"] == field


def test_skip_special_tokens_false_shows_them(api: ApiHarness, client: openai.OpenAI) -> None:
    special = _tok(api).convert_tokens_to_ids("<|im_end|>")
    kw = dict(model=MODEL_NAME, prompt="Hi", max_tokens=3, logit_bias={str(special): 100})
    assert client.completions.create(**kw, extra_body=EOS).choices[0].text == ""
    shown = client.completions.create(**kw, extra_body={**EOS, "skip_special_tokens": False})
    assert shown.choices[0].text == "<|im_end|>" * 3


def test_default_max_tokens_is_16_on_completions_and_the_context_on_chat(
    api: ApiHarness, client: openai.OpenAI
) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", extra_body=EOS)
    assert out.usage.completion_tokens == 16 and out.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], extra_body=EOS)
    room = api.backend.max_model_len - chat.usage.prompt_tokens
    assert chat.usage.completion_tokens == room
    # an explicit null (openai-python's max_tokens=None) is the rest of the context, as vLLM's
    # Optional[int] = 16 makes it; it was 16
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=None,
                                    extra_body=EOS)
    assert out.usage.completion_tokens == api.backend.max_model_len - out.usage.prompt_tokens


def test_an_empty_model_name_and_huge_numbers_are_taken_as_vllm_takes_them(
    api: ApiHarness, client: openai.OpenAI
) -> None:
    """Regression: ``"model": ""`` was a 404 (vLLM serves its model); ``top_k`` 1e30 passed
    the checks and failed to encode for the worker, a 500 (it is "every token", as in vLLM);
    ``true_output_len`` 1e30 too (now a 400)."""
    out = client.completions.create(model="", prompt="Hello", max_tokens=2, extra_body=EOS)
    assert out.usage.completion_tokens == 2
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2,
                                    temperature=0, extra_body={**EOS, "top_k": 1e30})
    greedy = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2,
                                       temperature=0, extra_body=EOS)
    assert out.choices[0].text == greedy.choices[0].text
    with pytest.raises(openai.BadRequestError, match="true_output_len"):
        client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=2,
                                  extra_body={"true_output_len": 1e30})


# ---------------------------------------------------------------- logprobs


def test_logprobs_report_the_chosen_token_among_its_alternatives(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=4,
                                    temperature=0, logprobs=5, extra_body=EOS)
    lp = out.choices[0].logprobs
    for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert top[tok] == pytest.approx(chosen) and chosen <= 0


def test_top_logprobs_give_k_alternatives_best_first(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="Hello", max_tokens=3,
                                    temperature=0, logprobs=5, extra_body=EOS)
    for top, chosen in zip(out.choices[0].logprobs.top_logprobs,
                           out.choices[0].logprobs.token_logprobs, strict=True):
        assert len(top) == 5 and max(top.values()) == pytest.approx(chosen)  # greedy = the best
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        temperature=0, logprobs=True, top_logprobs=3, extra_body=EOS)
    for c in chat.choices[0].logprobs.content:
        assert len(c.top_logprobs) == 3 and c.top_logprobs[0].token == c.token


# ---------------------------------------------------------------- names, cards, tokenizer


def test_models_list_names_with_root_and_cards(api: ApiHarness, client: openai.OpenAI) -> None:
    root = api.backend.tokenizer.name_or_path
    models = raw_request(api.base_url, "GET", "/v1/models").json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [(MODEL_NAME, root)]
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    # the folder (as a path or a name) is accepted as the model too
    for name in (root, Path(root).name):
        out = client.completions.create(model=name, prompt="Hi", max_tokens=1)
        assert out.model == name  # the name asked for, echoed as vLLM does
    assert client.completions.create(prompt="Hi", max_tokens=1,
                                     model="").model == MODEL_NAME


def test_tokenize_detokenize_and_version(api: ApiHarness) -> None:
    tok = _tok(api)
    reply = raw_request(api.base_url, "POST", "/tokenize",
                        {"model": MODEL_NAME, "prompt": "Hello world", "return_token_strs": True})
    body = reply.json()
    assert reply.status == 200 and body["tokens"] == tok.encode("Hello world")
    assert body["count"] == len(body["tokens"])
    assert body["max_model_len"] == api.backend.max_model_len
    assert body["token_strs"] == tok.convert_ids_to_tokens(body["tokens"])
    bare = raw_request(api.base_url, "POST", "/tokenize",
                       {"prompt": "Hello world", "add_special_tokens": False}).json()
    assert bare["tokens"] == tok.encode("Hello world", add_special_tokens=False)
    assert bare["token_strs"] is None
    messages = [{"role": "user", "content": "Hi"}]
    chat = raw_request(api.base_url, "POST", "/tokenize", {"messages": messages}).json()
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert chat["tokens"] == tok.encode(text, add_special_tokens=False)
    back = raw_request(api.base_url, "POST", "/detokenize", {"tokens": bare["tokens"]}).json()
    assert back == {"prompt": "Hello world"}
    bad = raw_request(api.base_url, "POST", "/detokenize", {"tokens": [10**9]})
    assert bad.status == 400 and bad.json()["error"]["param"] == "tokens"
    version = raw_request(api.base_url, "GET", "/version").json()["version"]
    assert isinstance(version, str) and version


def test_tokenize_needs_the_key_when_one_is_set(api: ApiHarness) -> None:
    url = api.serve(api_key="k3y")
    assert raw_request(url, "POST", "/tokenize", {"prompt": "x"}).status == 401
    ok = raw_request(url, "POST", "/tokenize", {"prompt": "x"}, {"Authorization": "Bearer k3y"})
    assert ok.status == 200
    assert raw_request(url, "GET", "/version").status == 200


# ---------------------------------------------------------------- metrics


def test_vllm_shaped_metrics_with_model_name(api: ApiHarness, client: openai.OpenAI) -> None:
    url, m = api.base_url, {"model_name": MODEL_NAME}

    def snapshot() -> dict[str, float]:
        return {
            "gen": metric(url, "tetri_generation_tokens_total", **m),
            "prompt": metric(url, "tetri_prompt_tokens_total", **m),
            "len": metric(url, "tetri_request_success_total", finished_reason="length", **m),
            "gen_hist": metric(url, "tetri_request_generation_tokens_sum", **m),
            "prompt_hist": metric(url, "tetri_request_prompt_tokens_count", **m),
            "itl": metric(url, "tetri_inter_token_latency_seconds_count", **m),
            "e2e": metric(url, "tetri_e2e_request_latency_seconds_count", **m),
        }

    before = snapshot()
    out = client.completions.create(model=MODEL_NAME, prompt="Hello there", max_tokens=7,
                                    extra_body=EOS)
    after = snapshot()
    assert after["gen"] - before["gen"] == 7
    assert after["prompt"] - before["prompt"] == out.usage.prompt_tokens
    assert after["len"] - before["len"] == 1 and after["e2e"] - before["e2e"] == 1
    assert after["gen_hist"] - before["gen_hist"] == 7
    assert after["prompt_hist"] - before["prompt_hist"] == 1
    assert after["itl"] - before["itl"] == 6  # gaps between 7 tokens
    text = raw_request(url, "GET", "/metrics").body.decode()
    assert "process_cpu_seconds_total" in text
    assert metric(url, "tetri_kv_cache_usage_perc", **m) >= 0
    assert 'tetri_num_requests_running{model_name="tiny-test"}' in text


# ---------------------------------------------------------------- generation_config.json


@pytest.fixture(scope="module")
def gen_config_api(model_dir, tmp_path_factory) -> ApiHarness:
    """The tiny model with a generation_config.json asking for greedy and 5 new tokens."""
    folder = tmp_path_factory.mktemp("genconfig") / "tiny-greedy"
    shutil.copytree(model_dir("llama", "tiny"), folder)
    cfg = json.loads((folder / "generation_config.json").read_text())
    cfg.update(temperature=0.0, top_p=0.5, max_new_tokens=5, eos_token_id=[2, STOP_ID])
    (folder / "generation_config.json").write_text(json.dumps(cfg))
    harness = ApiHarness(make_engine_backend, folder)
    yield harness
    harness.close()


def test_generation_config_supplies_defaults(gen_config_api: ApiHarness) -> None:
    client = openai.OpenAI(base_url=gen_config_api.base_url + "/v1", api_key="x", max_retries=0)
    kw = dict(model=MODEL_NAME, prompt="Once upon", extra_body=EOS)
    default = [client.completions.create(**kw).choices[0].text for _ in range(3)]
    greedy = client.completions.create(**kw, temperature=0, max_tokens=5).choices[0].text
    assert default == [greedy] * 3  # temperature 0 from the file
    chat = client.chat.completions.create(model=MODEL_NAME, extra_body=EOS,
                                          messages=[{"role": "user", "content": "Hi"}])
    assert chat.usage.completion_tokens == 5  # max_new_tokens caps the default
    asked = client.completions.create(**{**kw, "max_tokens": 9, "temperature": 1.0, "seed": 1})
    assert asked.usage.completion_tokens == 9  # the request wins
    bias = {str(STOP_ID): 100}  # the model now says STOP_ID first: an EOS id from the file
    for route in ("completion", "chat"):
        if route == "completion":
            out = client.completions.create(model=MODEL_NAME, prompt="Hi", logit_bias=bias)
        else:
            out = client.chat.completions.create(
                model=MODEL_NAME, messages=[{"role": "user", "content": "Hi"}], logit_bias=bias)
        assert out.choices[0].finish_reason == "stop" and out.usage.completion_tokens == 1
        # the stop token's text is no part of the reply (vLLM; it printed here before)
        text = out.choices[0].text if route == "completion" else out.choices[0].message.content
        assert text == ""
    shown = client.completions.create(model=MODEL_NAME, prompt="Hi", logit_bias=bias,
                                      extra_body={"include_stop_str_in_output": True})
    assert shown.choices[0].text != ""  # unless asked for
    kept = client.completions.create(model=MODEL_NAME, prompt="Hi", logit_bias=bias,
                                     extra_body=EOS)
    assert kept.usage.completion_tokens == 5  # ignore_eos: the file's EOS ids too


# ---------------------------------------------------------------- chat history with tool calls


class _RecordingTokenizer:
    """Just enough of a tokenizer for chat_prompt: records what the template is given."""

    chat_template = "recorded"

    def __init__(self) -> None:
        self.calls: list[tuple[list, dict]] = []

    def apply_chat_template(self, messages, **kwargs):  # noqa: ANN001, ANN201
        self.calls.append((messages, kwargs))
        return "x"

    def encode(self, text, add_special_tokens=False):  # noqa: ANN001, ANN201
        return [5]


def test_tool_calls_name_and_tool_call_id_reach_the_template() -> None:
    from tetri_server.api.fields import Fields
    from tetri_server.api.prompts import PromptLimits, chat_prompt

    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "user", "content": "Weather?", "name": "ann"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "call_1"},
    ]
    tok = _RecordingTokenizer()
    limits = PromptLimits(vocab_size=10, max_model_len=100, max_chars=10_000)
    chat_prompt(Fields({"messages": messages, "chat_template_kwargs": {"enable_thinking": False}}),
                tok, limits)
    given, kwargs = tok.calls[0]
    assert given[0]["name"] == "ann" and given[2]["tool_call_id"] == "call_1"
    assert given[1]["tool_calls"] == [{"id": "call_1", "type": "function", "function": {
        "name": "weather", "arguments": {"city": "Oslo"}}}]  # arguments as an object, as vLLM
    assert kwargs["enable_thinking"] is False and kwargs["add_generation_prompt"] is True
    from tetri_server.api.errors import APIError

    with pytest.raises(APIError, match="at most 128 calls"):
        chat_prompt(Fields({"messages": [{"role": "assistant", "content": "",
                                          "tool_calls": [call] * 129}]}), tok, limits)


def test_chat_template_kwargs_may_set_the_generation_prompt_and_documents_reach_the_template(
        ) -> None:
    """Regression (session 66 review): ``chat_template_kwargs: {"add_generation_prompt":
    false}`` (or ``continue_final_message``) was a 400, where vLLM applies the kwargs over its
    defaults; and the top-level ``documents`` (retrieval templates) never reached the template."""
    from tetri_server.api.errors import APIError
    from tetri_server.api.fields import Fields
    from tetri_server.api.prompts import PromptLimits, chat_prompt

    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "So"}]
    limits = PromptLimits(vocab_size=10, max_model_len=100, max_chars=10_000)
    tok = _RecordingTokenizer()
    chat_prompt(Fields({"messages": messages, "add_generation_prompt": True,
                        "chat_template_kwargs": {"add_generation_prompt": False}}), tok, limits)
    chat_prompt(Fields({"messages": messages, "chat_template_kwargs": {
        "continue_final_message": True}}), tok, limits)
    docs = [{"title": "a", "text": "b"}]
    chat_prompt(Fields({"messages": messages, "documents": docs}), tok, limits)
    got = [(k["add_generation_prompt"], k["continue_final_message"], k.get("documents"))
           for _, k in tok.calls]
    assert got == [(False, False, None), (False, True, None), (True, False, docs)]
    for bad in ({"chat_template_kwargs": {"add_generation_prompt": "no"}},
                {"documents": [{"title": 1}]}, {"documents": "x"},
                {"chat_template_kwargs": {"continue_final_message": True,
                                          "add_generation_prompt": True}}):
        with pytest.raises(APIError):
            chat_prompt(Fields({"messages": messages, **bad}), tok, limits)


# ---------------------------------------------------------------- CORS


def test_cors_only_when_origins_are_configured(api: ApiHarness) -> None:
    page = "http://app.example:3000"
    pre = {"Origin": page, "Access-Control-Request-Method": "POST",
           "Access-Control-Request-Headers": "authorization, content-type"}
    plain = api.serve(host="0.0.0.0")  # not loopback: any Origin passes, but no CORS
    assert raw_request(plain, "OPTIONS", "/v1/completions", headers=pre).status == 405
    reply = raw_request(plain, "GET", "/v1/models", headers={"Origin": page})
    assert "access-control-allow-origin" not in reply.headers
    url = api.serve(allowed_origins=(page,), api_key="k")
    reply = raw_request(url, "OPTIONS", "/v1/completions", headers=pre)  # no key: a preflight
    assert reply.status == 204 and reply.headers["access-control-allow-origin"] == page
    assert "authorization" in reply.headers["access-control-allow-headers"].lower()
    ok = raw_request(url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1},
                     {"Origin": page, "Authorization": "Bearer k"})
    assert ok.status == 200 and ok.headers["access-control-allow-origin"] == page
    denied = raw_request(url, "GET", "/v1/models", headers={"Origin": page})
    assert denied.status == 401 and denied.headers["access-control-allow-origin"] == page
    other = raw_request(url, "GET", "/health", headers={"Origin": "http://evil.example"})
    assert other.status == 403 and "access-control-allow-origin" not in other.headers


def test_a_preflight_allows_the_headers_the_openai_js_sdk_sends(api: ApiHarness) -> None:
    """Regression (review of session 62): a preflight allowed only Authorization and
    Content-Type, so a browser refused the OpenAI JS SDK's requests (it sends X-Stainless-*
    headers); vLLM allows all. A page can read Retry-After too."""
    page = "http://app.example:3000"
    url = api.serve(allowed_origins=(page,), api_key="k")
    asked = "authorization, content-type, x-stainless-os, x-stainless-timeout"
    reply = raw_request(url, "OPTIONS", "/v1/chat/completions", headers={
        "Origin": page, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": asked})
    assert reply.status == 204
    allowed = {h.strip() for h in reply.headers["access-control-allow-headers"].lower().split(",")}
    assert {"x-stainless-os", "x-stainless-timeout", "authorization"} <= allowed
    ok = raw_request(url, "GET", "/v1/models", headers={"Origin": page,
                                                         "Authorization": "Bearer k"})
    assert "retry-after" in ok.headers["access-control-expose-headers"].lower()


def test_a_request_during_the_drain_is_a_503_with_retry_after(api: ApiHarness) -> None:
    """Regression (review of session 62): a request that came during a SIGTERM drain got a
    503 without Retry-After, which every other 503 carries (docs/reliability.md)."""
    from tetri_server.api.app import STATE

    url = api.serve()
    state = api.apps[url][STATE]
    state.draining = True
    try:
        reply = raw_request(url, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1})
        assert reply.status == 503 and reply.headers.get("retry-after") == "1"
        assert reply.json()["error"]["code"] == "shutting_down"
        assert raw_request(url, "GET", "/health").headers.get("retry-after") == "1"
    finally:
        state.draining = False
    ready = api.backend.is_ready
    api.backend.is_ready = lambda: False  # workers restarting
    try:
        reply = raw_request(url, "GET", "/health")
        assert reply.status == 503 and reply.headers.get("retry-after") == "1"
    finally:
        api.backend.is_ready = ready


def test_text_parts_of_a_message_are_joined_by_a_newline() -> None:
    """Regression: the parts were glued together ("Hello.How are you"), where vLLM joins
    them with a newline: the model saw another prompt for the same request."""
    from tetri_server.api.fields import Fields
    from tetri_server.api.prompts import PromptLimits, chat_prompt

    parts = [{"type": "text", "text": "Hello."}, {"type": "text", "text": "How are you"}]
    tok = _RecordingTokenizer()
    chat_prompt(Fields({"messages": [{"role": "user", "content": parts}]}), tok,
                PromptLimits(10, 100, 10_000))
    assert tok.calls[0][0][0]["content"] == "Hello.\nHow are you"


def test_add_special_tokens_is_honoured_on_the_generation_routes(api: ApiHarness) -> None:
    """Regression: ``add_special_tokens`` was read by /tokenize only. A completions prompt that
    already starts with the BOS got a second one (vLLM: false leaves it out), and chat ignored
    true; /tokenize then counted other tokens than the request ran on."""
    bos = _tok(api).bos_token
    assert bos
    for body, path in [({"prompt": f"{bos}Hi there"}, "/v1/completions"),
                       ({"messages": [{"role": "user", "content": "Hi"}]},
                        "/v1/chat/completions")]:
        counts = {}
        for special in (True, False):
            reply = raw_request(api.base_url, "POST", path,
                                {**body, "max_tokens": 1, "add_special_tokens": special})
            assert reply.status == 200, reply.body
            used = reply.json()["usage"]["prompt_tokens"]
            counted = raw_request(api.base_url, "POST", "/tokenize",
                                  {**body, "add_special_tokens": special}).json()["count"]
            assert used == counted, (path, special)
            counts[special] = used
        assert counts[True] == counts[False] + 1, (path, counts)


def test_a_token_id_prompt_cut_inside_a_character_is_not_repeated_in_the_text(
        api: ApiHarness, client: openai.OpenAI) -> None:
    """Regression (review of session 62): a prompt of token ids that ends inside a multi-byte
    character got the text of its last tokens ("ay 你好") again at the start of the
    completion, HTTP 200. The text is what the output tokens add to the prompt's."""
    tok = _tok(api)
    ids = tok.encode("Say 你好世界 now", add_special_tokens=False)
    cut = [n for n in range(2, len(ids)) if tok.decode(ids[:n]).endswith("\ufffd")]
    assert cut, "the test needs a prompt that ends inside a character"
    for n in cut[:2]:
        out = client.completions.create(
            model=MODEL_NAME, prompt=ids[:n], max_tokens=8, temperature=0,
            extra_body={**EOS, "return_token_ids": True}).choices[0].model_dump()
        prompt = tok.decode(ids[:n])  # ends in U+FFFD: the cut character
        full = tok.decode(ids[:n] + out["token_ids"]).rstrip("\ufffd")
        assert out["text"] and full.endswith(out["text"])
        # before it: the prompt's text, its broken character completed by the output or not
        assert full[:len(full) - len(out["text"])] in (prompt, prompt.rstrip("\ufffd"))

"""Prompt logprobs through the API, as lm-eval's ``local-completions`` asks for them
(``echo: true, logprobs: N, max_tokens: 1`` on batches of token-id prompts) and as vLLM's
``prompt_logprobs`` extension returns them: the numbers are transformers' log_softmax of the
prompt's logits, the shapes OpenAI's and vLLM's, whole and streamed; ``max_tokens: 0`` with echo
gives the prompt alone."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.unit.test_api_double import MODEL_NAME
from tests.unit.test_api_support import ApiHarness, raw_request

pytest_plugins = ["tests.unit.test_api_support"]


@pytest.fixture(scope="module")
def client(api: ApiHarness) -> openai.OpenAI:
    return openai.OpenAI(base_url=api.base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def hf(model_dir):  # noqa: ANN001, ANN201 - the transformers model of the served checkpoint
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(model_dir("llama", "tiny")),
                                                dtype=torch.float32).eval()


def hf_logprobs(hf, ids: list[int]) -> list[float]:  # noqa: ANN001
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    return [logp[i - 1, ids[i]].item() for i in range(1, len(ids))]


def test_lm_eval_loglikelihood_request(api: ApiHarness, client: openai.OpenAI, hf) -> None:
    """lm-eval sums token_logprobs[ctxlen:-1] and checks greediness against top_logprobs."""
    tok = api.backend.tokenizer
    prompts = [tok.encode("The cat sat on the mat"), tok.encode("Once upon a time")]
    out = client.completions.create(model=MODEL_NAME, prompt=prompts, echo=True, logprobs=2,
                                    max_tokens=1, temperature=0, seed=1234)
    assert len(out.choices) == 2
    for ids, choice in zip(prompts, sorted(out.choices, key=lambda c: c.index), strict=True):
        lp = choice.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(ids) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = hf_logprobs(hf, ids)
        assert lp.token_logprobs[1:len(ids)] == pytest.approx(ref, abs=1e-3)
        for own, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:], strict=True):
            assert max(top.values()) >= own and len(top) in (2, 3)  # 2 best (+ own token)
        assert lp.text_offset == sorted(lp.text_offset)
        assert choice.text.startswith(tok.decode(ids))  # special tokens kept, as vLLM
    assert out.usage.completion_tokens == 2


def test_echo_logprobs_streamed_equal_whole(client: openai.OpenAI) -> None:
    kw = dict(model=MODEL_NAME, prompt="Hello there, friend", echo=True, logprobs=1,
              max_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    whole = client.completions.create(**kw).choices[0]
    chunks = list(client.completions.create(**kw, stream=True))
    lps = [x for c in chunks if c.choices[0].logprobs
           for x in c.choices[0].logprobs.token_logprobs]
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    assert lps == whole.logprobs.token_logprobs


def test_max_tokens_zero_with_echo_is_the_prompt_alone(api: ApiHarness, hf) -> None:
    ids = api.backend.tokenizer.encode("A short prompt here")
    reply = raw_request(api.base_url, "POST", "/v1/completions", {
        "model": MODEL_NAME, "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0})
    assert reply.status == 200, reply.body
    out = reply.json()
    choice = out["choices"][0]
    assert choice["finish_reason"] == "length"
    assert len(choice["logprobs"]["tokens"]) == len(ids)
    assert choice["logprobs"]["token_logprobs"][1:] == pytest.approx(hf_logprobs(hf, ids),
                                                                     abs=1e-3)
    assert out["usage"]["completion_tokens"] == 0


def test_echo_of_token_ids_keeps_special_tokens_as_its_offsets_do(api: ApiHarness) -> None:
    """Regression (review of session 64): a prompt of token ids was echoed without its special
    tokens (BOS), while logprobs.tokens named them and text_offset counted them, so the
    offsets pointed past the text they index. vLLM decodes it with the special tokens."""
    tok = api.backend.tokenizer
    ids = tok.encode("A short prompt here")
    assert ids[0] in tok.all_special_ids  # a BOS opens it
    reply = raw_request(api.base_url, "POST", "/v1/completions", {
        "model": MODEL_NAME, "prompt": ids, "echo": True, "logprobs": 0, "max_tokens": 0})
    choice = reply.json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    assert text == tok.decode(ids) and text.startswith(tok.decode(ids[:1]))
    ends = [*lp["text_offset"][1:], len(text)]
    assert [text[a:b] for a, b in zip(lp["text_offset"], ends, strict=True)] == lp["tokens"]
    # the length predictor reads the prompt as its data had it: without the special tokens
    from tetri_server.api.fields import Fields
    from tetri_server.api.prompts import PromptLimits, completion_prompts

    [prompt] = completion_prompts(Fields({"prompt": ids}), tok, PromptLimits(10**5, 4096, 10**6))
    assert prompt.text == tok.decode(ids, skip_special_tokens=True) != text


def test_vllm_prompt_logprobs_extension(api: ApiHarness, hf) -> None:
    ids = api.backend.tokenizer.encode("Ranks and logprobs of a prompt")
    reply = raw_request(api.base_url, "POST", "/v1/completions", {
        "model": MODEL_NAME, "prompt": ids, "prompt_logprobs": 2, "max_tokens": 1})
    assert reply.status == 200, reply.body
    plp = reply.json()["choices"][0]["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    ref = hf_logprobs(hf, ids)
    for i, entry in enumerate(plp[1:], start=1):
        own = entry[str(ids[i])]
        assert own["logprob"] == pytest.approx(ref[i - 1], abs=1e-3)
        assert own["rank"] >= 1 and isinstance(own["decoded_token"], str)
        ranks = sorted(e["rank"] for e in entry.values())
        assert ranks[:2] == [1, 2]  # the 2 best, plus the prompt's own token if not among them
        assert len(entry) == (2 if own["rank"] <= 2 else 3)


def test_requests_without_echo_logprobs_are_unchanged(client: openai.OpenAI) -> None:
    out = client.completions.create(model=MODEL_NAME, prompt="Plain", max_tokens=2,
                                    logprobs=1, temperature=0, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 2 and None not in lp.token_logprobs

"""OpenAI request bodies -> one validated ``GenRequest`` (prompt ids + SamplingParams + stops).

Only what a client would notice is decided here: defaults (``max_tokens`` fills the context),
limits against ``max_model_len``, and clear 400s for fields we cannot honour. Token-level
stops go to the workers in ``SamplingParams``; stop strings stay in the API layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from tetri_server.api.errors import APIError, bad_param
from tetri_server.api.fields import Fields
from tetri_server.messages import SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts


@dataclass(frozen=True)
class Prompt:
    """A tokenized prompt; ``param`` names the body field it came from (for errors)."""

    ids: list[int]
    text: str
    param: str


@dataclass(frozen=True)
class GenRequest:
    """One validated generation request, independent of the endpoint it came through."""

    kind: Literal["completion", "chat"]
    model: str
    prompt_ids: list[int]
    prompt_text: str
    params: SamplingParams
    stop: tuple[str, ...]
    stream: bool
    include_usage: bool
    logprobs: bool
    true_output_len: int | None


def check_model(f: Fields, served_name: str) -> str:
    """The model the client asked for; missing means the one we serve (as vLLM does)."""
    model = f.string("model", served_name)
    if model != served_name:
        raise APIError(
            f"the model '{model}' does not exist; this server serves '{served_name}'",
            status=404,
            param="model",
            code="model_not_found",
        )
    return served_name


def _reject_unsupported(f: Fields, kind: str) -> None:
    n = f.integer("n", 1, low=1)
    if n != 1:
        raise bad_param("n", f"n > 1 is not supported (got {n}); send {n} separate requests")
    f.require_absent("best_of", (1,), "best_of > 1")
    f.require_absent("frequency_penalty", (0,), "a non-zero frequency_penalty")
    f.require_absent("presence_penalty", (0,), "a non-zero presence_penalty")
    f.require_absent("repetition_penalty", (1,), "a repetition_penalty other than 1")
    f.require_absent("logit_bias", ({},), "logit_bias")
    if kind == "completion":
        if f.boolean("echo", False):
            raise bad_param("echo", "echo=true is not supported")
        f.require_absent("suffix", ("",), "suffix")
    else:
        f.require_absent("tools", ([],), "tool calling")
        fmt = f.obj("response_format")
        if fmt is not None and fmt.get("type", "text") != "text":
            raise bad_param("response_format", "only {'type': 'text'} is supported")


def _logprobs(f: Fields, kind: str) -> bool:
    if kind == "completion":
        n = f.integer("logprobs", None, low=0)
        if n is not None and n > 1:
            raise bad_param(
                "logprobs",
                "only the sampled token's logprob is available; use logprobs=0 or 1",
            )
        return n is not None
    wanted = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", 0, low=0)
    if top:
        raise bad_param("top_logprobs", "only the sampled token's logprob is available; use 0")
    return wanted


def context_exceeded(num_tokens: int, max_model_len: int, param: str) -> APIError:
    return APIError(
        f"the prompt has {num_tokens} tokens but the context is {max_model_len} tokens "
        "(max_model_len), leaving no room for output; shorten the prompt",
        param=param,
        code="context_length_exceeded",
    )


def _max_tokens(f: Fields, kind: str, prompt: Prompt, max_model_len: int) -> int:
    room = max_model_len - len(prompt.ids)
    if room <= 0:
        raise context_exceeded(len(prompt.ids), max_model_len, prompt.param)
    name = "max_tokens"
    if kind == "chat" and f.has("max_completion_tokens"):
        name = "max_completion_tokens"
    value = f.integer(name, None)
    if value is None:
        return room
    if value < 1:
        raise bad_param(name, f"must be >= 1, got {value}")
    if value > room:
        raise APIError(
            f"{name}: {value} output tokens plus the prompt's {len(prompt.ids)} tokens exceed "
            f"the context of {max_model_len} tokens; ask for at most {room}",
            param=name,
            code="context_length_exceeded",
        )
    return value


def parse_request(
    f: Fields,
    kind: Literal["completion", "chat"],
    prompt: Prompt,
    *,
    model: str,
    max_model_len: int,
    vocab_size: int,
    extra_stop_ids: tuple[int, ...] = (),
) -> GenRequest:
    """Validate the sampling fields of ``f`` for an already tokenized ``prompt``."""
    _reject_unsupported(f, kind)
    stream = f.boolean("stream", False)
    options = f.obj("stream_options")
    if options is not None and not stream:
        raise bad_param("stream_options", "only allowed when stream is true")
    include_usage = (options or {}).get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise bad_param("stream_options.include_usage", "expected true or false")
    max_tokens = _max_tokens(f, kind, prompt, max_model_len)
    top_k = f.integer("top_k", 0, low=-1)
    ignore_eos = f.boolean("ignore_eos", False)
    stop_ids = f.token_ids("stop_token_ids", vocab_size=vocab_size, max_items=MAX_STOP_TOKEN_IDS)
    if not ignore_eos:
        stop_ids += [i for i in extra_stop_ids if i not in stop_ids]
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=f.number("temperature", 1.0, low=0.0),
        top_p=f.number("top_p", 1.0, low=0.0, high=1.0, low_open=True),
        top_k=max(0, top_k or 0),
        seed=f.integer("seed", None, low=SEED_RANGE[0], high=SEED_RANGE[1]),
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        logprobs=_logprobs(f, kind),
        min_tokens=f.integer("min_tokens", 0, low=0, high=max_tokens) or 0,
    )
    f.string("user", None)
    return GenRequest(
        kind=kind,
        model=model,
        prompt_ids=prompt.ids,
        prompt_text=prompt.text,
        params=params,
        stop=tuple(f.string_list("stop", max_items=MAX_STOP_STRINGS, max_len=MAX_STOP_CHARS)),
        stream=stream,
        include_usage=include_usage,
        logprobs=params.logprobs,
        true_output_len=f.integer("true_output_len", None, low=0),
    )

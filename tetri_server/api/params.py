"""OpenAI request bodies -> one validated ``GenRequest`` (prompt ids + SamplingParams + stops).

Only what a client would notice is decided here: defaults (``max_tokens``: 16 on completions as
OpenAI and vLLM, the rest of the context on chat; sampling from generation_config.json when the
request omits it), limits against ``max_model_len``, and clear 400s for fields we cannot honour.
Token-level stops go to the workers in ``SamplingParams``; stop strings stay in the API layer.
Structured output (``guides.py``) and forced tool calls (``tools.py``) become the request's
``Guide``, also in ``SamplingParams``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

from tetri_server.api.errors import APIError, bad_param
from tetri_server.api.fields import Fields
from tetri_server.api.guides import parse_guide
from tetri_server.api.models import GenerationDefaults
from tetri_server.api.tools import ForcedCall
from tetri_server.messages import Guide, SamplingParams

MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 512
MAX_STOP_TOKEN_IDS = 1024
MAX_LOGIT_BIAS = 1024  # entries
MAX_LOGPROBS = 20  # alternatives per token (vLLM's default max_logprobs)
MAX_N = 16  # choices per request; each is one backend request
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's and vLLM's /v1/completions default
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.Generator.manual_seed accepts
TAGS_ARE_SPECIAL = ("hermes", "mistral")  # tool parsers whose call tags are special tokens
# vLLM request extras this server does not implement: a 400 naming them, never ignored
MAX_REQUEST_ID = 256  # characters of a client's request id kept in the response id
UNSUPPORTED_EXTRAS = (
    "guided_whitespace_pattern", "use_beam_search", "length_penalty",
    "allowed_token_ids", "bad_words", "truncate_prompt_tokens", "logits_processors",
    "functions", "function_call",
    # a request's own chat template (vLLM refuses it too unless the server trusts requests'
    # templates), prompt embeddings, and arguments for custom logits processors
    "chat_template", "prompt_embeds", "vllm_xargs",
)
# values of those extras that change nothing: vLLM's own defaults, which a client that sends
# every field of vLLM's request model sends (false, 1.0, [])
NO_OP_EXTRAS: dict[str, tuple[object, ...]] = {
    "use_beam_search": (False,), "length_penalty": (1.0,), "bad_words": ([],),
    "logits_processors": ([],), "functions": ([],),
}


@dataclass(frozen=True)
class Prompt:
    """A tokenized prompt; ``param`` names the body field it came from (for errors)."""

    ids: list[int]
    text: str
    param: str
    final_assistant: str = ""  # chat: the content of a last message by the assistant
    echo_text: str = ""  # completions' echo where it is not ``text`` (token ids: the special
    # tokens kept, as vLLM; ``text``, the length predictor's, leaves them out as its data did)


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
    # stream_options.continuous_usage_stats (with include_usage): usage so far on every chunk
    continuous_usage: bool = False
    n: int = 1  # choices; choice i samples with choice_params(i)
    include_stop_str: bool = False  # include_stop_str_in_output
    skip_special_tokens: bool = True
    echo: bool = False  # echo_text opens each choice
    # completions: the prompt's text; chat: a final assistant message's (vLLM's chat echo)
    echo_text: str = ""
    # completions echo + logprobs=N: the prompt's tokens open the logprobs, N alternatives each
    echo_top: int | None = None
    prompt_top: int | None = None  # vLLM's prompt_logprobs=N: choice.prompt_logprobs
    prompt_only: bool = False  # echo with max_tokens=0: the prompt alone, no output token
    tool_parser: str | None = None  # chat with tools and tool_choice=auto: parse replies
    forced_call: ForcedCall | None = None  # tool_choice required / a named function
    guide_param: str = ""  # the body field params.guide came from (a 400 names it)
    return_token_ids: bool = False  # vLLM's: prompt_token_ids and each choice's token_ids
    tokens_as_ids: bool = False  # return_tokens_as_token_ids: logprobs name "token_id:N"
    # the response id's base (vLLM's: the X-Request-Id header, else the body's request_id;
    # "": a random one)
    request_id: str = ""

    def choice_params(self, index: int) -> SamplingParams:
        """Choice ``index``'s parameters: a seeded request derives seed + index (wrapping in
        the seed range), so the n choices differ and each is reproducible."""
        seed = self.params.seed
        if index == 0 or seed is None:
            return self.params
        low, high = SEED_RANGE
        return msgspec.structs.replace(self.params,
                                       seed=(seed + index - low) % (high - low + 1) + low)


def _reject_unsupported(f: Fields, kind: str) -> None:
    for name in UNSUPPORTED_EXTRAS:
        f.require_absent(name, NO_OP_EXTRAS.get(name, ()))
    if kind == "completion":
        f.require_absent("suffix", ("",), "suffix")
    elif f.has("prompt_logprobs"):
        raise bad_param("prompt_logprobs", "is only supported on /v1/completions")


def _n(f: Fields) -> int:
    n = f.integer("n", 1, low=1, high=MAX_N) or 1
    best_of = f.integer("best_of", None, low=1)
    if best_of is not None and best_of != n:
        raise bad_param("best_of", f"only best_of = n ({n}) is supported, got {best_of}")
    return n


def _logprobs(f: Fields, kind: str) -> tuple[bool, int]:
    """(chosen-token logprobs wanted, alternatives per token)."""
    if kind == "completion":
        n = f.integer("logprobs", None, low=0, high=MAX_LOGPROBS)
        return n is not None, n or 0
    wanted = f.boolean("logprobs", False)
    top = f.integer("top_logprobs", 0, low=0, high=MAX_LOGPROBS) or 0
    if top and not wanted:
        raise bad_param("top_logprobs", "requires logprobs=true")
    return wanted, top


def _logit_bias(f: Fields, vocab_size: int) -> dict[int, float]:
    value = f.obj("logit_bias")
    if not value:
        return {}
    if len(value) > MAX_LOGIT_BIAS:
        raise bad_param("logit_bias", f"at most {MAX_LOGIT_BIAS} entries, got {len(value)}")
    out: dict[int, float] = {}
    for key, bias in value.items():
        try:
            tok = int(key)
        except ValueError:
            raise bad_param("logit_bias", f"key {key!r} is not a token id") from None
        if not 0 <= tok < vocab_size:
            raise bad_param("logit_bias", f"token id {tok} is outside the vocabulary "
                                          f"[0, {vocab_size})")
        if isinstance(bias, bool) or not isinstance(bias, int | float) or bias != bias:
            raise bad_param(f"logit_bias.{key}", "expected a number")
        out[tok] = min(100.0, max(-100.0, float(bias)))  # clamped, as vLLM and OpenAI do
    return out


def context_exceeded(num_tokens: int, max_model_len: int, param: str) -> APIError:
    return APIError(
        f"the prompt has {num_tokens} tokens but the context is {max_model_len} tokens "
        "(max_model_len), leaving no room for output; shorten the prompt",
        param=param,
        code="context_length_exceeded",
    )


def _max_tokens(
    f: Fields, kind: str, prompt: Prompt, max_model_len: int, defaults: GenerationDefaults,
    echo: bool = False,
) -> int:
    """The output budget; 0 only for an echo (the prompt and its logprobs, vLLM's rule)."""
    room = max_model_len - len(prompt.ids)
    if room <= 0:
        raise context_exceeded(len(prompt.ids), max_model_len, prompt.param)
    name = "max_tokens"
    if kind == "chat" and f.has("max_completion_tokens"):
        name = "max_completion_tokens"
    value = f.integer(name, None)
    if value is None:  # vLLM: completions 16 (the rest if sent as null), chat the rest; both
        # capped by max_new_tokens
        left_out = name not in f.body
        default = DEFAULT_COMPLETION_MAX_TOKENS if kind == "completion" and left_out else room
        return min(default, room, defaults.max_tokens or room)
    if value < (0 if echo else 1):
        raise bad_param(name, f"must be >= {0 if echo else 1}, got {value}")
    if value > room:
        raise APIError(
            f"{name}: {value} output tokens plus the prompt's {len(prompt.ids)} tokens exceed "
            f"the context of {max_model_len} tokens; ask for at most {room}",
            param=name,
            code="context_length_exceeded",
        )
    return value


def _prompt_logprobs(f: Fields, kind: str, echo: bool) -> tuple[int | None, int | None]:
    """(echo_top, prompt_top): completions echo + logprobs=N, and vLLM's prompt_logprobs=N."""
    if kind != "completion":
        return None, None
    echo_top = f.integer("logprobs", None, low=0, high=MAX_LOGPROBS) if echo else None
    return echo_top, f.integer("prompt_logprobs", None, low=0, high=MAX_LOGPROBS)


def _sampling(
    f: Fields, kind: str, max_tokens: int, vocab_size: int, defaults: GenerationDefaults,
    stop_ids: list[int], ignore_eos: bool, guide: Guide | None, prompt_logprobs: int | None,
) -> SamplingParams:
    d = defaults
    top_k = f.integer("top_k", d.top_k if d.top_k is not None else 0, low=-1)
    logprobs, top_logprobs = _logprobs(f, kind)
    return SamplingParams(
        max_tokens=max(1, max_tokens),  # 0 (echo only): one token is sampled and dropped
        temperature=f.number("temperature", _or(d.temperature, 1.0), low=0.0),
        top_p=f.number("top_p", _or(d.top_p, 1.0), low=0.0, high=1.0, low_open=True),
        top_k=min(max(0, top_k or 0), 2**31 - 1),  # past the vocabulary all are one
        seed=f.integer("seed", None, low=SEED_RANGE[0], high=SEED_RANGE[1]),
        stop_token_ids=stop_ids,
        ignore_eos=ignore_eos,
        logprobs=logprobs,
        min_tokens=f.integer("min_tokens", 0, low=0, high=max_tokens) or 0,
        presence_penalty=f.number("presence_penalty", 0.0, low=-2.0, high=2.0),
        frequency_penalty=f.number("frequency_penalty", 0.0, low=-2.0, high=2.0),
        repetition_penalty=f.number("repetition_penalty", _or(d.repetition_penalty, 1.0),
                                    low=0.0, low_open=True, high=100.0),
        min_p=f.number("min_p", _or(d.min_p, 0.0), low=0.0, high=1.0),
        logit_bias=_logit_bias(f, vocab_size),
        top_logprobs=top_logprobs,
        guide=guide,
        prompt_logprobs=prompt_logprobs,
    )


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def parse_request(
    f: Fields,
    kind: Literal["completion", "chat"],
    prompt: Prompt,
    *,
    model: str,
    max_model_len: int,
    vocab_size: int,
    extra_stop_ids: tuple[int, ...] = (),
    defaults: GenerationDefaults | None = None,
    tool_parser: str | None = None,
    forced_call: ForcedCall | None = None,
) -> GenRequest:
    """Validate the sampling fields of ``f`` for an already tokenized ``prompt``."""
    defaults = defaults or GenerationDefaults()
    _reject_unsupported(f, kind)
    guide, guide_param = parse_guide(f)
    if forced_call is not None:
        if guide is not None:
            raise bad_param(guide_param, "cannot be combined with tool_choice 'required' or a "
                                         "named function (the call is the structured output)")
        guide, guide_param = forced_call.guide, "tools"
    n = _n(f)
    stream = f.boolean("stream", False)
    options = f.obj("stream_options")
    if options is not None and not stream:
        raise bad_param("stream_options", "only allowed when stream is true")
    include_usage = (options or {}).get("include_usage") or False
    if not isinstance(include_usage, bool):
        raise bad_param("stream_options.include_usage", "expected true or false")
    continuous_usage = (options or {}).get("continuous_usage_stats") or False
    if not isinstance(continuous_usage, bool):
        raise bad_param("stream_options.continuous_usage_stats", "expected true or false")
    echo_text = (prompt.echo_text or prompt.text) if kind == "completion" else (
        prompt.final_assistant)
    echo = f.boolean("echo", False) and (kind == "completion" or bool(echo_text))
    prompt_echo = echo and kind == "completion"  # the prompt's logprobs and max_tokens 0 too
    max_tokens = _max_tokens(f, kind, prompt, max_model_len, defaults, prompt_echo)
    ignore_eos = f.boolean("ignore_eos", False)
    stop_ids = f.token_ids("stop_token_ids", vocab_size=vocab_size, max_items=MAX_STOP_TOKEN_IDS)
    if not ignore_eos:
        stop_ids += [i for i in extra_stop_ids if i not in stop_ids]
    echo_top, prompt_top = _prompt_logprobs(f, kind, prompt_echo)
    wanted = [k for k in (echo_top, prompt_top) if k is not None]
    params = _sampling(f, kind, max_tokens, vocab_size, defaults, stop_ids, ignore_eos, guide,
                       max(wanted) if wanted else None)
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
        continuous_usage=include_usage and continuous_usage,  # vLLM: only with include_usage
        logprobs=params.logprobs,
        true_output_len=f.integer("true_output_len", None, low=0, high=2**31 - 1),
        n=n,
        include_stop_str=f.boolean("include_stop_str_in_output", False),
        # the Hermes and Mistral call tags are special tokens in many tokenizers (Qwen2.5,
        # Mistral): the parser must see them (vLLM turns skipping off for these parsers too)
        skip_special_tokens=(f.boolean("skip_special_tokens", True)
                             and tool_parser not in TAGS_ARE_SPECIAL),
        echo=echo,
        echo_text=echo_text if echo else "",
        echo_top=echo_top,
        prompt_top=prompt_top,
        prompt_only=max_tokens == 0,
        tool_parser=tool_parser,
        forced_call=forced_call,
        guide_param=guide_param,
        return_token_ids=f.boolean("return_token_ids", False),
        request_id=(f.string("request_id", "") or "")[:MAX_REQUEST_ID],
        tokens_as_ids=f.boolean("return_tokens_as_token_ids", False),
    )

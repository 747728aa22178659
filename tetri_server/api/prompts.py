"""Prompts -> token ids: completion prompts (text or ids) and chat messages (chat template).

Completion text is encoded with the tokenizer's special tokens (BOS), as vLLM does. Chat
messages are rendered with the tokenizer's chat template, which already carries the BOS token,
and then encoded without adding special tokens again.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tetri_server.api.errors import APIError, bad_param
from tetri_server.api.fields import Fields, is_int
from tetri_server.api.params import Prompt, context_exceeded

ROLES = ("system", "developer", "user", "assistant", "tool")
# End-of-turn markers of common chat templates: a chat reply stops there unless ignore_eos.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")
MAX_MESSAGES = 4096
MAX_CONTENT_PARTS = 1024  # per message
MAX_TEMPLATE_KWARGS = 32
MAX_TOOL_CALLS = 128  # per assistant message
MAX_NAME_CHARS = 256  # name, tool_call_id
MAX_BATCH_PROMPTS = 64  # prompts in one /v1/completions request (times n: backend requests)
# apply_chat_template's own parameters: a request must not swap the template or its output
RESERVED_TEMPLATE_KWARGS = frozenset((
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize", "padding",
    "truncation", "max_length",
    "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs",
    "tokenizer"))
# A token covers at most its own length in characters, times this: a normalizer (NFC) may
# compose several input characters into one.
CHARS_PER_TOKEN_CHAR = 4


@dataclass(frozen=True)
class PromptLimits:
    """What a prompt must fit; checked before tokenizing (length) and after (ids)."""

    vocab_size: int  # token ids must be below this: rows of the model's embedding
    max_model_len: int  # context in tokens
    max_chars: int  # text longer than this cannot fit in max_model_len tokens

    @classmethod
    def of(cls, tokenizer: Any, *, vocab_size: int, max_model_len: int) -> PromptLimits:
        longest = max(map(len, tokenizer.get_vocab()), default=1)
        max_chars = max_model_len * longest * CHARS_PER_TOKEN_CHAR
        return cls(vocab_size=vocab_size, max_model_len=max_model_len, max_chars=max_chars)


def end_of_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    vocab = tokenizer.get_vocab()
    return tuple(vocab[t] for t in END_OF_TURN if t in vocab)


def _check_ids(ids: list[Any], param: str, limits: PromptLimits) -> list[int]:
    if not ids:
        raise bad_param(param, "the prompt is empty")
    if len(ids) >= limits.max_model_len:
        raise context_exceeded(len(ids), limits.max_model_len, param)
    vocab = limits.vocab_size
    for i, tok in enumerate(ids):
        if not is_int(tok):
            raise bad_param(param, f"token {i} is not an integer")
        if not 0 <= tok < vocab:
            raise bad_param(param, f"token id {tok} is outside the vocabulary [0, {vocab})")
    return ids


def check_text_length(num_chars: int, param: str, limits: PromptLimits) -> None:
    if num_chars > limits.max_chars:
        raise APIError(
            f"the prompt has {num_chars} characters, more than can fit in the context of "
            f"{limits.max_model_len} tokens (max_model_len); shorten the prompt",
            param=param,
            code="context_length_exceeded",
        )


def _check_encoded(ids: list[int], param: str, limits: PromptLimits) -> list[int]:
    """The tokenizer may know more tokens than the model has embeddings for."""
    top = max(ids, default=0)
    if top >= limits.vocab_size:
        raise bad_param(
            param,
            f"the text encodes to token id {top}, outside the model's vocabulary "
            f"[0, {limits.vocab_size}) (the tokenizer is larger than the model)",
        )
    return ids


def encode(tokenizer: Any, text: str, param: str, *, add_special_tokens: bool) -> list[int]:
    """``tokenizer.encode``; text it cannot encode (a lone surrogate such as ``"\\ud800"``
    makes it raise) is a 400 naming ``param``, not a 500."""
    try:
        return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
    except Exception as e:
        raise bad_param(param, f"the tokenizer cannot encode this text ({type(e).__name__}: "
                               f"{str(e)[:200]})") from None


def _one_completion_prompt(
    value: Any, param: str, tokenizer: Any, limits: PromptLimits, add_special_tokens: bool
) -> Prompt:
    if isinstance(value, str):
        check_text_length(len(value), param, limits)
        ids = encode(tokenizer, value, param, add_special_tokens=add_special_tokens)
        if not ids:
            raise bad_param(param, "the prompt is empty")
        return Prompt(_check_encoded(ids, param, limits), value, param)
    if isinstance(value, list):
        ids = _check_ids(value, param, limits)
        # echo as vLLM: special tokens kept (its text_offsets name every token)
        return Prompt(ids, tokenizer.decode(ids, skip_special_tokens=True), param,
                      echo_text=tokenizer.decode(ids))
    raise bad_param(param, "expected a string, a list of token ids, or a list of those")


def completion_prompts(f: Fields, tokenizer: Any, limits: PromptLimits) -> list[Prompt]:
    """``prompt``: a string, a list of token ids, or a batch (a list of strings or of token id
    lists, at most ``MAX_BATCH_PROMPTS``); each is checked alone and named ``prompt[i]``."""
    value = f.raw("prompt")
    if value is None:
        raise bad_param("prompt", "this field is required")
    special = f.boolean("add_special_tokens", True)  # vLLM's: the BOS before a text prompt
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        if len(value) > MAX_BATCH_PROMPTS:
            raise bad_param("prompt", f"at most {MAX_BATCH_PROMPTS} prompts in a batch, "
                                      f"got {len(value)}")
        check_text_length(sum(len(v) for v in value if isinstance(v, str)), "prompt", limits)
        if len(value) == 1:
            return [_one_completion_prompt(value[0], "prompt", tokenizer, limits, special)]
        return [_one_completion_prompt(v, f"prompt[{i}]", tokenizer, limits, special)
                for i, v in enumerate(value)]
    return [_one_completion_prompt(value, "prompt", tokenizer, limits, special)]


def _content(msg: dict[str, Any], i: int) -> str:
    content = msg.get("content")
    param = f"messages[{i}].content"
    if content is None:
        if msg.get("role") == "assistant":
            return ""
        raise bad_param(param, "this field is required")
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_param(param, "expected a string or a list of content parts")
    if len(content) > MAX_CONTENT_PARTS:
        raise bad_param(param, f"at most {MAX_CONTENT_PARTS} content parts, got {len(content)}")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad_param(f"{param}[{j}]", "only parts of type 'text' are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_param(f"{param}[{j}].text", "expected a string")
        texts.append(text)
    return "\n".join(texts)  # as vLLM joins them for a template that takes a string


def _messages(f: Fields) -> list[dict[str, str]]:
    value = f.raw("messages")
    if value is None:
        raise bad_param("messages", "this field is required")
    if not isinstance(value, list) or not value:
        raise bad_param("messages", "expected a non-empty list of messages")
    if len(value) > MAX_MESSAGES:
        raise bad_param("messages", f"at most {MAX_MESSAGES} messages, got {len(value)}")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise bad_param(f"messages[{i}]", "expected an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in ROLES:
            raise bad_param(f"messages[{i}].role", f"{role!r} is not one of: " + ", ".join(ROLES))
        out.append({"role": role, "content": _content(msg, i), **_tool_fields(msg, i)})
    return out


def _short_string(msg: dict[str, Any], key: str, param: str) -> str | None:
    value = msg.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or len(value) > MAX_NAME_CHARS:
        raise bad_param(param, f"expected a string of at most {MAX_NAME_CHARS} characters")
    return value


def _tool_fields(msg: dict[str, Any], i: int) -> dict[str, Any]:
    """``name``, ``tool_call_id`` and assistant ``tool_calls`` kept for the chat template (as
    vLLM: a call's JSON ``arguments`` string becomes an object, which templates expect)."""
    out: dict[str, Any] = {}
    for key in ("name", "tool_call_id"):
        value = _short_string(msg, key, f"messages[{i}].{key}")
        if value is not None:
            out[key] = value
    calls = msg.get("tool_calls")
    if calls is None:
        return out
    param = f"messages[{i}].tool_calls"
    if not isinstance(calls, list):
        raise bad_param(param, "expected a list")
    if len(calls) > MAX_TOOL_CALLS:
        raise bad_param(param, f"at most {MAX_TOOL_CALLS} calls, got {len(calls)}")
    kept = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise bad_param(f"{param}[{j}]", "expected {'type': 'function', 'function': "
                                             "{'name': ..., 'arguments': ...}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                pass  # not JSON: the template gets the text as sent
        kept.append({"id": call.get("id"), "type": "function",
                     "function": {"name": fn["name"], "arguments": args}})
    out["tool_calls"] = kept
    return out


def _template_kwargs(f: Fields) -> dict[str, Any]:
    """vLLM's chat extras: ``add_generation_prompt`` (default true), ``continue_final_message``
    and ``chat_template_kwargs`` (variables for the template, e.g. ``enable_thinking``)."""
    extra = f.obj("chat_template_kwargs") or {}
    if len(extra) > MAX_TEMPLATE_KWARGS:
        raise bad_param("chat_template_kwargs", f"at most {MAX_TEMPLATE_KWARGS} entries")
    for key in extra:
        if key in RESERVED_TEMPLATE_KWARGS:
            raise bad_param(f"chat_template_kwargs.{key}", "is set by the server")
    # the two switches may come in chat_template_kwargs too, over the top-level fields (vLLM
    # applies chat_template_kwargs last)
    inner = Fields(extra)
    kwargs = dict(extra)
    continue_final = inner.boolean("continue_final_message",
                                   f.boolean("continue_final_message", False))
    add_prompt = inner.boolean("add_generation_prompt",
                               f.boolean("add_generation_prompt", not continue_final))
    if continue_final and add_prompt:
        raise bad_param("continue_final_message",
                        "cannot be combined with add_generation_prompt=true")
    kwargs["continue_final_message"] = continue_final
    kwargs["add_generation_prompt"] = add_prompt
    documents = f.raw("documents")  # retrieval templates (Command-R, Granite): vLLM's field
    if documents is not None:
        if (not isinstance(documents, list) or len(documents) > MAX_MESSAGES
                or not all(isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str)
                                                       for k, v in d.items())
                           for d in documents)):
            raise bad_param("documents", "expected a list of objects of strings")
        kwargs["documents"] = documents
    return kwargs


def chat_prompt(
    f: Fields, tokenizer: Any, limits: PromptLimits, tools: list[dict[str, Any]] | None = None
) -> Prompt:
    """Render ``messages`` (and ``tools``, checked by ``tools.parse_tools``) with the model's
    chat template and tokenize."""
    messages = _messages(f)
    num_chars = sum(len(m["content"]) + len(str(m.get("tool_calls", ""))) for m in messages)
    check_text_length(num_chars, "messages", limits)
    kwargs = _template_kwargs(f)
    if tools:
        kwargs["tools"] = tools
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)
    except Exception as e:  # a template may reject a message order (jinja raise_exception)
        raise bad_param("messages", f"the chat template rejected these messages: {e}") from None
    # the template writes the BOS; add_special_tokens (vLLM's, default false) adds another
    ids = _check_encoded(encode(tokenizer, text, "messages", add_special_tokens=f.boolean(
        "add_special_tokens", False)), "messages", limits)
    user_text = "\n".join(m["content"] for m in messages if m["role"] == "user")
    final = messages[-1]["content"] if messages and messages[-1]["role"] == "assistant" else ""
    return Prompt(ids, user_text, "messages", final)

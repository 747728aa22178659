"""Prompts -> token ids: completion prompts (text or ids) and chat messages (chat template).

Completion text is encoded with the tokenizer's special tokens (BOS), as vLLM does. Chat
messages are rendered with the tokenizer's chat template, which already carries the BOS token,
and then encoded without adding special tokens again.
"""

from __future__ import annotations

from typing import Any

from tetri_server.api.errors import APIError, bad_param
from tetri_server.api.fields import Fields, is_int
from tetri_server.api.params import Prompt

ROLES = ("system", "developer", "user", "assistant", "tool")
# End-of-turn markers of common chat templates: a chat reply stops there unless ignore_eos.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>")


def vocab_size(tokenizer: Any) -> int:
    return len(tokenizer)


def end_of_turn_ids(tokenizer: Any) -> tuple[int, ...]:
    vocab = tokenizer.get_vocab()
    return tuple(vocab[t] for t in END_OF_TURN if t in vocab)


def _check_ids(ids: list[Any], param: str, vocab: int) -> list[int]:
    if not ids:
        raise bad_param(param, "the prompt is empty")
    for i, tok in enumerate(ids):
        if not is_int(tok):
            raise bad_param(param, f"token {i} is not an integer")
        if not 0 <= tok < vocab:
            raise bad_param(param, f"token id {tok} is outside the vocabulary [0, {vocab})")
    return ids


def completion_prompt(f: Fields, tokenizer: Any) -> Prompt:
    """``prompt``: a string, a list of token ids, or a list holding one of those."""
    value = f.raw("prompt")
    if value is None:
        raise bad_param("prompt", "this field is required")
    if isinstance(value, list) and value and isinstance(value[0], str | list):
        if len(value) > 1:
            raise bad_param(
                "prompt",
                f"batches of prompts are not supported (got {len(value)}); "
                "send one prompt per request",
            )
        value = value[0]
    if isinstance(value, str):
        ids = tokenizer.encode(value, add_special_tokens=True)
        if not ids:
            raise bad_param("prompt", "the prompt is empty")
        return Prompt(ids, value, "prompt")
    if isinstance(value, list):
        ids = _check_ids(value, "prompt", vocab_size(tokenizer))
        return Prompt(ids, tokenizer.decode(ids, skip_special_tokens=True), "prompt")
    raise bad_param("prompt", "expected a string, a list of token ids, or a list of one of those")


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
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") != "text":
            raise bad_param(f"{param}[{j}]", "only parts of type 'text' are supported")
        text = part.get("text")
        if not isinstance(text, str):
            raise bad_param(f"{param}[{j}].text", "expected a string")
        texts.append(text)
    return "".join(texts)


def _messages(f: Fields) -> list[dict[str, str]]:
    value = f.raw("messages")
    if value is None:
        raise bad_param("messages", "this field is required")
    if not isinstance(value, list) or not value:
        raise bad_param("messages", "expected a non-empty list of messages")
    out = []
    for i, msg in enumerate(value):
        if not isinstance(msg, dict):
            raise bad_param(f"messages[{i}]", "expected an object with 'role' and 'content'")
        role = msg.get("role")
        if role not in ROLES:
            raise bad_param(f"messages[{i}].role", f"{role!r} is not one of: " + ", ".join(ROLES))
        out.append({"role": role, "content": _content(msg, i)})
    return out


def chat_prompt(f: Fields, tokenizer: Any) -> Prompt:
    """Render ``messages`` with the model's chat template and tokenize."""
    messages = _messages(f)
    if not getattr(tokenizer, "chat_template", None):
        raise APIError("this model has no chat template; use /v1/completions", param="messages")
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception as e:  # a template may reject a message order (jinja raise_exception)
        raise bad_param("messages", f"the chat template rejected these messages: {e}") from None
    ids = tokenizer.encode(text, add_special_tokens=False)
    user_text = "\n".join(m["content"] for m in messages if m["role"] == "user")
    return Prompt(ids, user_text, "messages")

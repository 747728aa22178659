"""Incremental detokenization that never emits a broken character, and stop-string matching.

Byte-level BPE splits multi-byte UTF-8 characters across tokens: decoding a prefix of such a
token run yields U+FFFD. ``IncrementalDetokenizer`` holds such a tail back until the character
is complete; ``StreamDetokenizer`` does the same with ``tokenizers``' ``DecodeStream`` (in Rust)
and is what ``make_detokenizer`` picks for a fast tokenizer. A tail still broken when the
output ends (``max_tokens`` reached within a character) is never sent, as in vLLM.
``StopMatcher`` holds back the last ``len(longest stop) - 1`` characters so no part of a stop
string is ever sent, and cuts the text right before the first stop string found.
"""

from __future__ import annotations

from typing import Any

REPLACEMENT = "\ufffd"
# While a decode ends in U+FFFD, everything before that trailing run is sent and the run is held.
# Valid text holds at most 3 tokens (a character has at most 4 bytes); only invalid bytes (a
# random model) hold longer, and past this many tokens the run is sent as U+FFFD so the
# decode window stays small.
MAX_HELD_TOKENS = 64
# Prompt tokens decoded as left context, so the first output token keeps its leading space
# (SentencePiece-style tokenizers drop it at the start of a decode).
CONTEXT_TOKENS = 5
# What ``DecodeStream.step`` raises when a token changes text it already returned (byte-fallback
# tokenizers: a run of ``<0xNN>`` tokens that is not valid UTF-8 decodes to U+FFFD as a whole,
# so a stray continuation byte after a sent "é" takes the "é" back). vLLM resets its stream.
INVALID_PREFIX = "Invalid prefix encountered"


def whole_context(decode: Any, context: list[int]) -> tuple[int, str]:
    """How many of the prompt's last tokens a decode may start from (its text must not end in
    U+FFFD, or the decode stream takes it all for unsent), and the text the prompt shows of
    the tokens after those (``PromptTail``)."""
    k = len(context)
    while k > 0 and decode(context[:k]).endswith(REPLACEMENT):
        k -= 1
    return k, (decode(context)[len(decode(context[:k])):] if k < len(context) else "")


class PromptTail:
    """The text a prompt shows of its last tokens when it ends in U+FFFD: part of a character
    its output may complete (a prompt given as token ids cut inside one), a byte that stays
    invalid, or a U+FFFD of the text itself. The output's text starts with what the output did
    not change of it, which was the prompt's and is not sent again."""

    def __init__(self, text: str) -> None:
        self._left = text

    def strip(self, text: str) -> str:
        left = self._left
        if not text or not left:
            return text
        n = 0
        while n < min(len(text), len(left)) and text[n] == left[n]:
            n += 1
        if n == len(text) < len(left):  # all of it the prompt's so far: more may follow
            self._left = left[n:]
            return ""
        self._left = ""
        return text[n:]


class IncrementalDetokenizer:
    """Token ids in, text pieces out; the concatenated pieces equal decoding all ids at once
    (for valid UTF-8), less any U+FFFD that ends it at ``final`` (a character the output cut).
    Special tokens are skipped unless ``skip_special_tokens`` is false."""

    def __init__(
        self, tokenizer: Any, prompt_ids: list[int], *, skip_special_tokens: bool = True
    ) -> None:
        self._tok = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_ids[-CONTEXT_TOKENS:])
        self._prefix = 0  # ids[prefix:read] is decoded context whose text was already emitted
        self._read, tail = whole_context(self._decode, self._ids)
        self._tail = PromptTail(tail)
        self._partial = 0  # characters beyond the decoded context already emitted (held tail)

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special)

    def add(self, token_ids: list[int], *, final: bool = False) -> str:
        """Append tokens; return the text that is now safe to send (``final`` flushes all)."""
        return self._tail.strip(self._add(token_ids, final))

    def _add(self, token_ids: list[int], final: bool) -> str:
        self._ids.extend(token_ids)
        if len(self._ids) == self._read and not final:
            return ""
        base = self._decode(self._ids[self._prefix : self._read])
        full = self._decode(self._ids[self._prefix :])
        new = full[len(base) :]
        held = len(self._ids) - self._read
        if not final and new.endswith(REPLACEMENT) and held < MAX_HELD_TOKENS:
            stable = new.rstrip(REPLACEMENT)
            out = stable[self._partial :]
            self._partial = max(self._partial, len(stable))
            return out
        out = (new.rstrip(REPLACEMENT) if final else new)[self._partial :]
        # a chunk that decodes to nothing (a skipped special token) is no left context; the
        # window stays bounded all the same
        if new or self._read - self._prefix > CONTEXT_TOKENS + MAX_HELD_TOKENS:
            self._prefix = self._read
        self._read, self._partial = len(self._ids), 0
        return out


class StreamDetokenizer:
    """``IncrementalDetokenizer``'s contract on ``tokenizers``' ``DecodeStream`` (the decoder
    pipeline in Rust, one call per token). A run of tokens that stays undecodable (invalid
    bytes from a random model) past ``MAX_HELD_TOKENS``, or one still held at the end, goes to
    an ``IncrementalDetokenizer`` from there on, which sends it as U+FFFD."""

    def __init__(self, tokenizer: Any, prompt_ids: list[int], *,
                 skip_special_tokens: bool = True) -> None:
        from tokenizers.decoders import DecodeStream

        self._tok = tokenizer
        self._fast = tokenizer._tokenizer
        self._skip_special = skip_special_tokens
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        k, tail = whole_context(
            lambda ids: tokenizer.decode(ids, skip_special_tokens=skip_special_tokens), context)
        self._tail = PromptTail(tail)
        self._stream = DecodeStream(ids=context[:k], skip_special_tokens=skip_special_tokens)
        self._sent = context[:k]  # the last ids whose text was sent: the fallback's context
        self._held: list[int] = []
        self._fallback: IncrementalDetokenizer | None = None
        try:
            for t in context[k:]:  # the output goes on from them (and may complete a character)
                if self._stream.step(self._fast, t) is None:
                    self._held.append(t)
                else:  # (not expected: its text ended in U+FFFD) the prompt's text
                    self._sent = (self._sent + self._held + [t])[-CONTEXT_TOKENS:]
                    self._held = []
        except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception
            if INVALID_PREFIX not in str(e):
                raise
            self._tail = PromptTail("")  # the Python detokenizer strips its own
            self._fallback = IncrementalDetokenizer(tokenizer, prompt_ids,
                                                    skip_special_tokens=skip_special_tokens)

    def add(self, token_ids: list[int], *, final: bool = False) -> str:
        return self._tail.strip(self._add(token_ids, final))

    def _add(self, token_ids: list[int], final: bool) -> str:
        if self._fallback is not None:
            return self._fallback.add(token_ids, final=final)
        out = []
        for i, t in enumerate(token_ids):
            try:
                piece = self._stream.step(self._fast, t)
            except Exception as e:  # noqa: BLE001 - tokenizers raises a plain Exception
                if INVALID_PREFIX not in str(e):
                    raise
                return "".join(out) + self._to_fallback(token_ids[i:], final)
            if piece is None:
                self._held.append(t)
                if len(self._held) >= MAX_HELD_TOKENS:
                    return "".join(out) + self._to_fallback(token_ids[i + 1:], final)
                continue
            out.append(piece)
            self._sent = (self._sent + self._held + [t])[-CONTEXT_TOKENS:]
            self._held = []
        if final and self._held:
            out.append(self._to_fallback([], final))
        return "".join(out)

    def _to_fallback(self, rest: list[int], final: bool) -> str:
        self._fallback = IncrementalDetokenizer(self._tok, self._sent,
                                                skip_special_tokens=self._skip_special)
        held, self._held = self._held, []
        return self._fallback.add(held + rest, final=final)


def make_detokenizer(
    tokenizer: Any, prompt_ids: list[int], *, skip_special_tokens: bool = True
) -> StreamDetokenizer | IncrementalDetokenizer:
    """``DecodeStream`` where the tokenizer is a ``tokenizers`` one that supports it, else the
    Python ``IncrementalDetokenizer``."""
    if getattr(tokenizer, "_tokenizer", None) is not None:
        try:
            return StreamDetokenizer(tokenizer, prompt_ids,
                                     skip_special_tokens=skip_special_tokens)
        except (ImportError, TypeError):  # tokenizers without DecodeStream(ids=...)
            pass
    return IncrementalDetokenizer(tokenizer, prompt_ids, skip_special_tokens=skip_special_tokens)


class StopMatcher:
    """Cuts generated text before the first stop string; holds back possible stop prefixes.
    ``min_end``: characters of the output a match must end beyond (those of the first
    ``min_tokens`` tokens: vLLM matches no stop string before them)."""

    def __init__(self, stops: tuple[str, ...], *, include: bool = False) -> None:
        self._stops = stops
        self._include = include  # include_stop_str_in_output: the match ends the text
        self._hold = max((len(s) for s in stops), default=1) - 1
        self._pending = ""  # text not sent yet: it may be the start of a stop string
        self._sent = 0  # characters returned so far (where ``_pending`` starts)
        self.min_end = 0
        self.matched: str | None = None  # the stop string that matched

    @property
    def num_fed(self) -> int:
        """Characters fed so far (sent and held)."""
        return self._sent + len(self._pending)

    def feed(self, text: str, *, final: bool = False) -> tuple[str, bool]:
        """Return (text to send now, whether a stop string matched). After a match the text
        sent so far is the whole output."""
        pending = self._pending + text
        floor = self.min_end - self._sent  # a match must end past this index of ``pending``
        hits = [(i, i + len(s)) for i, s in
                ((pending.find(s, max(0, floor - len(s) + 1)), s) for s in self._stops)
                if i >= 0]
        if hits:
            # the match that completes first, ties in list order: the same as feeding the text
            # a character at a time, however the tokens were grouped into deltas. (vLLM takes
            # the first listed stop found in a token's new text: it differs only where one
            # token completes two stop strings)
            self._pending = ""
            start, end = min(hits, key=lambda h: h[1])
            self.matched = pending[start:end]
            return pending[: end if self._include else start], True
        keep = 0 if final else min(len(pending), self._hold)
        self._pending = pending[len(pending) - keep :]
        self._sent += len(pending) - keep
        return pending[: len(pending) - keep], False


def token_texts(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each token's own text, for logprobs (a partial UTF-8 byte shows as U+FFFD)."""
    return [tokenizer.decode([t]) for t in token_ids]

"""OpenAI response shapes for /v1/completions and /v1/chat/completions, whole and streamed.

One ``ResponseBuilder`` per request keeps the id, creation time and the running text offset
(completion logprobs report each token's character offset in the output).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from tetri_server.api.detokenizer import token_texts
from tetri_server.api.generation import Piece
from tetri_server.api.params import GenRequest
from tetri_server.api.tools import ForcedCallParser, ReplyParser, ToolCall, make_parser
from tetri_server.messages import PromptLogprobs

Echoed = tuple[list[str], list[float | None], list[dict[str, float] | None]]


def usage(num_prompt: int, num_output: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
    }


class ResponseBuilder:
    """Builds the JSON objects of one request's response (``dict``s, encoded by the caller);
    ``num_choices`` choices (prompts x n), told apart by ``Piece.index``."""

    def __init__(self, req: GenRequest, tokenizer: Any, num_choices: int = 1,
                 prompt_ids: list[list[int]] | None = None) -> None:
        self.req = req
        # each choice's prompt (a completions batch has several; default: req's for all)
        self._prompt_ids = prompt_ids or [req.prompt_ids] * num_choices
        self.chat = req.kind == "chat"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        self.id = prefix + (req.request_id or uuid.uuid4().hex)
        self.created = int(time.time())
        self._tok = tokenizer
        self.num_choices = num_choices  # prompts x n
        self._text_offset = [0] * num_choices  # per choice
        self._num_output = [0] * num_choices  # tokens streamed so far, per choice
        self._ids_sent = [False] * num_choices  # return_token_ids: prompt ids sent, per choice
        # chat with tool_choice=auto: each choice's reply parsed for calls; with a forced call
        # the reply is the call (finish_reason: tool_calls, or stop for a named function)
        self._parsers: list[ReplyParser] | list[ForcedCallParser] | None = None
        self._call_reason = "tool_calls"
        if self.chat and req.forced_call is not None:
            self._parsers = [ForcedCallParser(req.forced_call) for _ in range(num_choices)]
            if req.forced_call.name is not None:
                self._call_reason = "stop"
        elif self.chat and req.tool_parser:
            self._parsers = [make_parser(req.tool_parser) for _ in range(num_choices)]

    def _names(self, token_ids: list[int]) -> list[str]:
        """Each token as logprobs name it: its own text, or "token_id:N" with vLLM's
        ``return_tokens_as_token_ids`` (a token whose bytes are no character stays apart)."""
        if self.req.tokens_as_ids:
            return [f"token_id:{t}" for t in token_ids]
        return token_texts(self._tok, token_ids)

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    def _echoed(self, index: int, prompt: PromptLogprobs | None) -> Echoed | None:
        """Completions echo + logprobs=N: the prompt's tokens, logprobs and N alternatives
        (OpenAI's and vLLM's shape: the first token has none)."""
        k = self.req.echo_top
        if k is None or prompt is None:
            return None
        texts = self._names(self._prompt_ids[index])
        tops: list[dict[str, float] | None] = [None]
        for t, lp, row in zip(texts[1:], prompt.logprobs, prompt.top, strict=True):
            alts = row[:k]
            d = dict(zip(self._names([i for i, _ in alts]), [v for _, v in alts], strict=True))
            d.setdefault(t, lp)  # the prompt's own token is always among them
            tops.append(d)
        return texts, [None, *prompt.logprobs], tops

    def _prompt_logprobs(self, index: int, prompt: PromptLogprobs | None) -> list[Any] | None:
        """vLLM's ``prompt_logprobs=N``: per prompt token (the first: null) a map of token id ->
        {logprob, rank, decoded_token}, the token itself and its N best alternatives."""
        if prompt is None:
            return None
        ids = self._prompt_ids[index]
        out: list[Any] = [None]
        k = self.req.prompt_top or 0
        for tok, lp, rank, row in zip(ids[1:], prompt.logprobs, prompt.ranks, prompt.top,
                                      strict=True):
            entry = {str(tok): {"logprob": lp, "rank": rank,
                                "decoded_token": token_texts(self._tok, [tok])[0]}}
            for r, (alt, v) in enumerate(row[:k], start=1):
                entry.setdefault(str(alt), {"logprob": v, "rank": r,
                                            "decoded_token": token_texts(self._tok, [alt])[0]})
            out.append(entry)
        return out

    def _logprobs(
        self,
        index: int,
        token_ids: list[int],
        logprobs: list[float] | None,
        top: list[list[tuple[int, float]]] | None,
        prompt: PromptLogprobs | None = None,
    ) -> Any:
        echoed = None if self.chat else self._echoed(index, prompt)
        if logprobs is None and echoed is None:
            return None
        logprobs = logprobs if logprobs is not None else []
        texts = self._names(token_ids)
        # alternatives per token; without them (a backend that does not report them) the chosen
        # token alone, as before
        alts: list[list[tuple[str, float]]] = []
        for k, (t, lp) in enumerate(zip(texts, logprobs, strict=True)):
            row = top[k] if top is not None and k < len(top) else []
            if self.req.params.top_logprobs and row:
                ids = [i for i, _ in row]
                alts.append(list(zip(self._names(ids), [v for _, v in row], strict=True)))
            else:
                alts.append([(t, lp)] if not self.chat else [])
        if self.chat:
            return {
                "content": [
                    {
                        "token": t,
                        "logprob": lp,
                        "bytes": list(t.encode("utf-8")),
                        "top_logprobs": [
                            {"token": a, "logprob": v, "bytes": list(a.encode("utf-8"))}
                            for a, v in alt
                        ],
                    }
                    for t, lp, alt in zip(texts, logprobs, alts, strict=True)
                ]
            }
        top_dicts: list[dict[str, float] | None] = []
        for t, lp, alt in zip(texts, logprobs, alts, strict=True):
            d = dict(alt)
            d.setdefault(t, lp)  # OpenAI: the chosen token is always in its own top_logprobs
            top_dicts.append(d)
        all_lps: list[float | None] = list(logprobs)
        spelled = token_ids
        if echoed is not None:
            texts, all_lps, top_dicts = (echoed[0] + texts, echoed[1] + all_lps,
                                         echoed[2] + top_dicts)
            spelled = self._prompt_ids[index] + token_ids
        offsets = []
        for t in (token_texts(self._tok, spelled) if self.req.tokens_as_ids else texts):
            offsets.append(self._text_offset[index])
            self._text_offset[index] += len(t)
        return {
            "tokens": texts,
            "token_logprobs": all_lps,
            "top_logprobs": top_dicts,
            "text_offset": offsets,
        }

    # ------------------------------------------------------------------ non-streaming

    def choice(self, index: int, pieces: list[Piece], finish_reason: str) -> dict[str, Any]:
        """One whole choice from its pieces."""
        text = "".join(p.text for p in pieces)
        logprobs = None
        prompt = pieces[0].prompt_logprobs if pieces else None
        if self.req.logprobs:
            ids = [t for p in pieces for t in p.token_ids]
            lps = [x for p in pieces for x in (p.logprobs or [])]
            tops = [x for p in pieces for x in (p.top_logprobs or [])]
            logprobs = self._logprobs(index, ids, lps[: len(ids)], tops or None, prompt)
        choice: dict[str, Any] = {"index": index}
        if self._parsers is not None:  # the echo opens the content, unparsed (vLLM)
            echo = "".join(p.text[: p.echo_len] for p in pieces)
            content, calls = self._parsers[index].feed(
                "".join(p.text[p.echo_len :] for p in pieces), final=True)
            content = echo + content
            choice["message"] = {"role": "assistant", "content": content or None,
                                 "tool_calls": [c.as_dict() for c in calls]}
            finish_reason = self._call_reason if calls else finish_reason
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        choice["stop_reason"] = pieces[-1].stop_reason if pieces else None
        if self.req.prompt_top is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(index, prompt)
        if self.req.return_token_ids:
            if not self.chat:
                choice["prompt_token_ids"] = self._prompt_ids[index]
            choice["token_ids"] = [t for p in pieces for t in p.token_ids]
        return choice

    def full(
        self, choices: list[dict[str, Any]], num_prompt: int, num_output: int
    ) -> dict[str, Any]:
        obj = "chat.completion" if self.chat else "text_completion"
        out = {**self._head(obj), "choices": choices, "usage": usage(num_prompt, num_output)}
        if self.chat and self.req.return_token_ids:  # chat: once, beside the choices (vLLM)
            out["prompt_token_ids"] = self._prompt_ids[0]
        return out

    # ------------------------------------------------------------------ streaming

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        """A chunk of one choice; its usage so far with ``continuous_usage_stats`` (vLLM's
        extension: clients count the tokens of a stream whose chunks may hold several)."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = {**self._head(obj), "choices": [choice]}
        if self.req.continuous_usage:
            i = choice["index"]
            out["usage"] = usage(len(self._prompt_ids[i]), self._num_output[i])
        elif self.req.include_usage:
            out["usage"] = None
        return out

    def role_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role of each choice (as OpenAI's do)."""
        if not self.chat:
            return []
        chunks = [
            self._chunk({"index": i, "delta": {"role": "assistant", "content": ""},
                         "logprobs": None, "finish_reason": None})
            for i in range(self.num_choices)
        ]
        if self.req.return_token_ids:  # the stream's first chunk only (vLLM)
            chunks[0]["prompt_token_ids"] = self._prompt_ids[0]
        return chunks

    def chunk(self, piece: Piece) -> dict[str, Any] | None:
        """The SSE chunk for one piece, or None when it carries nothing. A piece with tokens
        gets its chunk even when their text is held back (a partial character, the start of a
        stop string), with empty text, as vLLM sends it: streaming clients count chunks as
        tokens. Only a tool-call parser holding text back sends nothing (vLLM's too)."""
        self._num_output[piece.index] += len(piece.token_ids)
        prompt = piece.prompt_logprobs
        has_logprobs = ((piece.logprobs is not None and bool(piece.token_ids))
                        or (prompt is not None and self.req.echo_top is not None))
        if (not piece.text and not piece.token_ids and not has_logprobs
                and piece.finish_reason is None):
            return None
        logprobs = None
        if has_logprobs:
            logprobs = self._logprobs(piece.index, piece.token_ids, piece.logprobs,
                                      piece.top_logprobs, prompt)
        choice: dict[str, Any] = {"index": piece.index}
        reason = piece.finish_reason
        if self._parsers is not None:
            parser = self._parsers[piece.index]
            before = len(parser.calls)
            content, calls = parser.feed(piece.text[piece.echo_len :], final=reason is not None)
            content = piece.text[: piece.echo_len] + content
            choice["delta"] = {"content": content} if content else {}
            if calls:
                choice["delta"]["tool_calls"] = _call_deltas(calls, before)
            if reason is not None and parser.calls:
                reason = self._call_reason
            if (not choice["delta"] and reason is None and logprobs is None
                    and not (self.req.return_token_ids and piece.token_ids)):
                return None  # held back: may be the start of a call
        elif self.chat:
            choice["delta"] = ({"content": piece.text} if piece.text or piece.token_ids
                               else {})
        else:
            choice["text"] = piece.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = reason
        choice["stop_reason"] = piece.stop_reason
        if prompt is not None and self.req.prompt_top is not None:
            choice["prompt_logprobs"] = self._prompt_logprobs(piece.index, prompt)
        if self.req.return_token_ids:  # the delta's tokens; a completion's first chunk: prompt's
            if not self.chat and not self._ids_sent[piece.index]:
                choice["prompt_token_ids"] = self._prompt_ids[piece.index]
                self._ids_sent[piece.index] = True
            choice["token_ids"] = list(piece.token_ids)
        return self._chunk(choice)

    def usage_chunk(self, num_prompt: int, num_output: int) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: usage and no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(num_prompt, num_output)}


def _call_deltas(calls: list[ToolCall], first: int) -> list[dict[str, Any]]:
    """Streamed ``tool_calls`` entries, OpenAI's shape: each call whole in one delta."""
    return [{"index": first + k, **c.as_dict()} for k, c in enumerate(calls)]

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


def usage(num_prompt: int, num_output: int) -> dict[str, int]:
    return {
        "prompt_tokens": num_prompt,
        "completion_tokens": num_output,
        "total_tokens": num_prompt + num_output,
    }


class ResponseBuilder:
    """Builds the JSON objects of one request's response (``dict``s, encoded by the caller)."""

    def __init__(self, req: GenRequest, tokenizer: Any) -> None:
        self.req = req
        self.chat = req.kind == "chat"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        self.id = prefix + uuid.uuid4().hex
        self.created = int(time.time())
        self._tok = tokenizer
        self._text_offset = 0

    def _head(self, obj: str) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.req.model}

    def _logprobs(self, token_ids: list[int], logprobs: list[float] | None) -> Any:
        if logprobs is None:
            return None
        texts = token_texts(self._tok, token_ids)
        if self.chat:
            return {
                "content": [
                    {
                        "token": t,
                        "logprob": lp,
                        "bytes": list(t.encode("utf-8")),
                        "top_logprobs": [],
                    }
                    for t, lp in zip(texts, logprobs, strict=True)
                ]
            }
        offsets = []
        for t in texts:
            offsets.append(self._text_offset)
            self._text_offset += len(t)
        return {
            "tokens": texts,
            "token_logprobs": list(logprobs),
            "top_logprobs": [{t: lp} for t, lp in zip(texts, logprobs, strict=True)],
            "text_offset": offsets,
        }

    # ------------------------------------------------------------------ non-streaming

    def full(
        self, pieces: list[Piece], finish_reason: str, num_prompt: int, num_output: int
    ) -> dict[str, Any]:
        text = "".join(p.text for p in pieces)
        logprobs = None
        if self.req.logprobs:
            ids = [t for p in pieces for t in p.token_ids]
            lps = [x for p in pieces for x in (p.logprobs or [])]
            logprobs = self._logprobs(ids, lps[: len(ids)])
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = finish_reason
        obj = "chat.completion" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [choice], "usage": usage(num_prompt, num_output)}

    # ------------------------------------------------------------------ streaming

    def _chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        out = {**self._head(obj), "choices": [choice]}
        if self.req.include_usage:
            out["usage"] = None
        return out

    def role_chunk(self) -> dict[str, Any] | None:
        """Chat streams open with the assistant role (as OpenAI's do)."""
        if not self.chat:
            return None
        delta = {"role": "assistant", "content": ""}
        return self._chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": None})

    def chunk(self, piece: Piece) -> dict[str, Any] | None:
        """The SSE chunk for one piece, or None when it carries nothing a client would see."""
        has_logprobs = piece.logprobs is not None and bool(piece.token_ids)
        if not piece.text and not has_logprobs and piece.finish_reason is None:
            return None
        logprobs = self._logprobs(piece.token_ids, piece.logprobs) if has_logprobs else None
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"content": piece.text} if piece.text else {}
        else:
            choice["text"] = piece.text
        choice["logprobs"] = logprobs
        choice["finish_reason"] = piece.finish_reason
        return self._chunk(choice)

    def usage_chunk(self, num_prompt: int, num_output: int) -> dict[str, Any]:
        """The last chunk when ``stream_options.include_usage``: usage and no choices."""
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {**self._head(obj), "choices": [], "usage": usage(num_prompt, num_output)}

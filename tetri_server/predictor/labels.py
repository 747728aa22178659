"""Label prompts with the *served* model's own output lengths, through its OpenAI API.

A predictor must predict the lengths of the model it serves (the paper labelled ShareGPT
prompts with OPT-13B's outputs). ``label`` sends every prompt as one user message to
``POST {url}/v1/chat/completions`` (``endpoint = "completions"``: as raw text to
``/v1/completions``) with a ``max_tokens`` cap and records ``usage.completion_tokens`` — the
server's own count in the served model's tokenizer — so no tokenizer has to be guessed on this
side. Chat is the default: the prompts are chat turns, served through the model's chat template
(whose answers are not the length of a raw continuation), and the predictor reads a chat
request's user text, as it reads these prompts.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tetri_server.predictor.data import read_jsonl

Completer = Callable[[str], "int | None"]  # prompt -> output tokens; None: the server refused it


@dataclass(frozen=True)
class LabelRequest:
    """How each prompt is sent: the sampling settings the served traffic will use."""

    url: str  # server root, e.g. http://127.0.0.1:8000 (``/v1`` is appended if missing)
    model: str
    max_tokens: int = 1024
    temperature: float = 0.7
    top_p: float = 1.0
    timeout_s: float = 600.0
    endpoint: str = "chat"  # chat | completions


def openai_completer(req: LabelRequest) -> Completer:
    """A completer over the ``openai`` client (the package of the ``dev`` extra)."""
    from openai import BadRequestError, OpenAI

    base = req.url.rstrip("/")
    client = OpenAI(
        base_url=base if base.endswith("/v1") else base + "/v1",
        api_key="unused",
        timeout=req.timeout_s,
        max_retries=2,
    )

    if req.endpoint not in ("chat", "completions"):
        raise ValueError(f"endpoint must be chat or completions, got {req.endpoint!r}")

    def complete(prompt: str) -> int | None:
        try:
            return _count(prompt)
        except BadRequestError:  # a 400: this prompt (too long for the context), not the run
            return None

    def _count(prompt: str) -> int:
        out: Any
        if req.endpoint == "chat":
            out = client.chat.completions.create(
                model=req.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
            )
        else:
            out = client.completions.create(
                model=req.model,
                prompt=prompt,
                max_tokens=req.max_tokens,
                temperature=req.temperature,
                top_p=req.top_p,
            )
        if out.usage is None:
            raise RuntimeError(f"{req.url}: completion without usage; cannot count its tokens")
        return int(out.usage.completion_tokens)

    return complete


def read_prompts(path: str | Path, limit: int | None = None) -> list[tuple[str, str]]:
    """(prompt_id, prompt) pairs from a prompts JSONL(.gz) in the Arena format."""
    out: list[tuple[str, str]] = []
    for r in read_jsonl(path):
        out.append((str(r["prompt_id"]), str(r["prompt"])))
        if limit is not None and len(out) >= limit:
            break
    return out


def label(
    prompts: Sequence[tuple[str, str]], complete: Completer, concurrency: int = 8
) -> Iterator[tuple[str, str, int]]:
    """Yield (prompt_id, prompt, output_tokens) in input order, less the prompts the server
    refused (the completer's None); any other failed request raises."""
    with ThreadPoolExecutor(max_workers=max(1, concurrency)) as pool:
        lengths = pool.map(complete, [p for _, p in prompts])
        for (pid, prompt), n in zip(prompts, lengths, strict=True):
            if n is not None:
                yield pid, prompt, n

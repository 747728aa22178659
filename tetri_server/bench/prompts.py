"""Prompt bodies of an exact token length: random token ids, or real Arena text cut to size.

Token ids are the default: the server takes them as they are, so ``prompt_len`` is exact and no
tokenizer is needed (only the vocabulary size). Text prompts are made of real Arena prompts
joined together, tokenized with the served model's tokenizer, sliced at a seeded offset and
decoded; the slice is adjusted until re-encoding the text (with special tokens, as the server
will) gives the requested count, and the count actually reached is returned (never more than
requested).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Protocol, cast

import numpy as np

MAX_FIT_TRIES = 8  # slice-length adjustments per start offset
MAX_FIT_STARTS = 4  # start offsets tried before settling for the closest count below


class PromptTokenizer(Protocol):
    """The two calls we need; a Hugging Face tokenizer satisfies it."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...


def load_tokenizer(model_dir: str | Path) -> PromptTokenizer:
    """The served model's tokenizer (transformers is imported only here)."""
    from transformers import AutoTokenizer

    # the pool is tokenized in long pieces: lift the length limit so no warning is printed
    tok = AutoTokenizer.from_pretrained(str(model_dir), model_max_length=1 << 40)
    return cast(PromptTokenizer, tok)


class JsonTokenizer:
    """A model folder's ``tokenizer.json`` through the ``tokenizers`` library alone: the
    simulator's Arena workload (the simulator imports no torch; transformers would).
    Same ids as ``load_tokenizer`` where the folder's fast tokenizer is that file unchanged
    (tests/unit/test_sim_workload.py checks the bench model)."""

    def __init__(self, model_dir: str | Path) -> None:
        from tokenizers import Tokenizer

        path = Path(model_dir) / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{model_dir} has no tokenizer.json")
        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int]) -> str:
        return str(self._tok.decode(list(ids)))


def model_vocab(model_dir: str | Path) -> tuple[int, frozenset[int]]:
    """(vocab_size, special token ids) from a Hugging Face ``config.json``."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    special: set[int] = set()
    for key in ("bos_token_id", "eos_token_id", "pad_token_id", "decoder_start_token_id"):
        val = cfg.get(key)
        if isinstance(val, int):
            special.add(val)
        elif isinstance(val, list):
            special.update(v for v in val if isinstance(v, int))
    return int(cfg["vocab_size"]), frozenset(special)


def model_max_len(model_dir: str | Path) -> int | None:
    """The model's context length from ``config.json``, if it states one."""
    cfg = json.loads((Path(model_dir) / "config.json").read_text())
    val = cfg.get("max_position_embeddings") or cfg.get("max_sequence_length")
    return int(val) if val else None


class RandomIdPrompts:
    """Uniform random token ids, special ids excluded. Deterministic for a given generator."""

    def __init__(self, vocab_size: int, special_ids: frozenset[int] = frozenset()) -> None:
        allowed = np.setdiff1d(np.arange(vocab_size), np.fromiter(special_ids, dtype=np.int64))
        if allowed.size == 0:
            raise ValueError("no usable token ids")
        self._allowed = allowed

    def make(self, num_tokens: int, rng: np.random.Generator) -> tuple[list[int], int]:
        picks = self._allowed[rng.integers(0, self._allowed.size, size=num_tokens)]
        return [int(x) for x in picks], num_tokens


class TextPrompts:
    """Slices of a pool of real text tokens, fitted to an exact server-side token count."""

    def __init__(self, tokenizer: PromptTokenizer, texts: Sequence[str], min_pool_tokens: int):
        self._tok = tokenizer
        self._num_special = len(tokenizer.encode("", add_special_tokens=True))
        pool: list[int] = []
        for text in texts:
            pool.extend(tokenizer.encode(text + "\n\n", add_special_tokens=False))
            if len(pool) >= min_pool_tokens:
                break
        if not pool:
            raise ValueError("text pool is empty")
        self._pool = pool

    def _slice(self, start: int, num_tokens: int) -> list[int]:
        n = len(self._pool)  # a pool shorter than the slice is repeated
        return [self._pool[(start + i) % n] for i in range(num_tokens)]

    def _fit(self, start: int, num_tokens: int) -> list[tuple[str, int]]:
        """Texts tried from one start offset, the last one exact if the slice could be fitted."""
        tried: list[tuple[str, int]] = []
        k, seen = max(0, num_tokens - self._num_special), set()
        while k not in seen and len(tried) < MAX_FIT_TRIES:
            seen.add(k)
            text = self._tok.decode(self._slice(start, k))
            got = len(self._tok.encode(text, add_special_tokens=True))
            tried.append((text, got))
            if got == num_tokens:
                break
            k = max(0, k + num_tokens - got)
        return tried

    def make(self, num_tokens: int, rng: np.random.Generator) -> tuple[str, int]:
        """Text whose server-side encoding has exactly ``num_tokens`` tokens; when the
        tokenizer's merges make that impossible from a few start offsets, the longest text
        under the count (never over it, so prompt + output stays within the context)."""
        start = int(rng.integers(0, len(self._pool)))
        tried: list[tuple[str, int]] = []
        for shift in range(MAX_FIT_STARTS):
            tried += self._fit(start + shift, num_tokens)
            if tried[-1][1] == num_tokens:
                return tried[-1]
        under = [t for t in tried if t[1] <= num_tokens]
        if under:
            return max(under, key=lambda t: t[1])
        return min(tried, key=lambda t: t[1])

"""Counting output lengths in tokens of a stated tokenizer (a Hugging Face ``tokenizer.json``).

Lengths are only comparable when counted with the same tokenizer, so every artifact records
the tokenizer it was trained with (its path as given and the sha256 of ``tokenizer.json``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
PROJECT_TOKENIZER = PACKAGE_ROOT / "assets" / "tokenizer"


def resolve_tokenizer_file(path: str | Path | None) -> Path:
    """The ``tokenizer.json`` for ``path`` (a file or a folder holding one).

    ``None`` means the project's tokenizer in ``tetri_server/assets/tokenizer``.
    """
    p = Path(path) if path is not None else PROJECT_TOKENIZER
    if p.is_dir():
        p = p / "tokenizer.json"
    if not p.is_file():
        raise FileNotFoundError(
            f"tokenizer not found: {p} (give a tokenizer.json or a folder holding one)"
        )
    return p


class TokenCounter:
    """Counts tokens of texts without special tokens (what a model generates, not BOS/EOS)."""

    def __init__(self, path: str | Path | None = None) -> None:
        from tokenizers import Tokenizer

        self.file = resolve_tokenizer_file(path)
        self.sha256 = hashlib.sha256(self.file.read_bytes()).hexdigest()
        self._tok = Tokenizer.from_file(str(self.file))
        self._tok.no_truncation()  # a tokenizer.json may carry an encoder's truncation/padding
        self._tok.no_padding()

    @property
    def name(self) -> str:
        """The folder (or file) the tokenizer came from, relative to the package if inside it."""
        src = self.file.parent if self.file.name == "tokenizer.json" else self.file
        try:
            return "tetri_server/" + src.relative_to(PACKAGE_ROOT).as_posix()
        except ValueError:
            return str(src)

    def count(self, texts: Sequence[str]) -> list[int]:
        if not texts:
            return []
        encodings = self._tok.encode_batch(list(texts), add_special_tokens=False)
        return [len(e.ids) for e in encodings]

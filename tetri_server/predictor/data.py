"""Length-labelled data for the predictor: Arena-format files and the labelling CSV.

A *sample* is one response: (prompt id, prompt text, model, output length in tokens). The
Arena files in ``../shared/data`` hold one prompt per line in ``arena_prompts.jsonl.gz`` and one
response per line in ``arena_responses_*.jsonl.gz`` (gzip or plain JSONL). The labelling CSV
written by ``tools/label_lengths.py`` has the columns ``prompt_id,prompt,output_tokens``.
"""

from __future__ import annotations

import csv
import gzip
import json
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tetri_server.predictor.tokens import TokenCounter

DEFAULT_DATA_DIR = Path(__file__).resolve().parents[3] / "shared" / "data"
LABEL_CSV_FIELDS = ("prompt_id", "prompt", "output_tokens")


@dataclass(frozen=True)
class Sample:
    """One (prompt, response length) pair; ``output_tokens`` is counted by a stated tokenizer."""

    prompt_id: str
    prompt: str
    model: str
    output_tokens: int


def read_jsonl(path: str | Path) -> Iterator[dict[str, Any]]:
    """Yield the JSON objects of a JSONL file, gzip-compressed if its name ends in ``.gz``."""
    p = Path(path)
    opener = gzip.open if p.suffix == ".gz" else open
    with opener(p, "rt", encoding="utf-8") as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{p}:{line_no}: not JSON: {e}") from e


def default_arena_files(data_dir: str | Path = DEFAULT_DATA_DIR) -> tuple[Path, list[Path]]:
    """The Arena prompt file and response files in ``data_dir``."""
    d = Path(data_dir)
    prompts = d / "arena_prompts.jsonl.gz"
    responses = sorted(d.glob("arena_responses_*.jsonl*"))
    if not prompts.exists() or not responses:
        raise FileNotFoundError(f"no Arena prompt/response files in {d}")
    return prompts, responses


def load_arena(
    prompts_file: str | Path,
    response_files: Sequence[str | Path],
    counter: TokenCounter,
    max_tokens: int | None = None,
    prompt_ids: Collection[str] | None = None,
) -> list[Sample]:
    """Join responses to their prompts and count each response in tokens of ``counter``.

    ``max_tokens`` clips lengths (a generation cap: a longer response would have been cut
    there); ``prompt_ids`` keeps only those prompts. Responses whose prompt is missing from
    ``prompts_file`` are an error.
    """
    prompts = {str(r["prompt_id"]): str(r["prompt"]) for r in read_jsonl(prompts_file)}
    rows: list[tuple[str, str, str]] = []
    for path in response_files:
        for r in read_jsonl(path):
            pid = str(r["prompt_id"])
            if pid not in prompts:
                raise ValueError(f"{path}: response for unknown prompt_id {pid!r}")
            if prompt_ids is not None and pid not in prompt_ids:
                continue
            rows.append((pid, str(r.get("model", "")), str(r["response"])))
    lengths = counter.count([text for _, _, text in rows])
    return [
        Sample(pid, prompts[pid], model, _clip(n, max_tokens))
        for (pid, model, _), n in zip(rows, lengths, strict=True)
    ]


def _clip(n: int, max_tokens: int | None) -> int:
    return n if max_tokens is None else min(n, max_tokens)


def write_label_csv(path: str | Path, rows: Sequence[tuple[str, str, int]]) -> None:
    """Write (prompt_id, prompt, output_tokens) rows as the labelling CSV."""
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.writer(f)
        w.writerow(LABEL_CSV_FIELDS)
        w.writerows(rows)


def load_label_csv(path: str | Path, max_tokens: int | None = None) -> list[Sample]:
    """Read a labelling CSV; the model column is the file name (one served model per file)."""
    p = Path(path)
    with open(p, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        missing = set(LABEL_CSV_FIELDS) - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{p}: missing columns {sorted(missing)}")
        return [
            Sample(r["prompt_id"], r["prompt"], p.stem, _clip(int(r["output_tokens"]), max_tokens))
            for r in reader
        ]

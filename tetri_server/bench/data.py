"""Readers for the real workload files in the shared data folder (see its README.md).

Every reader returns plain Python lists in file order and never touches the network. The folder
is ``$TETRI_DATA_DIR`` if set, else ``../shared/data`` next to the repository root.
"""

from __future__ import annotations

import csv
import gzip
import json
import os
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
SHAREGPT_FILE = "sharegpt_8k_llama2_tokens.csv"
ARENA_PROMPTS_FILE = "arena_prompts.jsonl.gz"
ARENA_RESPONSE_FILES = (
    "arena_responses_fastchat_arena_hard_1k.jsonl.gz",
    "arena_responses_arena_bench_v1.jsonl.gz",
    "arena_responses_arena_hard_v0.1.jsonl.gz",
    "arena_responses_arena_hard_v2.0.jsonl.gz",
)
# trace name -> file; Azure files are CSV with wall-clock stamps, Mooncake files JSONL in ms.
TRACE_FILES = {
    "azure_conv": "azure_conv_2023.csv",
    "azure_code": "azure_code_2023.csv",
    "mooncake_conversation": "mooncake_conversation_trace.jsonl",
    "mooncake_synthetic": "mooncake_synthetic_trace.jsonl",
}


def data_dir(path: str | os.PathLike[str] | None = None) -> Path:
    """Resolve the data folder: the argument, else ``$TETRI_DATA_DIR``, else ../shared/data."""
    if path is not None:
        found = Path(path)
    elif os.environ.get("TETRI_DATA_DIR"):
        found = Path(os.environ["TETRI_DATA_DIR"])
    else:
        found = REPO_ROOT.parent / "shared" / "data"
    if not found.is_dir():
        raise FileNotFoundError(f"data folder {found} does not exist (set TETRI_DATA_DIR)")
    return found


@dataclass(frozen=True)
class LengthRow:
    """One request's real lengths in tokens (no text)."""

    prompt_len: int
    output_len: int


@dataclass(frozen=True)
class TraceRow:
    """One request of an arrival trace: time since the trace's first request, and lengths."""

    time_s: float
    prompt_len: int
    output_len: int


def load_sharegpt_lengths(folder: Path) -> list[LengthRow]:
    """ShareGPT (prompt, reply) lengths in Llama-2 tokens, 30,731 rows."""
    with open(folder / SHAREGPT_FILE, newline="") as f:
        return [
            LengthRow(int(r["num_prefill_tokens"]), int(r["num_decode_tokens"]))
            for r in csv.DictReader(f)
        ]


def load_trace(folder: Path, name: str) -> list[TraceRow]:
    """An arrival trace by name (``TRACE_FILES``), times relative to its first row, sorted."""
    if name not in TRACE_FILES:
        raise ValueError(f"unknown trace {name!r}; known: {', '.join(TRACE_FILES)}")
    path = folder / TRACE_FILES[name]
    rows: list[TraceRow] = []
    if path.suffix == ".csv":
        with open(path, newline="") as f:
            raw = [
                (datetime.fromisoformat(r["TIMESTAMP"]), r["ContextTokens"], r["GeneratedTokens"])
                for r in csv.DictReader(f)
            ]
        t0 = raw[0][0]
        rows = [TraceRow((t - t0).total_seconds(), int(p), int(o)) for t, p, o in raw]
    else:
        with open(path) as f:
            recs = [json.loads(line) for line in f if line.strip()]
        t0_ms = recs[0]["timestamp"]
        rows = [
            TraceRow(
                (r["timestamp"] - t0_ms) / 1000.0, int(r["input_length"]), int(r["output_length"])
            )
            for r in recs
        ]
    rows.sort(key=lambda r: r.time_s)  # stable: rows with equal stamps keep file order
    return rows


@dataclass(frozen=True)
class ArenaPrompt:
    prompt_id: str
    text: str


@dataclass(frozen=True)
class ArenaResponse:
    prompt_id: str
    model: str
    text: str


def load_arena_prompts(folder: Path) -> list[ArenaPrompt]:
    """Real Chatbot-Arena prompts (text), sorted by prompt id as in the file."""
    with gzip.open(folder / ARENA_PROMPTS_FILE, "rt", encoding="utf-8") as f:
        return [ArenaPrompt(r["prompt_id"], r["prompt"]) for r in map(json.loads, f)]


def load_arena_responses(folder: Path) -> list[ArenaResponse]:
    """Real model responses to the Arena prompts, all four files, in file order."""
    out: list[ArenaResponse] = []
    for name in ARENA_RESPONSE_FILES:
        with gzip.open(folder / name, "rt", encoding="utf-8") as f:
            out.extend(
                ArenaResponse(r["prompt_id"], r["model"], r["response"]) for r in map(json.loads, f)
            )
    return out

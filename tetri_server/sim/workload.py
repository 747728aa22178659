"""Requests for the simulator: the benchmark's workloads (``bench/workload.py``: the paper's
five from the real ShareGPT lengths, traces, Arena prompts with real response lengths counted
by a model's tokenizer) or a JSONL trace of
``{"arrival_s": float, "prompt_tokens": int, "output_tokens": int}`` lines. Predicted buckets
are drawn here, once per request in id order, so every mode sees the same predictions."""

from __future__ import annotations

import json
from pathlib import Path

from tetri_server.bench import data
from tetri_server.bench.prompts import JsonTokenizer
from tetri_server.bench.workload import WorkloadSpec, build_workload, length_class
from tetri_server.sim.instances import SimRequest
from tetri_server.sim.predictor import EmulatedPredictor


def from_workload(spec: WorkloadSpec, data_folder: str | None = None,
                  tokenizer_dir: str | None = None) -> list[SimRequest]:
    """The same lengths and arrivals ``tetri-server bench`` sends for ``spec``; Arena counts
    tokens with the tokenizer in ``tokenizer_dir`` (a model folder)."""
    tokenizer = None
    if spec.name == "Arena":
        if tokenizer_dir is None:
            raise ValueError("the Arena workload counts tokens with a model's tokenizer: give "
                             "--tokenizer MODEL_DIR (e.g. models/llama-bench)")
        tokenizer = JsonTokenizer(tokenizer_dir)
    folder = data.data_dir(data_folder)
    reqs = build_workload(spec, folder, vocab=(2, frozenset()),  # prompt ids are not used
                          tokenizer=tokenizer)
    return [SimRequest(r.request_id, r.prompt_len, r.output_len, r.arrival_s, r.kind)
            for r in reqs]


def from_trace(path: str | Path, max_model_len: int | None = None) -> list[SimRequest]:
    """A JSONL trace; lines are sorted by arrival (ties keep file order)."""
    rows = []
    for num, line in enumerate(Path(path).read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            t, p, o = float(obj["arrival_s"]), int(obj["prompt_tokens"]), int(obj["output_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}:{num}: need arrival_s, prompt_tokens, output_tokens "
                             f"({e})") from None
        if p < 1 or o < 1 or t < 0:
            raise ValueError(f"{path}:{num}: prompt/output tokens must be >= 1, arrival >= 0")
        if max_model_len is not None and p + o > max_model_len:
            raise ValueError(f"{path}:{num}: {p} + {o} tokens exceed max_model_len "
                             f"{max_model_len}")
        rows.append((t, p, o))
    rows.sort(key=lambda r: r[0])
    return [SimRequest(i, p, o, t, length_class(p, o)) for i, (t, p, o) in enumerate(rows)]


def assign_buckets(requests: list[SimRequest], predictor: EmulatedPredictor) -> None:
    for req in sorted(requests, key=lambda r: r.req_id):
        req.bucket = predictor.predict(req.output_len)


def fresh(requests: list[SimRequest]) -> list[SimRequest]:
    """Copies with no outcome, to run the same requests again in another mode."""
    return [SimRequest(r.req_id, r.prompt_len, r.output_len, r.arrival_s, r.kind, r.bucket)
            for r in requests]

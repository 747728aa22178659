"""The simulator's requests are the benchmark's: Arena included, counted by the same tokenizer."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tetri_server.bench import data
from tetri_server.bench.prompts import JsonTokenizer, load_tokenizer
from tetri_server.bench.workload import WorkloadSpec, build_workload
from tetri_server.modelmaker import TOKENIZER_DIR
from tetri_server.sim.workload import from_workload


def _folder():
    try:
        return data.data_dir()
    except FileNotFoundError:
        return None


FOLDER = _folder()
needs_data = pytest.mark.skipif(FOLDER is None, reason="needs ../shared/data (Arena files)")


def test_json_tokenizer_counts_like_the_served_models_tokenizer() -> None:
    texts = ["hello world", "Ünïcode 😀 and\n\ttabs", ""]
    if FOLDER is not None:
        texts += [p.text for p in data.load_arena_prompts(FOLDER)[:40]]
    ours, hf = JsonTokenizer(TOKENIZER_DIR), load_tokenizer(TOKENIZER_DIR)
    for text in texts:
        for special in (True, False):
            assert ours.encode(text, special) == hf.encode(text, add_special_tokens=special)


@needs_data
def test_arena_simulates_the_requests_the_benchmark_sends() -> None:
    spec = WorkloadSpec("Arena", num_requests=25, seed=3, max_model_len=1024, rate_rps=0.5)
    sim = from_workload(spec, tokenizer_dir=str(TOKENIZER_DIR))
    bench = build_workload(spec, FOLDER, tokenizer=load_tokenizer(TOKENIZER_DIR))
    assert [(r.prompt_len, r.output_len, r.arrival_s, r.kind) for r in sim] == [
        (r.prompt_len, r.output_len, r.arrival_s, r.kind) for r in bench]
    assert len({r.output_len for r in sim}) > 10  # real, varied response lengths


def test_arena_without_a_tokenizer_says_which_flag_gives_one() -> None:
    with pytest.raises(ValueError, match="--tokenizer"):
        from_workload(WorkloadSpec("Arena", num_requests=5, rate_rps=1.0))


@needs_data
def test_arena_requests_import_no_torch() -> None:
    code = ("import json, sys\nfrom tetri_server.bench.workload import WorkloadSpec\n"
            "from tetri_server.sim.workload import from_workload\n"
            f"from_workload(WorkloadSpec('Arena', 5, rate_rps=1.0), None, {str(TOKENIZER_DIR)!r})\n"
            "print(json.dumps([m for m in ('torch', 'transformers') if m in sys.modules]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []

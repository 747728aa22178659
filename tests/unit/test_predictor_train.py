"""Predictor training: metrics, stable features, labelling CSV -> artifact, the label tool."""

from __future__ import annotations

import importlib.util
import itertools
import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest

from tetri_server.predictor import load_predictor
from tetri_server.predictor.data import load_label_csv, write_label_csv
from tetri_server.predictor.features import FeatureSpec, featurize
from tetri_server.predictor.metrics import bucket_of, kendall_tau_b, num_buckets_for

REPO = Path(__file__).resolve().parents[2]


def _tool(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, REPO / "tools" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(REPO / "tools"))
    spec.loader.exec_module(module)
    return module


def test_buckets_follow_the_paper_with_a_catch_all() -> None:
    assert num_buckets_for(200, 1024) == 6
    assert bucket_of([0, 199, 200, 1023, 1024, 99999], 200, 6).tolist() == [0, 0, 1, 5, 5, 5]


def test_kendall_tau_b_matches_brute_force() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.integers(0, 5, 40), rng.integers(0, 7, 40)
    c = d = tx = ty = 0
    for i, j in itertools.combinations(range(40), 2):
        s = np.sign(x[i] - x[j]) * np.sign(y[i] - y[j])
        c, d = c + (s > 0), d + (s < 0)
        tx += x[i] == x[j] and y[i] != y[j]
        ty += y[i] == y[j] and x[i] != x[j]
    assert kendall_tau_b(x, y) == pytest.approx((c - d) / np.sqrt((c + d + tx) * (c + d + ty)))
    assert kendall_tau_b([1, 2, 3], [10, 20, 30]) == pytest.approx(1.0)


def test_features_do_not_depend_on_the_python_hash_seed() -> None:
    code = (
        "from tetri_server.predictor.features import FeatureSpec, featurize;"
        "x = featurize(['Write a sorting function in Rust, please.'], FeatureSpec());"
        "print(x.indices.tolist(), x.values.round(6).tolist())"
    )
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            cwd=REPO,
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outs) == 1
    x = featurize(["abc", ""], FeatureSpec())
    assert x.num_rows == 2 and np.allclose(
        x.matmul(np.ones((x.width, 1))), x.to_dense().sum(1)[:, None]
    )


def _synthetic_rows(n: int) -> list[tuple[str, str, int]]:
    """Prompts whose wording decides their length: 'briefly' ~50 tokens, 'essay' ~700."""
    rng = np.random.default_rng(1)
    topics = ["rain", "rust", "tax law", "chess", "bread", "jazz", "orbits", "graphs"]
    rows = []
    for i in range(n):
        topic = topics[i % len(topics)] + f" #{i}"
        if i % 2:
            rows.append((f"p{i}", f"Answer briefly: what is {topic}?", int(rng.integers(20, 90))))
        else:
            rows.append(
                (f"p{i}", f"Write a detailed essay on {topic}.", int(rng.integers(620, 800)))
            )
    return rows


def test_one_prompt_text_under_several_ids_is_never_on_both_sides() -> None:
    """Regression (a held-out score 3 points too high): the Arena data files some prompt texts
    under several ids, and the split and the cross-validation folds went by id, so a held-out
    prompt's twin trained the model. Now both go by the text (whitespace collapsed)."""
    from tetri_server.predictor.data import Sample
    from tetri_server.predictor.train import prompt_table, split_by_prompt, unique_prompts

    texts = [f"prompt number {i}" for i in range(30)]
    samples = [Sample(f"id{i}-{copy}", texts[i] + " " * copy, "m", 10 * i)
               for i in range(30) for copy in range(3)]  # three ids for each text
    for seed in range(5):
        train, test = split_by_prompt(samples, 0.3, seed)
        assert test and train
        assert not {" ".join(s.prompt.split()) for s in train} & {
            " ".join(s.prompt.split()) for s in test}
    prompts, rows = unique_prompts(samples)
    assert len(prompts) == 30 and list(rows[:3]) == [0, 0, 0]
    table = prompt_table(samples, 100, 3)
    assert len(table.prompt_ids) == len(table.prompts) == 30 and table.weights[0] == 3


def test_label_csv_trains_an_artifact_that_loads(tmp_path: Path) -> None:
    csv = tmp_path / "served.csv"
    write_label_csv(csv, _synthetic_rows(120))
    assert len(load_label_csv(csv)) == 120
    train_predictor = _tool("train_predictor")
    rc = train_predictor.main(
        [
            "--labels",
            str(csv),
            "--granularity",
            "200",
            "--iters",
            "60",
            "--l2",
            "1e-4",
            "--name",
            "served",
            "--out-dir",
            str(tmp_path),
        ]
    )
    assert rc == 0
    p = load_predictor("classifier", tmp_path / "served_g200.json")
    assert p.predict(["Answer briefly: what is soup?", "Write a detailed essay on soup."]) == [0, 3]
    meta = json.loads((tmp_path / "served_g200.json").read_text())
    assert meta["heldout"]["accuracy"] >= 0.9 and meta["heldout"]["n"] == 24


@pytest.fixture
def fake_openai_server() -> Iterator[str]:
    """An OpenAI-style server whose output length is len(prompt) tokens on
    /v1/chat/completions (the prompt as one user message) and twice that on /v1/completions."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802 - http.server's name
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            assert body["max_tokens"] == 64
            text = body["messages"][0]["content"] if "messages" in body else body["prompt"]
            if len(text) > 60:  # "longer than the context": vLLM's and our 400
                out = json.dumps({"error": {"message": "too long", "type": "BadRequestError",
                                            "param": None, "code": 400}}).encode()
                self.send_response(400)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)
                return
            if self.path == "/v1/chat/completions":
                [message] = body["messages"]
                assert message["role"] == "user"
                n = min(len(message["content"]), body["max_tokens"])
                choice: dict[str, object] = {"index": 0, "finish_reason": "length",
                                             "message": {"role": "assistant", "content": "x"}}
                kind = "chat.completion"
            else:
                assert self.path == "/v1/completions"
                n = min(2 * len(body["prompt"]), body["max_tokens"])
                choice = {"index": 0, "text": "x", "finish_reason": "length", "logprobs": None}
                kind = "text_completion"
            usage = {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": n + 3}
            out = json.dumps(
                {"id": "cmpl-1", "object": kind, "created": 0, "model": body["model"],
                 "choices": [choice], "usage": usage}
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(out)))
            self.end_headers()
            self.wfile.write(out)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    thread.join(timeout=5)


def test_label_tool_records_served_chat_lengths(fake_openai_server: str, tmp_path: Path) -> None:
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt_id": f"q{i}", "prompt": "p" * (10 * i)}) + "\n" for i in range(1, 9)
        )
    )
    label_lengths = _tool("label_lengths")
    out = tmp_path / "labels.csv"
    rc = label_lengths.main(
        [
            "--url",
            fake_openai_server,
            "--model",
            "m",
            "--prompts",
            str(prompts),
            "--limit",
            "5",
            "--max-tokens",
            "64",
            "--out",
            str(out),
            "--retrain",
            "--granularity",
            "100",
        ]
    )
    assert rc == 0
    assert [(s.prompt_id, s.output_tokens) for s in load_label_csv(out)] == [
        ("q1", 10),
        ("q2", 20),
        ("q3", 30),
        ("q4", 40),
        ("q5", 50),
    ]
    assert load_predictor("classifier", tmp_path / "labels_g100").predict(["p" * 30]) == [0]
    # raw text on request (traffic that is not chat): that endpoint's lengths
    assert label_lengths.main(["--url", fake_openai_server, "--model", "m", "--prompts",
                               str(prompts), "--limit", "2", "--max-tokens", "64", "--out",
                               str(out), "--endpoint", "completions"]) == 0
    assert [s.output_tokens for s in load_label_csv(out)] == [20, 40]


def test_label_tool_leaves_out_the_prompts_the_server_refuses(
    fake_openai_server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Regression (session 66 review): one prompt the server refused with a 400 (longer
    than its context) raised out of the whole run after every other request had been sent,
    and no CSV was written."""
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt_id": f"q{i}", "prompt": "p" * (10 * i)})
                               + "\n" for i in (1, 7, 2, 8, 3)))
    out = tmp_path / "labels.csv"
    assert _tool("label_lengths").main(["--url", fake_openai_server, "--model", "m",
                                        "--prompts", str(prompts), "--max-tokens", "64",
                                        "--out", str(out)]) == 0
    assert [(s.prompt_id, s.output_tokens) for s in load_label_csv(out)] == [
        ("q1", 10), ("q2", 20), ("q3", 30)]
    assert "2 refused by the server" in capsys.readouterr().out
    prompts.write_text(json.dumps({"prompt_id": "q8", "prompt": "p" * 80}) + "\n")
    assert _tool("label_lengths").main(["--url", fake_openai_server, "--model", "m",
                                        "--prompts", str(prompts), "--max-tokens", "64",
                                        "--out", str(out)]) == 1


def test_eval_command_prints_a_json_last_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tetri_server.predictor.command import main

    prompts, responses = tmp_path / "p.jsonl", tmp_path / "r.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"prompt_id": f"q{i}", "prompt": f"Question {i}?"}) + "\n" for i in range(6)
        )
    )
    responses.write_text(
        "".join(
            json.dumps({"prompt_id": f"q{i}", "model": "m", "response": "word " * (150 * i)}) + "\n"
            for i in range(6)
        )
    )
    for kind, expect in (("oracle", 1.0), ("classifier", None)):
        assert (
            main(["eval", "--kind", kind, "--prompts", str(prompts), "--responses", str(responses)])
            == 0
        )
        result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
        assert result["n"] == 6 and result["prompts"] == 6
        assert {"accuracy_100", "accuracy_200", "accuracy_400", "kendall_tau"} <= set(result)
        if expect is not None:
            assert result["accuracy_100"] == result["accuracy_200"] == expect

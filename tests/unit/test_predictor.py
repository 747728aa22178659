"""The length-predictor interface: shipped artifact, oracle, none, start-up errors."""

from __future__ import annotations

import json
import shutil
import socket
from pathlib import Path

import numpy as np
import pytest

from tetri_server.predictor import PredictorError, load_predictor
from tetri_server.predictor import artifact as artifact_io
from tetri_server.predictor.data import (
    DEFAULT_DATA_DIR,
    default_arena_files,
    load_arena,
    read_jsonl,
)
from tetri_server.predictor.evaluate import score
from tetri_server.predictor.tokens import PACKAGE_ROOT, TokenCounter
from tetri_server.predictor.train import held_out_ids

PROMPTS = ["Write a haiku about rain.", "Explain quicksort in Python with code and tests.", ""]


@pytest.fixture
def no_network(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("the predictor touched the network")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)


def test_shipped_artifacts_load_offline_and_predict_in_range(no_network: None) -> None:
    for name in ("arena_g100", "arena_g200", "arena_g400"):
        p = load_predictor("classifier", name)
        assert p.granularity == int(name.rsplit("_g", 1)[1])
        buckets = p.predict(PROMPTS)
        assert len(buckets) == len(PROMPTS)
        assert all(0 <= b < p.num_buckets for b in buckets)
    default = load_predictor()
    assert (default.granularity, default.num_buckets) == (200, 6)
    assert default.lower_bound(3) == 600 and default.upper_bound(5) is None


def test_predictions_are_batch_independent() -> None:
    p = load_predictor("classifier")
    assert p.predict(PROMPTS) == [p.predict([x])[0] for x in PROMPTS]


@pytest.mark.skipif(not DEFAULT_DATA_DIR.is_dir(), reason="needs ../shared/data (Arena files)")
def test_shipped_artifact_reproduces_its_recorded_heldout_accuracy() -> None:
    p = load_predictor("classifier", "arena_g200")
    meta = p.meta  # type: ignore[attr-defined]
    tok = meta["tokenizer"]
    counter = TokenCounter(PACKAGE_ROOT.parent / tok["name"])
    assert counter.sha256 == tok["sha256"], "tokenizer changed: retrain (tools/train_predictor.py)"
    prompts_file, response_files = default_arena_files()
    texts = {str(r["prompt_id"]): str(r["prompt"]) for r in read_jsonl(prompts_file)}
    ids = {str(r["prompt_id"]) for f in response_files for r in read_jsonl(f)}
    train = meta["training"]
    test_ids = held_out_ids({i: texts[i] for i in ids}, train["test_frac"], train["seed"])
    samples = load_arena(prompts_file, response_files, counter, meta["max_tokens"], test_ids)
    got = score(p, samples)
    recorded = meta["heldout"]
    assert got["n"] == recorded["n"]
    assert got["accuracy"] == pytest.approx(recorded["accuracy"], abs=0.005)
    assert got["accuracy"] > recorded["majority_accuracy"] + 0.05  # it learned something


def test_oracle_uses_true_lengths_and_needs_them() -> None:
    p = load_predictor("oracle")
    assert (p.granularity, p.num_buckets) == (200, 6)
    assert p.predict(["a", "b", "c", "d"], [0, 199, 200, 5000]) == [0, 0, 1, 5]
    with pytest.raises(PredictorError):
        p.predict(["a", "b"], [10, None])
    with pytest.raises(PredictorError):
        p.predict(["a"])
    assert load_predictor("oracle", "arena_g400").predict(["a"], [799]) == [1]


def test_none_puts_everything_in_bucket_zero() -> None:
    p = load_predictor("none")
    assert p.predict(PROMPTS, [900, 900, 900]) == [0, 0, 0]
    assert p.lower_bound(0) == 0
    assert p.upper_bound(0) is None  # no prediction bounds nothing (elastic keep rule)


@pytest.mark.parametrize("kind", ["classifier", "oracle", "none"])
def test_empty_batch(kind: str) -> None:
    assert load_predictor(kind).predict([], []) == []


@pytest.mark.parametrize("kind", ["classifier", "oracle", "none"])
def test_bad_artifact_path_fails_at_load(kind: str, tmp_path: Path) -> None:
    with pytest.raises(PredictorError, match="not found"):
        load_predictor(kind, str(tmp_path / "missing"))


def test_unknown_kind() -> None:
    with pytest.raises(ValueError, match="unknown predictor kind"):
        load_predictor("crystal-ball")


def _copy_shipped(tmp_path: Path) -> Path:
    src = artifact_io.resolve("arena_g200")
    for suffix in (".json", ".npz"):
        shutil.copy(src.with_suffix(suffix), tmp_path / f"x{suffix}")
    return tmp_path / "x.json"


def test_corrupt_artifacts_fail_at_load(tmp_path: Path) -> None:
    meta_path = _copy_shipped(tmp_path)
    assert load_predictor("classifier", meta_path).granularity == 200  # the copy is fine
    assert load_predictor("classifier", tmp_path).granularity == 200  # and so is its folder

    meta_path.with_suffix(".npz").write_bytes(b"not a zip")
    with pytest.raises(PredictorError, match="corrupt"):
        load_predictor("classifier", meta_path)

    meta_path = _copy_shipped(tmp_path)
    np.savez(meta_path.with_suffix(".npz"), weight=np.zeros((3, 6)), bias=np.zeros(6))
    with pytest.raises(PredictorError, match="expected"):
        load_predictor("classifier", meta_path)

    meta_path = _copy_shipped(tmp_path)
    meta = json.loads(meta_path.read_text())
    del meta["num_buckets"]
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(PredictorError, match="missing"):
        load_predictor("classifier", meta_path)

    meta_path.write_text("{")
    with pytest.raises(PredictorError, match="corrupt"):
        load_predictor("none", meta_path)


@pytest.mark.parametrize(("key", "value"), [("granularity", 0), ("granularity", "200 tokens"),
                                            ("num_buckets", -1), ("max_tokens", True),
                                            ("tokenizer", "gpt2")])
def test_an_artifact_with_a_bad_value_is_a_predictor_error(tmp_path: Path, key, value) -> None:
    """Regression (session 66 review): a granularity of 0 or a string, or a tokenizer that is
    not an object, raised a plain ValueError / AttributeError, which the server's start does
    not catch: a traceback instead of the one line naming the file."""
    from tetri_server.control.cluster import predictor_tokenizer_mismatch

    meta_path = _copy_shipped(tmp_path)
    meta = json.loads(meta_path.read_text())
    meta[key] = value
    meta_path.write_text(json.dumps(meta))
    for kind in ("classifier", "none"):
        with pytest.raises(PredictorError, match=f"corrupt.*{key}"):
            load_predictor(kind, meta_path)
    with pytest.raises(PredictorError, match=key):
        predictor_tokenizer_mismatch(tmp_path, str(meta_path))


def test_an_artifact_trained_on_served_lengths_needs_a_tokenizer_to_count_with() -> None:
    """Review of session 64: ``predictor eval`` on an artifact trained with --labels (its
    lengths counted by the served model, no tokenizer file recorded) died with a traceback."""
    import pytest

    from tetri_server.predictor.command import counter_for

    meta = {"tokenizer": {"name": "served model (usage.completion_tokens)"}}
    with pytest.raises(SystemExit, match="give --tokenizer"):
        counter_for(meta, None)

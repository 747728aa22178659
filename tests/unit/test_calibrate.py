"""The chunk-size calibration cache: a knee measured for one engine build or processor is not
reused by another (a cached 2048 once outlived an engine change that moved the knee to 256),
and one-thread CPU passes are timed in CPU time."""

from __future__ import annotations

import json
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tetri_server.workers import calibrate


def fake_worker(model: Path) -> SimpleNamespace:
    (model / "config.json").write_text('{"hidden_size": 8}')
    return SimpleNamespace(cfg=SimpleNamespace(model=SimpleNamespace(path=str(model),
                                                                     batch_invariant=False)),
                           model=torch.nn.Linear(2, 2), device=torch.device("cpu"))


def counted_knee_256(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                     ) -> tuple[SimpleNamespace, list[int]]:
    """A fake worker with a fresh cache whose measurements (each appended to the list) put
    the knee at 256."""
    monkeypatch.setenv("TETRI_CACHE_DIR", str(tmp_path / "cache"))
    measured: list[int] = []

    def measure(w, sizes=calibrate.SIZES, rows=0):  # noqa: ANN001, ANN202
        measured.append(1)
        return [(n, n / 1000 if n < 256 else n / 4000) for n in (64, 128, 256, 512, 1024)]

    monkeypatch.setattr(calibrate, "measure", measure)
    return fake_worker(tmp_path), measured


def test_a_cached_knee_of_another_engine_build_is_measured_again(tmp_path, monkeypatch):
    worker, measured = counted_knee_256(tmp_path, monkeypatch)
    monkeypatch.setattr(calibrate, "PICKS", 1)  # one calibration per key is enough here
    monkeypatch.setattr(calibrate, "engine_build", lambda: "engine-old|ops-old")
    assert calibrate.resolve_chunk_size(worker, 0) == 256
    assert calibrate.resolve_chunk_size(worker, 0) == 256 and len(measured) == 1  # cached
    monkeypatch.setattr(calibrate, "engine_build", lambda: "engine-new|ops-new")
    assert calibrate.resolve_chunk_size(worker, 0) == 256 and len(measured) == 2  # new build
    monkeypatch.setattr(calibrate, "processor", lambda: "another CPU")
    calibrate.resolve_chunk_size(worker, 0)
    assert len(measured) == 3
    monkeypatch.setattr(calibrate, "calibration_rule", lambda: "rule-new")
    calibrate.resolve_chunk_size(worker, 0)
    assert len(measured) == 4  # a pick of the old rule (best of 2, measured sizes only) is stale
    worker.cfg.model.batch_invariant = True  # every row through the one-row kernel: slower
    calibrate.resolve_chunk_size(worker, 0)
    assert len(measured) == 5
    cached = json.loads(calibrate.cache_file().read_text())
    assert len(cached) == 5 and all("ops-" in k and "|rule-" in k for k in cached)
    assert calibrate.resolve_chunk_size(worker, 384) == 384 and len(measured) == 5  # configured


def test_the_first_starts_each_calibrate_and_serve_the_median_pick(tmp_path, monkeypatch):
    """One calibration on a loaded machine must not stick: six on a shared core picked 256 to
    1424. The first ``PICKS`` starts calibrate once each and serve the median of the picks so
    far (the lower of two); the later ones serve the median of the cached picks."""
    monkeypatch.setenv("TETRI_CACHE_DIR", str(tmp_path / "cache"))
    worker = fake_worker(tmp_path)
    knees = iter([256, 1424, 384])  # the plateau from this size on, an outlier second

    def measure(w, sizes=calibrate.SIZES, rows=0):  # noqa: ANN001, ANN202
        k = next(knees)
        return [(n, n / 1000 if n < k else n / (1000 * k / 32)) for n in (32, k - 16, k, 2 * k)]

    monkeypatch.setattr(calibrate, "measure", measure)
    assert calibrate.PICKS == 3
    served = [calibrate.resolve_chunk_size(worker, 0) for _ in range(5)]
    assert served == [256, 256, 384, 384, 384]  # and no fourth calibration (next() would raise)
    [picks] = json.loads(calibrate.cache_file().read_text()).values()
    assert picks == [256, 1424, 384]


def test_a_worker_flipping_to_prefill_serves_a_cached_pick_without_measuring(tmp_path,
                                                                               monkeypatch):
    """Regression: a flip to prefill calibrated once more while fewer than ``PICKS`` were
    cached; the worker, serving already, sent nothing for the seconds it measured and was
    killed as stalled, the flip failed, and so did every later one. At a flip a cached pick
    serves; with none cached it still measures."""
    worker, measured = counted_knee_256(tmp_path, monkeypatch)
    assert calibrate.resolve_chunk_size(worker, 0, at_start=False) == 256  # none cached
    assert calibrate.resolve_chunk_size(worker, 0, at_start=False) == 256
    assert len(measured) == 1  # one pick of three cached: a flip does not measure again
    assert calibrate.resolve_chunk_size(worker, 0) == 256 and len(measured) == 2  # a start does


def test_a_single_pick_cached_by_an_older_build_counts_as_one(tmp_path, monkeypatch):
    monkeypatch.setenv("TETRI_CACHE_DIR", str(tmp_path / "cache"))
    worker = fake_worker(tmp_path)
    calibrate.cache_file().parent.mkdir(parents=True)
    calibrate.cache_file().write_text(json.dumps({calibrate.cache_key(worker): 416}))
    monkeypatch.setattr(calibrate, "measure", lambda w, sizes=calibrate.SIZES, rows=0: [
        (n, n / 1000 if n < 256 else n / 8000) for n in (32, 256, 512)])
    assert calibrate.resolve_chunk_size(worker, 0) == 256  # median_low of 416 and 256
    assert json.loads(calibrate.cache_file().read_text()) == {
        calibrate.cache_key(worker): [416, 256]}


def test_the_key_names_the_engine_sources_the_ops_build_and_the_rule(tmp_path):
    key = calibrate.cache_key(fake_worker(tmp_path))
    _, _, folder = calibrate.build_spec()
    assert folder.name in key and "|engine-" in key and calibrate.processor() in key
    assert key.endswith(calibrate.calibration_rule()) and "|rule-" in key


def test_rounds_are_interleaved_and_each_size_keeps_its_best_pass(monkeypatch):
    """A slow spell of the machine slows one pass of several sizes, not every pass of one: each
    round passes once over every size, and a size keeps its fastest pass."""
    order: list[int] = []
    slow = {(1, 128)}  # (round, size) passes that the machine slowed

    class Runner:
        def execute(self, plan):  # noqa: ANN001, ANN202
            n = plan.num_tokens
            order.append(n)
            clock.now += n * 1e-4 * (3 if ((len(order) - 1) // 3, n) in slow else 1)

    class Clock:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    clock = Clock()
    kv = SimpleNamespace(reserve=lambda seq, k: True, free=lambda seq: None)
    worker = SimpleNamespace(max_model_len=1024, allocator=SimpleNamespace(num_blocks=16),
                             block_size=16, model_spec=SimpleNamespace(vocab_size=100), kv=kv,
                             runner=Runner(), device=torch.device("cpu"))
    monkeypatch.setattr(calibrate, "pass_clock", lambda device: clock)
    samples = calibrate.measure(worker, (32, 64, 128, 256), rounds=3)  # type: ignore[arg-type]
    assert order == [32, 64, 128] * 3  # 256 does not fit in half of 16 x 16 blocks
    assert samples == [(32, pytest.approx(32e-4)), (64, pytest.approx(64e-4)),
                       (128, pytest.approx(128e-4))]


def test_passes_with_decode_rows_hold_the_rows_and_the_rest_of_the_chunk_in_prompt(monkeypatch):
    """With ``rows``, a pass of n tokens is the step a prefill worker that decodes that many
    requests itself runs: n - rows prompt tokens and rows one-token decode rows, each over a
    context already in the pool; sizes not above the rows are skipped."""
    passes: list[list[tuple[int, int, int]]] = []

    class Runner:
        def execute(self, plan):  # noqa: ANN001, ANN202
            passes.append([(i.seq.num_computed, i.num_tokens, len(i.seq.token_ids))
                           for i in plan.items])

    reserved: list[int] = []
    kv = SimpleNamespace(reserve=lambda seq, k: reserved.append(k) or True, free=lambda seq: None)
    worker = SimpleNamespace(max_model_len=1024, allocator=SimpleNamespace(num_blocks=512),
                             block_size=16, model_spec=SimpleNamespace(vocab_size=100), kv=kv,
                             runner=Runner(), device=torch.device("cpu"))
    samples = calibrate.measure(worker, (2, 32, 64), rounds=1, rows=2)  # type: ignore[arg-type]
    assert [n for n, _ in samples] == [32, 64]
    ctx = calibrate.RIDER_CONTEXT
    assert passes == [[(ctx, 1, ctx + 1)] * 2 + [(0, 30, 30)],
                      [(ctx, 1, ctx + 1)] * 2 + [(0, 62, 62)]]
    assert reserved == [ctx + 1, ctx + 1, 30, ctx + 1, ctx + 1, 62]


def test_the_pick_for_a_worker_that_decodes_too_is_measured_and_cached_apart(tmp_path,
                                                                           monkeypatch):
    monkeypatch.setenv("TETRI_CACHE_DIR", str(tmp_path / "cache"))
    worker = fake_worker(tmp_path)
    measured: list[int] = []

    def measure(w, sizes=calibrate.SIZES, rows=0):  # noqa: ANN001, ANN202
        measured.append(rows)  # 2 ms a step, 5 ms more with the rows, 4000 prompt tokens/s
        return [(n, 2e-3 + (5e-3 if rows else 0) + (n - rows) / 4000) for n in calibrate.SIZES]

    monkeypatch.setattr(calibrate, "measure", measure)
    monkeypatch.setattr(calibrate, "PICKS", 1)
    bare = calibrate.resolve_chunk_size(worker, 0)
    riding = calibrate.resolve_chunk_size(worker, 0, rows=16)
    assert measured == [0, 16] and riding > 2 * bare
    assert calibrate.resolve_chunk_size(worker, 0, rows=16) == riding and measured == [0, 16]
    assert calibrate.resolve_chunk_size(worker, 0) == bare and measured == [0, 16]


def test_one_thread_cpu_passes_are_timed_in_cpu_time(monkeypatch):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert calibrate.pass_clock("cpu") is time.thread_time
        assert calibrate.pass_clock("cuda:0") is time.perf_counter
        torch.set_num_threads(2)
        assert calibrate.pass_clock("cpu") is time.perf_counter
    finally:
        torch.set_num_threads(threads)


def test_a_pool_too_small_for_every_pass_is_a_clear_error(tmp_path, monkeypatch):
    """No calibration size fits half the pool: the worker says what to set (it failed with
    throughput_curve's bare "no samples")."""
    monkeypatch.setenv("TETRI_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(calibrate, "measure", lambda w, sizes=calibrate.SIZES, rows=0: [])
    worker = fake_worker(tmp_path)
    worker.allocator, worker.block_size = SimpleNamespace(num_blocks=3), 16
    with pytest.raises(RuntimeError, match=r"3 blocks of 16.*set prefill\.chunk_size"):
        calibrate.resolve_chunk_size(worker, 0)

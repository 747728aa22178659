"""CPU accounting for benchmarks, on hand-made /proc files (and one real window)."""

from __future__ import annotations

import os
from pathlib import Path

from tetri_server.bench.cpu import (
    CLK_TCK,
    CpuWindow,
    core_ticks,
    machine_busy_ticks,
    proc_ticks,
)

STAT = """cpu  100 5 50 800 40 3 2 0 7 0
cpu0 60 5 30 390 20 2 1 0 7 0
cpu1 40 0 20 410 20 1 1 0 0 0
intr 1 2 3
"""


def test_machine_busy_counts_everything_but_idle_and_iowait(tmp_path: Path) -> None:
    (tmp_path / "stat").write_text(STAT)
    busy, total = machine_busy_ticks(tmp_path / "stat")
    assert total == 100 + 5 + 50 + 800 + 40 + 3 + 2 + 0  # guest (7) is inside user already
    assert busy == total - 800 - 40
    assert core_ticks(tmp_path / "stat") == {0: (508, 410), 1: (492, 430)}


def test_proc_ticks_reads_utime_and_stime_even_with_spaces_in_the_name(tmp_path: Path) -> None:
    d = tmp_path / "42"
    d.mkdir()
    fields = ["S"] + ["0"] * 10 + ["123", "45"] + ["0"] * 30
    (d / "stat").write_text("42 (tetri worker) (x) " + " ".join(fields))
    assert proc_ticks(42, tmp_path) == 168
    assert proc_ticks(43, tmp_path) == 0  # gone


def test_a_window_attributes_our_cpu_and_the_others() -> None:
    w = CpuWindow({"self": os.getpid()})
    w.start()
    t = 0
    for i in range(3_000_000):  # burn some CPU ourselves
        t += i
    w.stop()
    assert t > 0 and w.shares["self"] > 0
    assert w.others_cores >= 0 and CLK_TCK > 0


def test_the_timer_accounts_sections_and_interleaves_contenders() -> None:
    from tetri_server.bench.cpu import Timer

    timer = Timer("cpu")
    order: list[str] = []
    times = timer.interleaved({"a": lambda: order.append("a"), "b": lambda: order.append("b")},
                              rounds=3, section="demo")
    assert order == ["a", "b"] * 3  # round robin: load changes hit both alike
    assert [len(v) for v in times.values()] == [3, 3]
    assert all(t >= 0 for v in times.values() for t in v)
    assert timer.shares["demo"].wall_s > 0
    assert timer.share_text("missing") == "n/a" and "kernel" in timer.share_text("demo")
    assert Timer("wall").pick(2.0, 1.0) == 2.0 and timer.pick(2.0, 1.0) == 1.0

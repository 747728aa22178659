"""tools/bench_handoff.py on CPU (shm): the tool a GPU box runs over cuda_ipc, end to end."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))

import bench_handoff  # noqa: E402


def test_handoff_bench_prints_every_shape_layout_and_size(capsys) -> None:
    assert bench_handoff.main(["--transport", "shm", "--device", "cpu", "--tokens", "40,64",
                               "--reps", "2"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines()
            if line.startswith("| bench") or line.startswith("| 1b")]
    assert [(r[0].strip(), r[1].strip(), r[2].strip()) for r in rows] == [
        (shape, layout, n) for shape in ("bench", "1b") for n in ("40", "64")
        for layout in ("contiguous", "scattered")]
    assert all(float(r[4]) > 0 and float(r[6]) > 0 for r in rows)

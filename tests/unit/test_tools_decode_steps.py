"""tools/decode_steps.py: the decode worker's step times from a decision log."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
from decode_steps import decode_steps, main  # noqa: E402


def step(t: float, run: list[int], **extra: object) -> dict:
    return {"kind": "decode_step", "t": t, "run": run, "preempt": [], **extra}


def test_steps_with_a_recompute_beside_other_rows_are_timed_to_the_next_record(tmp_path,
                                                                              capsys):
    records = [step(0.0, [1, 2]), step(0.03, [1], preempt=[2]),
               step(0.05, [1, 2], recompute_tokens=[[2, 256]]),  # 0.4 s, beside 1
               {"kind": "dispatch", "t": 0.45},
               step(0.5, [2], recompute_tokens=[[2, 40]]),  # alone: not counted
               step(0.6, [1, 2]), step(0.61, [1, 2], preempt=[3]),  # 3 waited: a KV drop
               step(0.62, [])]
    s = decode_steps(records)
    assert s.num_steps == 6 and s.num_preemptions == 1 and s.num_kv_drops == 1
    assert s.recompute_tokens == [256] and s.recompute_s == pytest.approx([0.4])
    path = tmp_path / "decisions.w1.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    main([str(path)])
    out = capsys.readouterr().out
    assert "preemptions 1; waiting KV dropped 1;" in out
    assert "at most 256 tokens, 400 ms mean, 400 ms max" in out
    with pytest.raises(ValueError, match="no decode step"):
        decode_steps([step(0.0, [1])])

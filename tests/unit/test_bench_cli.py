"""``run`` and ``compare`` end to end against a fake OpenAI-compatible server in a subprocess
(started, health-checked and stopped by the same code that will drive tetri_server and vLLM)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest

from tetri_server.bench import cli
from tetri_server.bench.compare import ServerSpec, cpu_delta, free_port, running_server
from tetri_server.bench.cpu import machine_busy_cpu_s, session_cpu_s

# argv: mode port [health_status] [pid_file]. Tokens come TOKEN_GAP_S[mode] apart; every
# request adds busy seconds to two workers, so perf/$ and resource usage are measurable.
FAKE_SERVER = r"""
import asyncio, json, subprocess, sys
from aiohttp import web
mode, port = sys.argv[1], int(sys.argv[2])
health = int(sys.argv[3]) if len(sys.argv) > 3 else 200
if len(sys.argv) > 4:  # a child in the server's process group, as workers are
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    open(sys.argv[4], "w").write(str(child.pid))
gap = {"coupled": 0.004, "disaggregated": 0.002}.get(mode, 0.003)
busy = {"0": 0.0, "1": 0.0}
async def completions(request):
    body = await request.json()
    n = body["max_tokens"]
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    for i in range(n):
        await asyncio.sleep(gap)
        ch = {"choices": [{"index": 0, "text": "x", "finish_reason": None}]}
        await resp.write(b"data: " + json.dumps(ch).encode() + b"\n\n")
    busy["0"] += 0.001 * len(body["prompt"]); busy["1"] += gap * n
    usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": n}
    await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\n")
    await resp.write(b"data: [DONE]\n\n")
    return resp
async def metrics(request):
    roles = {"0": "prefill", "1": "decode"}
    lines = [f'tetri_worker_busy_seconds_total{{worker="{w}",role="{roles[w]}"}} {s}'
             for w, s in busy.items()]
    return web.Response(text="\n".join(lines) + "\n")
app = web.Application()
app.router.add_get("/health", lambda r: web.Response(status=health))
app.router.add_get("/v1/models", lambda r: web.json_response({"data": [{"id": "fake-" + mode}]}))
app.router.add_get("/metrics", metrics)
app.router.add_post("/v1/completions", completions)
web.run_app(app, host="127.0.0.1", port=port, print=None)
"""


def fake_spec(mode: str, *extra: str, ready_timeout_s: float = 30.0) -> ServerSpec:
    port = free_port()
    argv = [sys.executable, "-c", FAKE_SERVER, mode, str(port), *extra]
    return ServerSpec(mode, argv, port, ready_timeout_s=ready_timeout_s)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    config = {
        "vocab_size": 512,
        "bos_token_id": 1,
        "eos_token_id": 2,
        "max_position_embeddings": 700,
    }
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0]
    except FileNotFoundError:
        return False
    return state != "Z"


def test_server_is_stopped_with_its_process_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    spec = fake_spec("coupled", "200", str(pid_file))
    with running_server(spec, tmp_path / "log") as proc:
        child = int(pid_file.read_text())
        assert _alive(proc.pid) and _alive(child)
    assert proc.returncode is not None
    deadline = time.monotonic() + 5
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


def test_a_server_that_never_gets_healthy_times_out_and_is_stopped(tmp_path: Path) -> None:
    spec = fake_spec("coupled", "503", ready_timeout_s=0.8)
    with pytest.raises(TimeoutError), running_server(spec, tmp_path / "log"):
        pass
    dead = ServerSpec("dead", [sys.executable, "-c", "print('no model'); raise SystemExit(3)"], 1)
    with pytest.raises(RuntimeError, match="no model"), running_server(dead, tmp_path / "log2"):
        pass


def test_run_writes_json_table_and_plots(tmp_path: Path, model_dir: Path) -> None:
    spec = fake_spec("coupled")
    with running_server(spec, tmp_path / "server.log"):
        out = tmp_path / "out"
        rc = cli.main(
            [
                "run",
                "--url",
                spec.base_url,
                "--model",
                str(model_dir),
                "--workload",
                "LPLD,HPLD",
                "--num-requests",
                "8",
                "--rate",
                "50",
                "--out",
                str(out),
                "--no-progress",
                "--server-config",
                '{"mode": "x"}',
            ]
        )
    assert rc == 0
    results = json.loads((out / "results.json").read_text())
    assert [r["workload"]["name"] for r in results] == ["LPLD", "HPLD"]
    first = results[0]
    assert first["server_config"]["mode"] == "x" and first["server_config"]["served_model"]
    assert first["summary"]["num_completed"] == 8 and len(first["records"]) == 8
    assert first["summary"]["num_workers"] == 2 and first["summary"]["busy_s_total"] > 0
    assert first["workload"]["max_model_len"] == 700  # from the model's config.json
    assert "| HPLD | server | 8/8 |" in (out / "table.md").read_text()
    for png in ("cdf_LPLD.png", "cdf_HPLD.png", "bars.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG"
    assert first["machine"]["commit"] and first["machine"]["isa"]


def test_compare_runs_every_mode_and_prints_ratios(
    tmp_path: Path,
    model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    started: list[list[str]] = []

    def spec(mode: str, model: str, port: int, max_len: int, sets: list[str]) -> ServerSpec:
        started.append([mode, model, str(max_len), *sets])
        return fake_spec(mode)

    monkeypatch.setattr(cli, "tetri_spec", spec)
    out = tmp_path / "cmp"
    rc = cli.main(
        [
            "compare",
            "--model",
            str(model_dir),
            "--no-vllm",
            "--workload",
            "LPLD",
            "--num-requests",
            "6",
            "--rate",
            "20",
            "--set",
            "cluster.num_workers=2",
            "--out",
            str(out),
            "--no-progress",
            "--no-plots",
        ]
    )
    assert rc == 0
    assert [s[0] for s in started] == ["disaggregated", "coupled", "coupled-chunked"]
    assert started[0][1:] == [str(model_dir), "700", "cluster.num_workers=2"]
    captured = capsys.readouterr()
    printed = captured.out
    assert "| LPLD | disaggregated |" in printed and "vs coupled" in printed
    # each fresh server got two unmeasured requests before its first workload
    assert captured.err.count("/warm-up: 2 requests\n") == 3
    results = json.loads((out / "results.json").read_text())
    assert [r["mode"] for r in results] == ["disaggregated", "coupled", "coupled-chunked"]
    assert all(len(r["records"]) == 6 and r["summary"]["num_requests"] == 6 for r in results)
    # the same requests went to every server
    lens = [[(q["prompt_len"], q["output_len"]) for q in r["records"]] for r in results]
    assert lens[0] == lens[1] == lens[2]
    for mode in ("disaggregated", "coupled", "coupled-chunked"):
        assert (out / f"{mode}.log").exists()
    # what ran where, on every run (sweep.json says it too): without it a published compare
    # table could not be traced to its commit, ISA or torch
    machine = results[0]["machine"]
    assert machine["commit"] and machine["isa"] and machine["torch"] and machine["nproc"]
    assert all(r["machine"] == machine for r in results)


def test_session_cpu_seconds_of_a_started_server(tmp_path: Path) -> None:
    spec = fake_spec("coupled", "200", str(tmp_path / "child.pid"))
    with running_server(spec, tmp_path / "log") as proc:
        snap = session_cpu_s(proc.pid)
        # the server and its child, nothing else (this test process is in another session)
        assert len(snap) == 2 and all(v >= 0.0 for v in snap.values())
        assert f"[{proc.pid}]" in " ".join(snap) and f"[{os.getpid()}]" not in " ".join(snap)
    assert cpu_delta({"a[1]": 1.0}, {"a[1]": 1.5, "b[2]": 0.25}) == {"a[1]": 0.5, "b[2]": 0.25}


def test_session_cpu_seconds_parses_proc_stat(tmp_path: Path) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    for pid, sid, name in ((7, 7, "VLLM::Worker"), (8, 7, "a (b) c"), (9, 3, "other")):
        (tmp_path / str(pid)).mkdir()
        rest = ["S", "1", str(sid), str(sid)] + ["0"] * 7 + [str(2 * tick), str(tick)]
        (tmp_path / str(pid) / "stat").write_text(f"{pid} ({name}) " + " ".join(rest) + " 0 0\n")
    (tmp_path / "self").mkdir()
    assert session_cpu_s(7, tmp_path) == {"VLLM::Worker[7]": 3.0, "a (b) c[8]": 3.0}


def test_machine_busy_cpu_seconds_leave_out_idle_iowait_and_guest(tmp_path: Path) -> None:
    tick = os.sysconf("SC_CLK_TCK")
    # user nice system idle iowait irq softirq steal guest guest_nice
    ticks = [10, 1, 5, 1000, 50, 1, 2, 3, 4, 0]
    stat = tmp_path / "stat"
    stat.write_text("cpu  " + " ".join(str(t * tick) for t in ticks) + "\ncpu0 1 2 3\n")
    assert machine_busy_cpu_s(stat) == pytest.approx(22.0)
    assert machine_busy_cpu_s() > 0.0


def test_compare_with_no_modes_starts_no_tetri_server(
    tmp_path: Path, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[str] = []
    monkeypatch.setattr(cli, "tetri_spec", lambda mode, *a: started.append(mode) or fake_spec(mode))
    argv = ["compare", "--modes", "", "--no-vllm", "--model", str(model_dir), "--workload", "LPLD"]
    argv += ["--num-requests", "2", "--rate", "20", "--out", str(tmp_path / "o"), "--no-progress"]
    assert cli.main([*argv, "--no-plots"]) == 0 and started == []


def test_the_elastic_preset_is_disaggregated_with_local_decodes():
    from tetri_server.bench.compare import tetri_spec

    spec = tetri_spec("elastic", "builtin:tiny", 8123, 2048, ["cluster.workers=2"])
    sets = [spec.argv[i + 1] for i, a in enumerate(spec.argv) if a == "--set"]
    assert spec.label == "elastic"
    assert "cluster.mode=disaggregated" in sets and "prefill.local_decode_batch=16" in sets
    assert "decode.local_prefill_tokens=1024" in sets
    assert sets[-1] == "cluster.workers=2"  # the caller's sets come last: they win


def test_a_mode_may_carry_settings_of_its_own_that_win_over_every_servers():
    from tetri_server.bench.compare import tetri_spec

    text = "hand-back:decode.local_prefill_margin=2+cluster.workers=3"
    spec = tetri_spec(text, "builtin:tiny", 8123, 2048, ["cluster.workers=2"])
    sets = [spec.argv[i + 1] for i, a in enumerate(spec.argv) if a == "--set"]
    assert spec.label == text  # two variants of one mode keep apart in the tables
    assert "cluster.mode=disaggregated" in sets and "prefill.local_decode_hand_back=true" in sets
    assert sets[-3:] == ["cluster.workers=2", "decode.local_prefill_margin=2", "cluster.workers=3"]
    plain = tetri_spec("coupled", "builtin:tiny", 8123, 2048)
    assert "cluster.mode=coupled" in plain.argv and plain.label == "coupled"


@pytest.mark.parametrize("mode", ["disaggregated:prefill.chunk_size", ":a=1", "coupled:a=1+b"])
def test_a_mode_with_a_setting_that_is_not_key_value_stops_the_command(
    tmp_path: Path, model_dir: Path, mode: str
) -> None:
    argv = ["compare", "--modes", f"coupled,{mode}", "--no-vllm", "--model", str(model_dir)]
    argv += ["--workload", "LPLD", "--num-requests", "2", "--out", str(tmp_path / "o")]
    with pytest.raises(SystemExit, match="MODE:key=value"):
        cli.main(argv)
    sweep = ["sweep", "--modes", mode, "--model", str(model_dir), "--workload", "LPLD"]
    with pytest.raises(SystemExit, match="MODE:key=value"):
        cli.main([*sweep, "--num-requests", "2", "--rates", "1", "--out", str(tmp_path / "s")])


def test_warm_up_sends_the_longest_and_shortest_prompts_reversed_and_short() -> None:
    from tetri_server.bench.compare import warmup_requests
    from tetri_server.bench.workload import BenchRequest

    reqs = [BenchRequest(i, list(range(i, i + n)), n, 100, 0.5 * i, "LPLD", "x")
            for i, n in enumerate([5, 9, 3, 7])]
    warm = warmup_requests(reqs, 3)
    assert [w.prompt_len for w in warm] == [9, 3, 7]
    assert warm[0].prompt == list(range(1, 10))[::-1]  # not a prompt the run sends
    assert {w.output_len for w in warm} == {8} and {w.arrival_s for w in warm} == {0.0}
    assert all(w.request_id < 0 for w in warm)
    assert len(warmup_requests(reqs, 10)) == 4  # no more than the workload has
    # a text prompt keeps its words (reversed characters tokenize to about twice as many)
    text = [BenchRequest(0, "one two three four five", 5, 20, 0.0, "LPLD", "x")]
    assert warmup_requests(text, 1)[0].prompt == "three four five one two"
    assert warmup_requests(reqs, 0) == []

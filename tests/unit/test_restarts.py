"""Restart hygiene: back-off, the give-up limit, survival of foreign /dev/shm entries, and a
clear error (not SIGBUS) when /dev/shm is too small for a pool."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from tetri_server.channel import cleanup_stale_segments
from tetri_server.control.restarts import RestartPolicy


def test_back_off_doubles_up_to_the_cap_then_the_server_gives_up():
    p = RestartPolicy(backoff_s=1.0, backoff_max_s=5.0, max_restarts=4, reset_s=60.0)
    assert [p.on_death(0, t) for t in (0.0, 1.0, 2.0, 3.0)] == [1.0, 2.0, 4.0, 5.0]
    assert p.on_death(0, 4.0) is None  # fifth death in a row: exit non-zero
    assert p.on_death(1, 4.0) == 1.0  # counted per worker


def test_a_worker_that_stayed_up_starts_a_fresh_count():
    p = RestartPolicy(backoff_s=1.0, backoff_max_s=30.0, max_restarts=2, reset_s=60.0)
    assert p.on_death(0, 0.0) == 1.0
    p.on_ready(0, 5.0)
    assert p.on_death(0, 10.0) == 2.0  # up only 5 s: still in a row
    p.on_ready(0, 20.0)
    assert p.on_death(0, 100.0) == 1.0  # up 80 s: a new first death
    assert p.deaths_in_a_row(0) == 1


def test_stale_segment_cleanup_survives_entries_it_cannot_remove(tmp_path):
    """Regression: a directory (or any entry unlink refuses) named like a dead run's segment
    made start-up fail; it is now warned about and skipped."""
    dead_pid = 2**22 + 12345  # above pid_max's default: never alive
    (tmp_path / f"tetri-{dead_pid}-ab-dir").mkdir()
    (tmp_path / f"tetri-{dead_pid}-ab-seg").write_bytes(b"x")
    (tmp_path / "someone-elses").write_bytes(b"x")
    removed = cleanup_stale_segments(str(tmp_path))
    assert removed == [f"tetri-{dead_pid}-ab-seg"]
    assert (tmp_path / f"tetri-{dead_pid}-ab-dir").is_dir()
    assert (tmp_path / "someone-elses").exists()
    assert cleanup_stale_segments(str(tmp_path / "missing")) == []


def test_a_pool_larger_than_dev_shm_is_a_clear_error_not_sigbus(tmp_path):
    """Regression: a KV pool sized past the free /dev/shm space was created with ftruncate and
    died of SIGBUS when pre-touched. Run in a child on a 1 MiB tmpfs (needs mount rights)."""
    mnt = tmp_path / "shm"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1M", "tmpfs", str(mnt)],
                      capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here")
    try:
        script = textwrap.dedent(f"""
            import torch
            import tetri_server.channel as channel, tetri_server.kv.shm as shm
            channel.SHM_DIR = shm.SHM_DIR = {str(mnt)!r}
            from tetri_server.kv.transport import PoolGeometry
            g = PoolGeometry(2, 256, 16, 2, 64, torch.float32)  # 8 MiB
            try:
                shm.ShmTransport(0, g, "tetri-test-kv")
            except OSError as e:
                print("ERROR", e)
        """)
        out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                             timeout=120, cwd=os.getcwd())
        assert out.returncode == 0, (out.returncode, out.stderr[-2000:])  # -7 was SIGBUS
        assert "ERROR" in out.stdout and "has no room for the KV pool" in out.stdout
        assert "kv.num_blocks" in out.stdout
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_restart_that_cannot_spawn_is_retried_and_leaves_no_segment(monkeypatch):
    """A restart whose spawn fails (/dev/shm full: the second ring cannot be made) counts as
    a death: it is tried again after the back-off, until the give-up limit makes the server
    exit — never a worker id left dead for good with /health at 503. The ring already made
    for it is unlinked, not leaked."""
    import asyncio

    from tetri_server.channel import SHM_DIR, Channel
    from tetri_server.config import load_config
    from tetri_server.control import supervisor as sup
    from tetri_server.control.monitor import NullMetrics

    cfg = load_config(None, ["cluster.restart_backoff_s=0.01", "cluster.max_restarts=3"])
    made: list[str] = []
    calls = iter(range(100))
    real_create = Channel.create

    def create_one_then_fail(name, capacity, msg_type):  # noqa: ANN001, ANN202
        if next(calls) % 2 == 1:  # each spawn's second ring
            raise OSError(28, f"{SHM_DIR} has no room for the ring")
        made.append(name)
        return real_create(name, capacity, msg_type)

    monkeypatch.setattr(Channel, "create", staticmethod(create_one_then_fail))

    async def scenario() -> str:
        s = sup.Supervisor(cfg, lambda h, m: None, lambda h, c: None, lambda m, e: None,
                           NullMetrics())
        s.begin("tetri-test-restart")
        s.started = True
        s._restart(0, "prefill")
        return await asyncio.wait_for(s.fatal, 10.0)

    msg = asyncio.run(scenario())
    assert "died 4 times in a row" in msg
    assert len(made) == 4  # the first try and three restarts, each made its inbox
    assert not [n for n in made if os.path.exists(os.path.join(SHM_DIR, n))]


def test_a_restart_asks_for_the_pool_of_the_first_start(monkeypatch) -> None:  # noqa: ANN001
    """Regression (review of session 64): a restarted worker sized its KV pool beside its
    peers' pools. The supervisor now passes the pool the worker id had at its first start."""
    import asyncio
    from types import SimpleNamespace

    from tetri_server.config import load_config
    from tetri_server.control import supervisor as sup
    from tetri_server.control.monitor import NullMetrics

    asked: list[int] = []

    def spawn(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        asked.append(args[10] if len(args) > 10 else kwargs.get("previous_num_blocks", 0))
        return SimpleNamespace(on_undeliverable=None)

    monkeypatch.setattr(sup, "spawn_worker", spawn)

    async def scenario() -> None:
        s = sup.Supervisor(load_config(None, []), lambda h, m: None, lambda h, c: None,
                           lambda m, e: None, NullMetrics())
        s.begin("tetri-test-pool")
        s.spawn(0, "prefill", {})
        s.on_ready(SimpleNamespace(worker_id=0, pool=SimpleNamespace(num_blocks=700)))
        s.spawn(0, "prefill", {})  # restarted: fewer blocks fit
        s.on_ready(SimpleNamespace(worker_id=0, pool=SimpleNamespace(num_blocks=500)))
        s.spawn(0, "prefill", {})

    asyncio.run(scenario())
    assert asked == [0, 700, 700]


def test_a_spawn_that_fails_at_start_stops_the_workers_spawned_before_it(monkeypatch) -> None:
    """Regression (session 66 review): the start's spawn loop ran outside the try that stops
    the cluster on failure: when the second worker's spawn raised (/dev/shm full), the first
    worker went on loading its model, its message rings left in /dev/shm."""
    import asyncio
    import time

    from tetri_server.config import load_config
    from tetri_server.control import supervisor as sup
    from tetri_server.control.cluster import Cluster

    real, made = sup.spawn_worker, []

    def spawn(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if made:
            raise OSError(28, "No space left on device")
        made.append(real(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(sup, "spawn_worker", spawn)
    cluster = Cluster(load_config(None, ["model.path=builtin:tiny", "cluster.mode=disaggregated"]
                                  ).resolve(cpu_count=os.cpu_count() or 1))

    async def start() -> None:
        with pytest.raises(OSError, match="No space"):
            await cluster.start()

    asyncio.run(start())
    [first] = made
    deadline = time.monotonic() + 30
    while first.proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    assert first.proc.poll() is not None, "the first worker runs on"
    assert cluster.supervisor.stopping
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(cluster.run_id)]


def test_a_worker_makes_its_gpu_the_current_device_before_anything_else(monkeypatch) -> None:
    """Regression (session 66 review): nothing set the current CUDA device, and Triton
    launches on the current device, not on its tensors': on a machine with two GPUs the worker
    on cuda:1 launched its kernels on cuda:0 (a Triton error at its first eager step). No GPU
    here: the call is recorded, and the start stops right after it."""
    import torch

    from tetri_server.workers import base

    seen: list[object] = []

    class Stop(Exception):
        pass

    def set_device(device: object) -> None:
        seen.append(device)
        raise Stop

    monkeypatch.setattr(torch.cuda, "set_device", set_device)
    worker = base.Worker.__new__(base.Worker)
    with pytest.raises(Stop):
        worker._start(type("Spec", (), {"device": "cuda:1"})())  # type: ignore[arg-type]
    assert seen == [torch.device("cuda:1")]
    base.bind_device(torch.device("cpu"))  # no CUDA call on cpu
    assert seen == [torch.device("cuda:1")]

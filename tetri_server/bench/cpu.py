"""CPU accounting for benchmarks on shared machines (from /proc): how busy the whole machine,
each core and a given process was over a window, and each worker's own CPU clock. The
benchmark tools report these beside every timing, because the machines here are shared and
noisy. Paths are parameters, so tests feed hand-made /proc files."""

from __future__ import annotations

import asyncio
import os
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

CLK_TCK = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


def machine_busy_ticks(stat: Path = PROC / "stat") -> tuple[int, int]:
    """(busy, total) clock ticks over all cores since boot: busy is everything but idle and
    iowait; guest time is already inside user/nice and not counted twice."""
    fields = [int(x) for x in stat.read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + (fields[4] if len(fields) > 4 else 0)
    total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
    return total - idle, total


def machine_busy_cpu_s(stat: Path = PROC / "stat") -> float:
    """CPU seconds all cores have spent busy since boot."""
    return machine_busy_ticks(stat)[0] / CLK_TCK


def session_cpu_s(session_id: int, proc_root: Path = PROC) -> dict[str, float]:
    """CPU seconds (user + system, all threads) used so far by each live process of a session,
    keyed ``"name[pid]"``. A server started with ``start_new_session`` is session ``proc.pid``."""
    out: dict[str, float] = {}
    for entry in proc_root.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited meanwhile
            continue
        name = stat[stat.find("(") + 1 : stat.rfind(")")]
        fields = stat[stat.rfind(")") + 2 :].split()
        # fields[0] is field 3 (state) of proc(5): session is field 6, utime 14, stime 15
        if int(fields[3]) == session_id:
            out[f"{name}[{entry.name}]"] = (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


def core_ticks(stat: Path = PROC / "stat") -> dict[int, tuple[int, int]]:
    """Per core: (total, idle + iowait) clock ticks since boot."""
    out: dict[int, tuple[int, int]] = {}
    for line in stat.read_text().splitlines():
        name, *vals = line.split()
        if name.startswith("cpu") and name != "cpu":
            nums = [int(v) for v in vals]
            out[int(name[3:])] = (sum(nums[:8]), nums[3] + nums[4])
    return out


def core_busy(seconds: float = 0.3, stat: Path = PROC / "stat") -> dict[int, float]:
    """Busy fraction of each core over the next ``seconds``."""
    a = core_ticks(stat)
    time.sleep(seconds)
    b = core_ticks(stat)
    return {c: 1.0 - (b[c][1] - a[c][1]) / max(1, b[c][0] - a[c][0]) for c in b if c in a}


def proc_ticks(pid: int, proc: Path = PROC) -> int:
    """utime + stime of ``pid`` (all its threads) in clock ticks; 0 if it is gone."""
    try:
        rest = (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return 0
    return int(rest[11]) + int(rest[12])


@dataclass
class CpuWindow:
    """CPU used during a wall-clock window by given pids, and by everything else (in cores)."""

    pids: dict[str, int]
    proc: Path = PROC
    wall0: float = 0.0
    busy0: int = 0
    ticks0: dict[str, int] = field(default_factory=dict)
    shares: dict[str, float] = field(default_factory=dict)  # cores' worth, per pid name
    others_cores: float = float("nan")

    def start(self) -> None:
        self.wall0 = time.perf_counter()
        self.busy0, _ = machine_busy_ticks(self.proc / "stat")
        self.ticks0 = {k: proc_ticks(p, self.proc) for k, p in self.pids.items()}

    def stop(self) -> None:
        wall = max(1e-9, time.perf_counter() - self.wall0)
        busy, _ = machine_busy_ticks(self.proc / "stat")
        ours = 0
        for k, p in self.pids.items():
            used = proc_ticks(p, self.proc) - self.ticks0[k]
            ours += used
            self.shares[k] = used / CLK_TCK / wall
        self.others_cores = max(0.0, (busy - self.busy0 - ours) / CLK_TCK / wall)


def others_cores(seconds: float) -> float:
    """Cores' worth of CPU that other processes used over the next ``seconds``."""
    w = CpuWindow({"self": os.getpid()})
    w.start()
    time.sleep(seconds)
    w.stop()
    return w.others_cores


class CpuClock:
    """Each worker's own CPU clock: its main thread's on-CPU and run-queue-wait time
    (``/proc/<pid>/schedstat``, ns) sampled every ``period_s``. Putting token times on the
    clock of the worker that produced them gives the inter-token gap that worker would see on
    a core of its own (an estimate: it assumes CPU-bound work and ignores that other processes
    also slow it through shared caches and memory bandwidth)."""

    def __init__(self, pids: dict[int, int], period_s: float, proc: Path = PROC) -> None:
        self.period_s = period_s
        self._fds = {w: os.open(proc / str(p) / "schedstat", os.O_RDONLY)
                     for w, p in pids.items()}
        self.t: list[float] = []
        self.run: dict[int, list[float]] = {w: [] for w in pids}
        self.wait: dict[int, list[float]] = {w: [] for w in pids}

    def sample(self) -> None:
        self.t.append(time.perf_counter())
        for w, fd in self._fds.items():
            fields = os.pread(fd, 128, 0).split()
            self.run[w].append(int(fields[0]) / 1e9)
            self.wait[w].append(int(fields[1]) / 1e9)

    async def loop(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(self.period_s)

    def cpu(self, worker: int, t: float) -> float:
        return float(np.interp(t, self.t, self.run[worker]))

    def shares(self, worker: int, t0: float, t1: float) -> tuple[float, float]:
        """(on-CPU, waiting-for-CPU) fractions of ``worker`` over [t0, t1]."""
        run = np.interp([t0, t1], self.t, self.run[worker])
        wait = np.interp([t0, t1], self.t, self.wait[worker])
        return float(run[1] - run[0]) / (t1 - t0), float(wait[1] - wait[0]) / (t1 - t0)

    def close(self) -> None:
        for fd in self._fds.values():
            os.close(fd)
        self._fds.clear()


@dataclass
class CpuShare:
    """Process CPU seconds per wall second over the measured regions of one section."""

    wall_s: float = 0.0
    cpu_s: float = 0.0
    sys_s: float = 0.0  # kernel time (mostly first-touch page faults of fresh memory)

    @property
    def share(self) -> float:
        return self.cpu_s / self.wall_s if self.wall_s > 0 else float("nan")

    @property
    def sys_share(self) -> float:
        return self.sys_s / self.cpu_s if self.cpu_s > 0 else float("nan")


@dataclass
class Timer:
    """Times calls on one clock and accounts each section's CPU share. ``kind = "cpu"``:
    process CPU time (what the code costs on an unshared core: slices other processes took
    from ours are not counted); ``"wall"``: perf_counter."""

    kind: str = "cpu"
    shares: dict[str, CpuShare] = field(default_factory=dict)

    def pick(self, wall_s: float, cpu_s: float) -> float:
        return cpu_s if self.kind == "cpu" else wall_s

    def now(self) -> float:
        return time.process_time() if self.kind == "cpu" else time.perf_counter()

    def account(self, section: str, wall_s: float, cpu_s: float, sys_s: float = 0.0) -> None:
        acc = self.shares.setdefault(section, CpuShare())
        acc.wall_s += wall_s
        acc.cpu_s += cpu_s
        acc.sys_s += sys_s

    def timed(self, fn: Callable[[], object], section: str) -> float:
        """Seconds (on this clock) of one call of ``fn``; its CPU share goes to ``section``."""
        s0 = resource.getrusage(resource.RUSAGE_SELF).ru_stime
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        t1, c1 = time.perf_counter(), time.process_time()
        self.account(section, t1 - t0, c1 - c0,
                     resource.getrusage(resource.RUSAGE_SELF).ru_stime - s0)
        return self.pick(t1 - t0, c1 - c0)

    def share_text(self, section: str) -> str:
        """CPU share of the section, and the part of its CPU time spent in the kernel."""
        acc = self.shares.get(section)
        if not acc:
            return "n/a"
        return f"{acc.share:.2f} (kernel {100 * acc.sys_share:.0f}% of CPU time)"

    def interleaved(self, fns: dict[str, Callable[[], object]], rounds: int,
                    section: str) -> dict[str, list[float]]:
        """Each function once per round, round robin, so that a change in the machine's load
        hits every contender alike; the times of each."""
        times: dict[str, list[float]] = {name: [] for name in fns}
        for _ in range(rounds):
            for name, fn in fns.items():
                times[name].append(self.timed(fn, section))
        return times

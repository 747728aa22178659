"""Side-by-side runs: start each server configuration in turn, run the same requests, stop it.

Servers run one at a time (on 2 cores two servers would measure each other). Each is started in
its own session (``start_new_session``) so that stopping it signals exactly its process group:
SIGTERM, a bounded wait, then SIGKILL. tetri_server is started as
``python -m tetri_server serve --set cluster.mode=<mode> --set model.path=<folder> ...``;
vLLM-CPU as in docs/peer-vllm-cpu.md (eager, float32, no prefix caching, no chunked prefill:
the paper's "vanilla vLLM").
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from tetri_server.bench.client import ClientConfig, fetch_model_name, run_benchmark
from tetri_server.bench.cpu import machine_busy_cpu_s, session_cpu_s
from tetri_server.bench.metrics import SLO, summarize
from tetri_server.bench.report import BenchResult
from tetri_server.bench.workload import BenchRequest, WorkloadSpec

TETRI_MODES = ("disaggregated", "coupled", "coupled-chunked")
# Named variants a comparison may list beside the modes: (cluster.mode, extra key=value). The
# default is elastic on both sides on cpu (prefill.local_decode_batch = 16,
# decode.local_prefill_tokens = 1024) and the strict split on cuda (cluster.elastic = auto); the
# presets name cluster.elastic explicitly, so each is the same configuration on either device.
MODE_PRESETS = {
    "elastic": ("disaggregated", ("cluster.elastic=on", "prefill.local_decode_batch=16",
                                  "decode.local_prefill_tokens=1024")),
    "elastic-prefill": ("disaggregated", ("cluster.elastic=on",  # ablations
                                          "prefill.local_decode_batch=16",
                                          "decode.local_prefill_tokens=0")),
    "split": ("disaggregated", ("cluster.elastic=off",)),  # the paper's strict split
    "elastic-decode": ("disaggregated", ("cluster.elastic=on", "prefill.local_decode_batch=0",
                                         "decode.local_prefill_tokens=1024")),
    # which requests the prefill side keeps: only where they decode faster, or by the other
    # rules alone (prefill.local_decode_balance on and off)
    "keep-balanced": ("disaggregated", ("cluster.elastic=on",
                                        "prefill.local_decode_balance=true")),
    "keep-any": ("disaggregated", ("cluster.elastic=on", "prefill.local_decode_balance=false")),
    # ... and the balance rule decides past a chunk of prompt backlog too
    "keep-past-backlog": ("disaggregated", ("cluster.elastic=on",
                                            "prefill.local_decode_balance=true",
                                            "prefill.local_decode_balance_backlog=true")),
    # kept requests go to a decode worker once more than a chunk of prompt tokens waits
    # (prefill.local_decode_hand_back; off by default since session 21)
    "hand-back": ("disaggregated", ("cluster.elastic=on", "prefill.local_decode_hand_back=true")),
    # steps that carry decode rows fill the whole chunk on both sides
    # (prefill.local_decode_chunk = 0; the default to session 30)
    "mixed-full-chunk": ("disaggregated", ("cluster.elastic=on", "prefill.local_decode_chunk=0")),
    # ... on the prefill worker only; the decode worker's prompt slices stay at 128 tokens
    "prefill-full-chunk": ("disaggregated", ("cluster.elastic=on", "prefill.local_decode_chunk=0",
                                             "decode.local_prefill_tokens=128")),
}
VLLM_LABEL = "vllm-cpu"
READY_POLL_S = 0.5
STOP_GRACE_S = 30.0
VLLM_ENV = {
    "VLLM_CACHE_ROOT": "/tmp/vllm-peer-cache",
    "XDG_CACHE_HOME": "/tmp/vllm-peer-cache",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_CPU_KVCACHE_SPACE": "2",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
}


@dataclass(frozen=True)
class ServerSpec:
    label: str
    argv: list[str]
    port: int
    env: dict[str, str] = field(default_factory=dict)  # added to the inherited environment
    ready_timeout_s: float = 300.0
    num_workers: int | None = None  # for perf/$; None: count the workers in /metrics
    cwd: str | None = None  # working directory (``-m tetri_server`` imports the checkout there)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def config(self) -> dict[str, Any]:
        return {"label": self.label, "argv": self.argv, "env": self.env, "port": self.port}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def split_mode(text: str, sep: str = "+") -> tuple[str, tuple[str, ...]]:
    """A mode as ``--modes`` lists it: a cluster mode or ``MODE_PRESETS`` name, optionally
    followed by ``:`` and key=value settings of that server alone, ``sep`` between them:
    'disaggregated:decode.local_prefill_margin=2+prefill.chunk_size=256' ->
    ('disaggregated', ('decode.local_prefill_margin=2', 'prefill.chunk_size=256'))."""
    name, _, settings = text.partition(":")
    own = tuple(s for s in settings.split(sep) if s)
    if not name or any("=" not in s for s in own):
        raise ValueError(f"mode {text!r}: expected MODE or MODE:key=value{sep}key=value")
    return name, own


def tetri_spec(
    mode: str, model: str, port: int, max_model_len: int, sets: Sequence[str] = ()
) -> ServerSpec:
    """tetri_server in ``mode`` (a cluster mode, or a ``MODE_PRESETS`` name such as
    ``elastic``, either with settings of its own: ``split_mode``; the whole text labels it);
    ``sets`` (key=value) apply to every mode, e.g. worker counts (config defaults give 2 workers
    in every mode: 1 prefill + 1 decode, or 2 coupled), the mode's own after them (they win)."""
    argv = [sys.executable, "-m", "tetri_server", "serve"]
    name, own = split_mode(mode)
    cluster_mode, preset = MODE_PRESETS.get(name, (name, ()))
    pinned = (
        f"cluster.mode={cluster_mode}",
        *preset,
        f"model.path={model}",
        "server.host=127.0.0.1",
        f"server.port={port}",
        f"model.max_model_len={max_model_len}",
    )
    for item in (*pinned, *sets, *own):
        argv += ["--set", item]
    return ServerSpec(mode, argv, port)


def find_vllm(explicit: str | None = None) -> list[str] | None:
    """The command that runs vLLM's CLI: the given path, ``vllm`` on PATH, or the module."""
    if explicit:
        return [explicit]
    if found := shutil.which("vllm"):
        return [found]
    if importlib.util.find_spec("vllm") is not None:
        return [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    return None


def vllm_spec(
    vllm_cmd: list[str], model: str, port: int, max_model_len: int, num_workers: int = 1
) -> ServerSpec:
    argv = [*vllm_cmd, "serve", model, "--host", "127.0.0.1", "--port", str(port)]
    argv += ["--dtype", "float32", "--max-model-len", str(max_model_len), "--enforce-eager"]
    argv += ["--no-enable-prefix-caching", "--no-enable-chunked-prefill"]
    return ServerSpec(VLLM_LABEL, argv, port, dict(VLLM_ENV), num_workers=num_workers)


def own_cpu_s() -> float:
    """CPU seconds this process (the benchmark client) has used so far."""
    t = os.times()
    return t.user + t.system


def cpu_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds spent between two ``session_cpu_s`` snapshots (a process that appeared in
    between counts from 0; one that exited in between is lost, its time unknown)."""
    return {k: v - before.get(k, 0.0) for k, v in sorted(after.items())}


def _http_status(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2.0) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return exc.code
    except (urllib.error.URLError, OSError):
        return None


def _tail(path: Path, num_chars: int = 2000) -> str:
    return path.read_text(errors="replace")[-num_chars:] if path.exists() else ""


@contextlib.contextmanager
def running_server(spec: ServerSpec, log_path: Path) -> Iterator[subprocess.Popen[bytes]]:
    """Start ``spec``, wait until ``/health`` (or ``/v1/models``) answers 200, always stop it."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            spec.argv,
            stdout=log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **spec.env},
            cwd=spec.cwd,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + spec.ready_timeout_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"{spec.label} exited ({proc.returncode}):\n{_tail(log_path)}")
            health = _http_status(f"{spec.base_url}/health")
            if health == 200 or (
                health == 404 and _http_status(f"{spec.base_url}/v1/models") == 200
            ):
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"{spec.label} not ready in {spec.ready_timeout_s} s")
            time.sleep(READY_POLL_S)
        yield proc
    finally:
        stop_server(proc)


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's process group, wait, SIGKILL what is left (bounded)."""
    pgid = proc.pid  # session leader: its pid is the group id
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        pass
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)  # anyone left in the group (workers outliving the parent)?
        except ProcessLookupError:
            break
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pgid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5.0)


@dataclass(frozen=True)
class CompareOptions:
    out_dir: Path
    slo: SLO = SLO()
    max_concurrency: int | None = None
    request_timeout_s: float = 600.0
    progress: bool = True
    send_true_output_len: bool = False  # to tetri_server only (predictor.kind = oracle)
    num_warmups: int = 0  # unmeasured requests before a started server's first workload
    hidden_len_context: int | None = None  # ClientConfig's: the true length hidden


def run_against(
    spec: ServerSpec,
    workloads: Sequence[tuple[WorkloadSpec, list[BenchRequest]]],
    opts: CompareOptions,
) -> list[BenchResult]:
    """Start one server, run every workload against it in order, stop it."""
    with running_server(spec, opts.out_dir / f"{spec.label}.log") as proc:
        return run_workloads(spec, proc, workloads, opts)


def client_config(spec: ServerSpec, model: str, opts: CompareOptions) -> ClientConfig:
    return ClientConfig(
        spec.base_url,
        model,
        opts.max_concurrency,
        opts.request_timeout_s,
        progress=opts.progress,
        send_true_output_len=opts.send_true_output_len and spec.label != VLLM_LABEL,
        hidden_len_context=opts.hidden_len_context,
    )


WARMUP_OUTPUT_TOKENS = 8


def warmup_requests(requests: Sequence[BenchRequest], n: int) -> list[BenchRequest]:
    """``n`` requests that warm a fresh server for ``requests`` (first calls allocate, tune
    and fill caches; measured, they would lift the first requests' TTFT): the longest and
    the shortest prompts in turn, each with a few output tokens, all at time 0 (sent one at
    a time). So that no prompt of the run is sent twice (a server with prefix caching would
    serve it from cache), token-id prompts are reversed and text prompts start at their
    middle word (the halves swapped: about the same tokens; reversed characters would
    tokenize to twice as many, past the context)."""
    by_len = sorted(requests, key=lambda q: q.prompt_len)
    picks = [by_len[-1 - i // 2] if i % 2 == 0 else by_len[i // 2]
             for i in range(min(n, len(by_len)))]
    return [replace(q, request_id=-1 - i, prompt=_other_order(q.prompt), arrival_s=0.0,
                    output_len=min(q.output_len, WARMUP_OUTPUT_TOKENS), source="warm-up")
            for i, q in enumerate(picks)]


def _other_order(prompt: list[int] | str) -> list[int] | str:
    if not isinstance(prompt, str):
        return prompt[::-1]
    words = prompt.split(" ")
    return " ".join(words[len(words) // 2:] + words[:len(words) // 2])


def warm_up(cfg: ClientConfig, requests: Sequence[BenchRequest], n: int) -> None:
    """Send ``warmup_requests`` one at a time; not measured. A failure is printed, not
    raised: the measured run that follows shows what the server does."""
    if n <= 0 or not requests:
        return
    warm = warmup_requests(requests, n)
    # max_tokens = the few warm-up tokens, even where the run hides its lengths
    cfg = replace(cfg, max_concurrency=1, label=f"{cfg.label}/warm-up", progress=False,
                  hidden_len_context=None)
    run = asyncio.run(run_benchmark(warm, cfg, scrape_metrics=False))
    failed = [r for r in run.records if not r.ok]
    print(f"{cfg.label}: {len(warm)} requests"
          + (f", {len(failed)} failed: {failed[0].error}" if failed else ""), file=sys.stderr)


def run_workloads(
    spec: ServerSpec,
    proc: subprocess.Popen[bytes],
    workloads: Sequence[tuple[WorkloadSpec, list[BenchRequest]]],
    opts: CompareOptions,
) -> list[BenchResult]:
    """Run every workload in order against the started server ``proc`` (a session leader, see
    ``running_server``), with the CPU it, this client and the rest of the machine used."""
    results: list[BenchResult] = []
    model = asyncio.run(fetch_model_name(spec.base_url))
    cfg = client_config(spec, model, opts)
    server_config = {**spec.config(), "served_model": model}
    if workloads:
        warm_up(replace(cfg, label=spec.label), workloads[0][1], opts.num_warmups)
    for wspec, requests in workloads:
        at = "" if wspec.rate_rps is None else f"@{wspec.rate_rps:g}"
        cfg = replace(cfg, label=f"{spec.label}/{wspec.name}{at}")
        cpu_before = session_cpu_s(proc.pid)
        machine_before, client_before = machine_busy_cpu_s(), own_cpu_s()
        run = asyncio.run(run_benchmark(requests, cfg))
        run.server_cpu_s = cpu_delta(cpu_before, session_cpu_s(proc.pid))
        run.client_cpu_s = own_cpu_s() - client_before
        run.machine_cpu_s = machine_busy_cpu_s() - machine_before
        summary = summarize(run, opts.slo, spec.num_workers)
        results.append(BenchResult(spec.label, wspec, summary, run, server_config))
    return results

"""Fault injection: kill, stop and resume the workers of a real server under load, and count what
the clients saw.

    python tools/fault_inject.py --duration 180 --seed 0 --json out.json

Starts ``tetri-server serve`` (disaggregated, small KV pools, short stall bound), records every
request's greedy text once with no faults (the reference), then runs ``--clients`` concurrent
clients for ``--duration`` seconds while a seeded injector, every 2-6 s, picks a ready worker and
SIGKILLs it, SIGSTOPs it for less than ``monitor.stall_timeout_s`` (must be harmless), SIGSTOPs it
for longer (the server must declare it stalled and restart it), or flips its role. At the end it
checks that every KV block is free, reads the restart and stall counters, SIGTERMs the server and
checks that it exits 0 and leaves nothing in /dev/shm. Exit 0 only when no request hung, none
was wrong or malformed, no block leaked and the server exited 0. Results: docs/reliability.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import signal
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

CLIENT_BOUND_S = 150.0  # no answer within this: hung (the server's own bound is 120 s)
STALL_TIMEOUT_S = 2.0
URL_RE = re.compile(r"serving .* at (http://\S+)/v1")
JSON = dict[str, Any]


@dataclass(frozen=True)
class Item:
    """One request of the pool: the reference text is the server's greedy output, fault-free."""

    prompt: list[int]
    max_tokens: int


@dataclass
class Result:
    kind: str  # ok | failed | retryable | hung | bad
    text: str = ""
    num_tokens: int | None = None
    detail: str = ""


@dataclass
class Tally:
    t0: float = field(default_factory=time.monotonic)
    sent: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)  # "503 worker_unavailable: message"
    faults: Counter[str] = field(default_factory=Counter)
    wrong: list[str] = field(default_factory=list)
    bad: list[str] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def note(self, line: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.2f}s] {line}"
        self.log.append(line)
        print(line, flush=True)


# ---------------------------------------------------------------------- server process


def server_command(args: argparse.Namespace) -> list[str]:
    sets = {
        "model.path": args.model, "model.max_model_len": 512, "server.port": 0,
        "server.request_timeout_s": 120, "cluster.prefill_workers": args.prefill_workers,
        "cluster.decode_workers": args.decode_workers, "cluster.threads_per_worker": 1,
        "cluster.restart_backoff_s": 0.2, "cluster.max_restarts": 1000,
        "cluster.worker_wait_s": 30, "monitor.stall_timeout_s": STALL_TIMEOUT_S,
        "predictor.kind": "none", "decode.policy": "greedy", "kv.num_blocks": 64,
        "prefill.chunk_size": 128,
    }
    cmd = [sys.executable, "-m", "tetri_server", "serve"]
    for key, value in sets.items():
        cmd += ["--set", f"{key}={value}"]
    for item in args.set:
        cmd += ["--set", item]
    return cmd


async def start_server(cmd: list[str], log_path: Path) -> tuple[asyncio.subprocess.Process, str]:
    """Start the server (stderr to ``log_path``); return it and its base URL once it serves."""
    log = log_path.open("ab")
    proc = await asyncio.create_subprocess_exec(*cmd, stdout=asyncio.subprocess.PIPE, stderr=log)
    assert proc.stdout is not None
    async with asyncio.timeout(600):
        async for raw in proc.stdout:
            log.write(raw)
            if m := URL_RE.search(raw.decode(errors="replace")):
                break
        else:
            raise SystemExit(f"server exited ({await proc.wait()}) before serving; see {log_path}")

    async def drain_stdout() -> None:
        async for raw in proc.stdout:  # type: ignore[union-attr]
            log.write(raw)

    asyncio.get_running_loop().create_task(drain_stdout())
    return proc, m.group(1)


async def stop_server(proc: asyncio.subprocess.Process, bound_s: float) -> int | None:
    """SIGTERM; the exit code, or None when it did not exit within ``bound_s`` (then killed)."""
    if proc.returncode is not None:
        return proc.returncode
    proc.send_signal(signal.SIGTERM)
    try:
        return await asyncio.wait_for(proc.wait(), bound_s)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        return None


# ---------------------------------------------------------------------- one request


async def error_result(resp: aiohttp.ClientResponse) -> Result:
    """A non-200 answer: clear when it carries an OpenAI-style error body, else bad."""
    try:
        err = (await resp.json(content_type=None))["error"]
        detail = f"{resp.status} {err.get('code') or err['type']}: {str(err['message'])[:90]}"
    except (ValueError, KeyError, TypeError, aiohttp.ClientError):
        return Result("bad", detail=f"HTTP {resp.status} without an error body")
    retryable = resp.status == 503 and "Retry-After" in resp.headers
    return Result("retryable" if retryable else "failed", detail=detail)


async def stream_result(resp: aiohttp.ClientResponse) -> Result:
    """An SSE answer: ok only with a finish_reason and ``data: [DONE]``."""
    text, finish, num_tokens, done = [], None, None, False
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line:
            continue
        if done or not line.startswith("data: "):
            return Result("bad", detail=f"stream line {line[:80]!r}")
        if line == "data: [DONE]":
            done = True
            continue
        obj = json.loads(line[6:])
        if "error" in obj:
            err = obj["error"]
            return Result("failed", detail=f"SSE {err.get('code') or err['type']}: "
                          f"{str(err['message'])[:90]}")
        for choice in obj["choices"]:
            text.append(choice["text"])
            finish = choice["finish_reason"] or finish
        if obj.get("usage"):
            num_tokens = obj["usage"]["completion_tokens"]
    if not done or finish is None:
        return Result("bad", detail=f"stream ended without {'[DONE]' if finish else 'finish'}")
    return Result("ok", "".join(text), num_tokens)


async def complete(session: aiohttp.ClientSession, base: str, model: str, item: Item,
                   stream: bool) -> Result:
    body: JSON = {"model": model, "prompt": item.prompt, "max_tokens": item.max_tokens,
                  "temperature": 0, "ignore_eos": True, "stream": stream}
    if stream:
        body["stream_options"] = {"include_usage": True}
    try:
        async with asyncio.timeout(CLIENT_BOUND_S):
            async with session.post(f"{base}/v1/completions", json=body) as resp:
                if resp.status != 200:
                    return await error_result(resp)
                if stream:
                    return await stream_result(resp)
                obj = await resp.json()
                return Result("ok", obj["choices"][0]["text"], obj["usage"]["completion_tokens"])
    except TimeoutError:
        return Result("hung", detail=f"no answer in {CLIENT_BOUND_S:.0f} s")
    except (aiohttp.ClientError, ValueError, KeyError) as e:
        return Result("bad", detail=f"{type(e).__name__}: {e}")


def judge(tally: Tally, item: Item, ref: str, stream: bool, res: Result) -> None:
    """Count one answer; ok turns into wrong (text differs) or bad (token count differs)."""
    kind = res.kind
    if kind == "ok" and res.text != ref:
        kind = "wrong"
        tally.wrong.append(f"len {len(item.prompt)} max {item.max_tokens} stream {stream}: "
                           f"got {res.text[:60]!r} want {ref[:60]!r}")
    elif kind == "ok" and res.num_tokens != item.max_tokens:
        kind, res.detail = "bad", f"{res.num_tokens} tokens, asked {item.max_tokens}"
    tally.kinds[kind] += 1
    if kind in ("failed", "retryable"):
        tally.errors[res.detail] += 1
    if kind in ("bad", "hung"):
        tally.bad.append(f"{kind}: {res.detail}")
        tally.note(f"request {kind}: {res.detail}")


# ---------------------------------------------------------------------- load and faults


def make_pool(rng: random.Random, n: int) -> list[Item]:
    return [Item([rng.randrange(5, 8000) for _ in range(rng.randint(1, 300))], rng.randint(1, 64))
            for _ in range(n)]


async def client(session: aiohttp.ClientSession, base: str, model: str, pool: list[Item],
                 refs: list[str], rng: random.Random, going: Callable[[], bool],
                 tally: Tally) -> None:
    while going():
        i, stream = rng.randrange(len(pool)), rng.random() < 0.5
        tally.sent += 1
        res = await complete(session, base, model, pool[i], stream)
        judge(tally, pool[i], refs[i], stream, res)
        if res.kind == "retryable":
            await asyncio.sleep(1.0)  # as Retry-After asks, briefly


async def get_workers(session: aiohttp.ClientSession, base: str) -> list[JSON]:
    async with session.get(f"{base}/admin/workers") as resp:
        return (await resp.json())["workers"]


async def signal_fault(pid: int, stop_s: float | None) -> str:
    """SIGKILL (``stop_s`` None) or SIGSTOP for ``stop_s`` then SIGCONT; what happened."""
    if stop_s is None:
        os.kill(pid, signal.SIGKILL)
        return ""
    os.kill(pid, signal.SIGSTOP)
    await asyncio.sleep(stop_s)
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        return f"stopped {stop_s:.1f} s; gone before SIGCONT"
    return f"stopped {stop_s:.1f} s, resumed"


async def flip_fault(session: aiohttp.ClientSession, base: str, w: JSON) -> tuple[str, str]:
    role = "decode" if w["role"] == "prefill" else "prefill"
    async with session.post(f"{base}/admin/flip", json={"worker": w["id"], "role": role},
                            timeout=aiohttp.ClientTimeout(total=60)) as resp:
        body = await resp.json(content_type=None)
    if resp.status == 200:
        return "flip", f"to {role} in {body['total_s']:.2f} s"
    return f"flip_{resp.status}", str(body.get("error", {}).get("message", body))[:90]


async def inject(session: aiohttp.ClientSession, base: str, rng: random.Random,
                 going: Callable[[], bool], tally: Tally) -> None:
    """One fault every 2-6 s on a ready worker, one at a time, while ``going()``."""
    kinds, weights = ["kill", "stop_short", "stop_long", "flip"], [3, 3, 3, 1]
    while True:
        await asyncio.sleep(rng.uniform(2, 6))
        if not going():
            return
        ready = [w for w in await get_workers(session, base) if w["state"] == "ready"]
        if not ready:
            tally.note("no ready worker: no fault this time")
            continue
        w, kind = rng.choice(ready), rng.choices(kinds, weights)[0]
        who = f"worker {w['id']} ({w['role']}, pid {w['pid']}, gen {w['generation']})"
        tally.note(f"{kind} {who}")
        if kind == "flip":
            kind, note = await flip_fault(session, base, w)
        else:
            stop_s = {"kill": None, "stop_short": rng.uniform(0.3, 1.0),
                      "stop_long": rng.uniform(3.0, 6.0)}[kind]
            note = await signal_fault(w["pid"], stop_s)
        tally.faults[kind] += 1
        if note:
            tally.note(f"  {kind} {who}: {note}")


# ---------------------------------------------------------------------- end of run


async def settle(session: aiohttp.ClientSession, base: str, bound_s: float) -> list[JSON]:
    """Workers once every one is ready with no KV block in use, or as they are after bound_s."""
    end = time.monotonic() + bound_s
    while True:
        workers = await get_workers(session, base)
        if all(w["state"] == "ready" and w["load"] and w["load"]["kv_blocks_used"] == 0
               for w in workers) or time.monotonic() > end:
            return workers
        await asyncio.sleep(0.5)


async def read_counters(session: aiohttp.ClientSession, base: str) -> dict[str, float]:
    async with session.get(f"{base}/metrics") as resp:
        text = await resp.text()
    names = ("tetri_worker_restarts_total", "tetri_worker_stalls_total")
    # labelled ({model_name="..."}) or not; -1 when the server does not export it
    return {n: float(m.group(1)) if (m := re.search(rf"^{n}(?:{{[^}}]*}})? (\S+)$", text, re.M))
            else -1.0 for n in names}


def hf_check(model: str, pool: list[Item], refs: list[str], n: int) -> list[str]:
    """transformers' greedy text of the first n items vs the reference; the mismatches."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tetri_server.modelinfo import resolve_model_path

    path = str(resolve_model_path(model))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(path)
    bad = []
    with torch.inference_mode():
        for item, ref in list(zip(pool, refs, strict=True))[:n]:
            ids = torch.tensor([item.prompt])
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                              max_new_tokens=item.max_tokens, min_new_tokens=item.max_tokens,
                              eos_token_id=None, pad_token_id=0)[0].tolist()
            ctx = item.prompt[-5:]  # as the server's detokenizer: a little left context
            full = tok.decode(ctx + out[len(item.prompt):], skip_special_tokens=True)
            text = full[len(tok.decode(ctx, skip_special_tokens=True)):]
            if text != ref:
                bad.append(f"hf {text[:60]!r} server {ref[:60]!r}")
    return bad


# ---------------------------------------------------------------------- main


async def run(args: argparse.Namespace) -> JSON:
    rng = random.Random(args.seed)
    pool = make_pool(rng, args.pool)
    log_path = Path(args.log or tempfile.mkstemp(prefix="fault_inject_", suffix=".log")[1])
    print(f"server log: {log_path}", flush=True)
    proc, base = await start_server(server_command(args), log_path)
    tally = Tally()
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
        async with session.get(f"{base}/v1/models") as resp:
            model = (await resp.json())["data"][0]["id"]
        refs = []
        for item in pool:  # the reference: no faults, one request at a time
            res = await complete(session, base, model, item, stream=False)
            if res.kind != "ok":
                raise SystemExit(f"reference request failed: {res}")
            refs.append(res.text)
        hf_bad = hf_check(args.model, pool, refs, args.hf_check) if args.hf_check else []
        tally.note(f"{base}: {len(pool)} references, hf check {args.hf_check - len(hf_bad)}"
                   f"/{args.hf_check} equal; load + faults for {args.duration:.0f} s")
        deadline = time.monotonic() + args.duration
        going = lambda: time.monotonic() < deadline and proc.returncode is None
        crngs = [random.Random(args.seed * 1000 + i) for i in range(args.clients)]
        await asyncio.gather(
            inject(session, base, random.Random(args.seed + 1), going, tally),
            *(client(session, base, model, pool, refs, r, going, tally) for r in crngs))
        if proc.returncode is not None:
            raise SystemExit(f"server exited {proc.returncode} under load; see {log_path}")
        tally.note("load stopped; waiting for the workers to settle")
        workers = await settle(session, base, 30.0)
        counters = await read_counters(session, base)
    pids = [w["pid"] for w in workers]
    code = await stop_server(proc, 30.0 + 15.0)  # server.drain_timeout_s + margin
    shm_left = [n for n in os.listdir("/dev/shm") if n.startswith(f"tetri-{proc.pid}-")]
    orphans = [p for p in pids if os.path.exists(f"/proc/{p}")]
    return {
        "seed": args.seed, "duration_s": args.duration, "clients": args.clients,
        "sent": tally.sent, "completed": tally.kinds["ok"], "failed_clear": tally.kinds["failed"],
        "retryable_503": tally.kinds["retryable"], "hung": tally.kinds["hung"],
        "wrong": tally.kinds["wrong"], "bad": tally.kinds["bad"], "hf_mismatch": hf_bad,
        "leaked_blocks": sum(w["load"]["kv_blocks_used"] if w["load"] else 0 for w in workers),
        "workers_not_ready": [w["id"] for w in workers if w["state"] != "ready"],
        "faults": dict(tally.faults), "errors": dict(tally.errors.most_common()),
        "restarts": counters["tetri_worker_restarts_total"],
        "stalls": counters["tetri_worker_stalls_total"], "server_exit": code,
        "shm_left": shm_left, "orphan_workers": orphans, "wrong_examples": tally.wrong[:10],
        "bad_examples": tally.bad[:10], "fault_log": tally.log, "server_log": str(log_path),
    }


def passed(r: JSON) -> bool:
    return (r["hung"] == r["wrong"] == r["bad"] == r["leaked_blocks"] == 0
            and r["server_exit"] == 0 and not (r["hf_mismatch"] or r["shm_left"]
                                               or r["orphan_workers"] or r["workers_not_ready"]))


def table(r: JSON) -> str:
    errs = "; ".join(f"{n}x {e}" for e, n in list(r["errors"].items())[:6]) or "-"
    faults = ", ".join(f"{k} {n}" for k, n in sorted(r["faults"].items())) or "-"
    rows = [("requests sent", r["sent"]), ("completed (text equal to reference)", r["completed"]),
            ("failed with a clear error", f"{r['failed_clear']} ({errs})"),
            ("retryable (503 + Retry-After)", r["retryable_503"]),
            ("hung (must be 0)", r["hung"]), ("wrong output (must be 0)", r["wrong"]),
            ("bad: malformed, wrong length, unclear error (must be 0)", r["bad"]),
            ("leaked KV blocks (must be 0)", r["leaked_blocks"]), ("faults", faults),
            ("worker restarts / stalls (metrics)", f"{r['restarts']:.0f} / {r['stalls']:.0f}"),
            ("server exit code after SIGTERM", r["server_exit"]),
            ("/dev/shm entries / worker processes left", f"{len(r['shm_left'])} / "
             f"{len(r['orphan_workers'])}"), ("result", "PASS" if passed(r) else "FAIL")]
    return "\n".join(["| measure | value |", "|---|---|", *(f"| {k} | {v} |" for k, v in rows)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=float, default=180.0, help="seconds of load with faults")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", help="write the results here")
    p.add_argument("--model", default="builtin:tiny")
    p.add_argument("--prefill-workers", type=int, default=2)
    p.add_argument("--decode-workers", type=int, default=2)
    p.add_argument("--clients", type=int, default=6, help="concurrent requests")
    p.add_argument("--pool", type=int, default=40, help="distinct (prompt, max_tokens) requests")
    p.add_argument("--hf-check", type=int, default=3,
                   help="also compare this many references with transformers (0 = skip)")
    p.add_argument("--log", help="server log file (default: a new file in the temp folder)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="extra server config override (repeatable)")
    args = p.parse_args()
    result = asyncio.run(run(args))
    print(table(result))
    for line in result["wrong_examples"] + result["bad_examples"] + result["hf_mismatch"]:
        print(f"  {line}")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
    return 0 if passed(result) else 1


if __name__ == "__main__":
    sys.exit(main())

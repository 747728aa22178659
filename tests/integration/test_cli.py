"""`tetri-server serve` as a user runs it: built-in model on first use, prints the URL, serves
the real `openai` client, and on SIGTERM drains in-flight requests then exits 0 leaving no
shared-memory segment behind."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import openai


def _start(tmp_path, *overrides: str) -> tuple[subprocess.Popen[str], str]:
    env = dict(os.environ, TETRI_CACHE_DIR=str(tmp_path / "cache"))
    args = [sys.executable, "-m", "tetri_server", "serve", "--set", "server.port=0"]
    for o in overrides:
        args += ["--set", o]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)
    lines: list[str] = []
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        m = re.search(r"at (http://\S+)/v1", line)
        if m:
            threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep draining
            return proc, m.group(1)
    proc.kill()
    raise AssertionError("server did not print its URL:\n" + "".join(lines[-40:]))


def test_serve_defaults_builtin_model_and_sigterm_drains(tmp_path):
    proc, url = _start(tmp_path, "server.drain_timeout_s=20")
    pid = proc.pid
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        assert client.models.list().data[0].id == "tiny"
        out = client.completions.create(model="tiny", prompt="Hello there", max_tokens=8)
        assert out.usage.completion_tokens == 8 and out.choices[0].text
        stream = client.completions.create(model="tiny", prompt="Once upon a time",
                                           max_tokens=300, stream=True,
                                           extra_body={"ignore_eos": True})
        first = next(iter(stream))
        assert first.choices[0].text is not None
        proc.send_signal(signal.SIGTERM)  # the stream is in flight: it must finish
        rest = list(stream)
        assert rest[-1].choices[0].finish_reason == "length"
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"tetri-{pid}-")]


def test_bad_config_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tetri_server", "serve", "--set",
                          "cluster.mode=tetris"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "cluster.mode" in out.stderr and "disaggregated" in out.stderr

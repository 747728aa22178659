"""`tetri-server serve` as a user runs it: built-in model on first use, prints the URL, serves
the real `openai` client, and on SIGTERM drains in-flight requests then exits 0 leaving no
shared-memory segment behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import openai
import pytest

from tests.integration.conftest import start_server


def serve_once(tmp_path, *argv: str) -> subprocess.CompletedProcess[str]:  # noqa: ANN001
    """`serve ARGV`, expected to exit (at most 180 s): its result, the cache under tmp_path."""
    return subprocess.run([sys.executable, "-m", "tetri_server", "serve", *argv],
                          capture_output=True, text=True, timeout=180,
                          env=dict(os.environ, TETRI_CACHE_DIR=str(tmp_path / "cache")))


def test_serve_defaults_builtin_model_and_sigterm_drains(tmp_path):
    proc, url = start_server(tmp_path, "server.drain_timeout_s=60")
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
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"tetri-{pid}-")]


def test_ctrl_c_to_the_process_group_drains_without_restarting_workers(tmp_path):
    """Regression: a Ctrl-C in the terminal (SIGINT to the whole process group) killed every
    worker at once; control took it for a crash mid-drain, restarted the workers (loading the
    model again) and re-ran the streams in flight."""
    log: list[str] = []
    proc, url = start_server(tmp_path, "server.drain_timeout_s=60", "cluster.mode=coupled",
                             "cluster.workers=1", new_session=True, log=log)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        stream = client.completions.create(model="tiny", prompt="Once upon a time",
                                           max_tokens=200, stream=True,
                                           extra_body={"ignore_eos": True})
        chunks = [next(iter(stream))]
        os.killpg(proc.pid, signal.SIGINT)  # the stream is in flight: it must finish
        chunks += list(stream)
        assert chunks[-1].choices[0].finish_reason == "length"
        assert proc.wait(120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    text = "".join(log)
    assert "exited with code" not in text and "restarting worker" not in text, text[-3000:]


def test_a_model_swallowed_by_served_model_name_is_a_clear_error(tmp_path, model_dir):
    """Review of session 63: `serve --served-model-name llama FOLDER` took FOLDER as a second
    name and served the built-in random-weight model under "llama". And, as vLLM, auto tool
    choice without a parser is refused."""
    for argv, said in (
            (["--served-model-name", "llama", str(model_dir())], "put MODEL before"),
            ([str(model_dir()), "--enable-auto-tool-choice"], "--tool-call-parser")):
        out = serve_once(tmp_path, *argv)
        assert out.returncode == 2 and said in out.stderr, out.stderr


def test_the_swallowed_model_check_reads_ids_and_the_resolved_parser(tmp_path, model_dir) -> None:  # type: ignore[no-untyped-def]
    """Review of session 63 (second look): a hub id swallowed as a name still served the
    built-in model; a parser given by --set or the config file was not seen beside
    --enable-auto-tool-choice; one served name that is a folder was refused."""
    import argparse

    from tetri_server.cli import _serve_args, build_config
    from tetri_server.config import ConfigError

    parser = argparse.ArgumentParser()
    _serve_args(parser.add_subparsers(dest="cmd"))

    def config(*argv: str):  # noqa: ANN202
        return build_config(parser.parse_args(["serve", *argv]), environ={})

    with pytest.raises(ConfigError, match="put MODEL before"):
        config("--served-model-name", "llama", "meta-llama/Llama-3.2-1B")
    config("--set", "model.tool_call_parser=hermes", "--enable-auto-tool-choice")
    config("--served-model-name", str(tmp_path))  # one name: a name, even a folder's
    # a model from the config file (or --set): a name that looks like a model is a name
    # (regression, review of session 63: refused, though the configured model was served)
    toml = tmp_path / "c.toml"
    toml.write_text(f'[model]\npath = "{model_dir()}"\n')
    cfg, _ = config("--config", str(toml), "--served-model-name", "llama",
                    "meta-llama/Llama-3.2-1B")
    assert (cfg.model.served_name, list(cfg.model.served_aliases)) == (
        "llama", ["meta-llama/Llama-3.2-1B"])
    config("--set", f"model.path={model_dir()}", "--served-model-name", "a", "docs")


def test_the_hub_cache_follows_huggingface_hubs_variables() -> None:
    from tetri_server.cli import hub_cache_dir

    assert str(hub_cache_dir({"HUGGINGFACE_HUB_CACHE": "/data"})) == "/data"
    assert str(hub_cache_dir({"HF_HOME": "$BASE/hf", "BASE": "/srv"})) == "/srv/hf/hub"


def test_bad_config_is_a_clear_error(tmp_path):
    out = subprocess.run([sys.executable, "-m", "tetri_server", "serve", "--set",
                          "cluster.mode=tetris"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "cluster.mode" in out.stderr and "disaggregated" in out.stderr


def test_serve_a_hub_id_from_the_local_cache_vllm_style(tmp_path, model_dir):
    """`tetri-server serve org/name --served-model-name a b --mode coupled` with HF_HOME holding
    the model as huggingface_hub lays it out: listed as a and b with root = the snapshot
    folder, and the id, the aliases and the folder path all accepted as the model."""
    from tests.unit.test_api_serve_args import fake_hub

    snap = fake_hub(tmp_path / "hf", "org/tiny", model_dir("llama", "tiny"))
    proc, url = start_server(tmp_path, "cluster.workers=1", "predictor.kind=none",
                       "decode.policy=greedy", "prefill.chunk_size=64", "kv.num_blocks=64",
                       argv=("org/tiny", "--served-model-name", "a", "b", "--mode", "coupled",
                             "--max-model-len", "128", "--host", "127.0.0.1"),
                       env={"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"})
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        models = client.models.list().data
        assert [m.id for m in models] == ["a", "b"]
        assert {m.model_extra["root"] for m in models} == {str(snap)}
        assert models[0].model_extra["max_model_len"] == 128
        for name in ("a", "b", "org/tiny", str(snap)):
            out = client.completions.create(model=name, prompt="Hi", temperature=0)
            # the name it asked for, as vLLM echoes it (review of session 63: always "a")
            assert out.model == name and out.usage.completion_tokens == 16  # OpenAI's default
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model="other", prompt="Hi", max_tokens=1)
        assert client.models.retrieve("org/tiny").id == "a"
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        finally:
            if proc.poll() is None:
                proc.kill()


def test_unknown_hub_id_is_a_clear_error(tmp_path):
    env = dict(os.environ, HF_HOME=str(tmp_path / "empty"), HF_HUB_OFFLINE="1")
    out = subprocess.run([sys.executable, "-m", "tetri_server", "serve", "org/absent"],
                         capture_output=True, text=True, timeout=60, env=env)
    assert out.returncode == 2
    assert "org/absent" in out.stderr and "Hugging Face cache" in out.stderr


def test_a_worker_that_cannot_start_is_named_with_its_error_in_the_last_line(tmp_path,
                                                                           model_dir):
    """Regression: the server's last line was "worker 0 (prefill) exited with code 1 before it
    was ready"; the cause (here a KV pool too small for one sequence) was only in a worker's
    traceback further up, where a systemd status or a wrapper's last line does not show it."""
    out = serve_once(tmp_path, str(model_dir()), "--port", "0", "--set", "kv.num_blocks=2")
    assert out.returncode == 1, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("tetri-server: the workers did not start"), out.stderr
    assert "before it was ready: ValueError: KV pool of 2 blocks" in last, last
    assert "raise kv.num_blocks" in last, last


def test_a_predictor_artifact_that_is_not_there_is_a_clear_error(tmp_path, model_dir):
    """Regression: a typo in predictor.artifact ended start-up in a PredictorError traceback."""
    out = serve_once(tmp_path, str(model_dir()), "--port", "0", "--set",
                     "predictor.artifact=nope")
    assert out.returncode == 2, out.stderr
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("tetri-server: ") and "nope" in last, out.stderr
    assert "Traceback" not in out.stderr


def test_a_busy_port_is_a_clear_error_before_the_workers_load(tmp_path):
    """Regression: the port was bound only after every worker had loaded its model, and a busy
    one ended in an OSError traceback (systemd then reloaded the model every few seconds)."""
    import socket
    import time

    with socket.socket() as taken:
        taken.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        t0 = time.monotonic()
        out = subprocess.run([sys.executable, "-m", "tetri_server", "serve", "--port",
                              str(port), "--set", "cluster.mode=coupled"],
                             capture_output=True, text=True, timeout=120,
                             env=dict(os.environ, TETRI_CACHE_DIR=str(tmp_path / "cache")))
        elapsed = time.monotonic() - t0
    assert out.returncode == 2, out.stderr
    assert f"cannot listen on 127.0.0.1:{port}" in out.stderr and "Traceback" not in out.stderr
    assert "cluster ready" not in out.stderr + out.stdout, elapsed  # no worker was started


def test_sigterm_while_the_workers_load_stops_at_once(tmp_path):
    """Regression: SIGTERM during start-up waited for every worker to load, then bound the
    port, printed the URL and only then drained."""
    env = dict(os.environ, TETRI_CACHE_DIR=str(tmp_path / "cache"))
    proc = subprocess.Popen([sys.executable, "-m", "tetri_server", "serve", "--set",
                             "server.port=0", "--set", "cluster.mode=coupled"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        lines = []
        for line in proc.stdout:  # the workers start (loading takes seconds: torch, model)
            lines.append(line)
            if "starting" in line and "workers" in line:
                break
        proc.send_signal(signal.SIGTERM)
        rest, _ = proc.communicate(timeout=60)
        assert proc.returncode == 0, "".join(lines) + rest
        assert "serving" not in rest and "Traceback" not in rest, rest
    finally:
        if proc.poll() is None:
            proc.kill()


def test_workers_orphaned_by_a_killed_control_leave_no_kv_pool_behind(tmp_path):
    """Regression (review of session 64): with control killed (-9, an OOM kill), a worker
    whose parent-death signal went the default way died without its cleanup, and its KV pool
    (GiBs of tmpfs) stayed in /dev/shm until the next start; about one run in two."""
    import time

    proc, _ = start_server(tmp_path, "cluster.mode=disaggregated", new_session=True)
    pid = proc.pid
    try:
        pools = [n for n in os.listdir("/dev/shm") if n.startswith(f"tetri-{pid}-")
                 and n.endswith("-kv")]
        assert len(pools) == 2, pools
        os.kill(pid, signal.SIGKILL)
        proc.wait(10)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and any(os.path.exists(f"/dev/shm/{n}")
                                                  for n in pools):
            time.sleep(0.1)
        assert not [n for n in pools if os.path.exists(f"/dev/shm/{n}")]
    finally:
        if proc.poll() is None:
            os.killpg(pid, signal.SIGKILL)
        for n in os.listdir("/dev/shm"):
            if n.startswith(f"tetri-{pid}-"):
                os.unlink(f"/dev/shm/{n}")

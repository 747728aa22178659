"""Hostile input and a workstation's browser: deep JSON, huge lists, token ids the model does
not have, slow tokenizing, idle and surplus connections, DNS rebinding, cross-site requests,
non-JSON bodies, and where the keys come from. Each answer is a clear 4xx/503 (or a closed
connection) with nothing logged as a crash."""

from __future__ import annotations

import http.client
import json
import logging
import os
import shutil
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.test_api_support import ApiHarness, open_stream, raw_request, wait_until
from tetri_server.config import Config, ConfigError, load_config

pytest_plugins = ["tests.unit.test_api_support"]

C, CHAT, FLIP = "/v1/completions", "/v1/chat/completions", "/admin/flip"
OK: dict[str, Any] = {"prompt": "hi", "max_tokens": 2}
MSG: list[dict[str, Any]] = [{"role": "user", "content": "hi"}]


class _View:
    """The shared backend seen through some overridden attributes (``vocab_size``, a
    ``tokenizer``, admin methods); everything else is the backend's own."""

    def __init__(self, backend: Any, **overrides: Any) -> None:
        self._backend = backend
        self.__dict__.update(overrides)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._backend, name)


async def _flip(worker: int, role: str) -> Any:
    raise AssertionError("never reached: the body is refused first")


def _with_admin(api: ApiHarness) -> _View:
    return _View(api.backend, flip=_flip, workers_info=lambda: [{"id": 0, "role": "coupled"}])


@pytest.fixture
def no_crash_logged(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Fails the test if the server logged a traceback or an error while it ran."""
    caplog.set_level(logging.WARNING)
    yield
    crashes = [r for r in caplog.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not crashes, "\n".join(r.getMessage() for r in crashes)


def _error(reply: Any, status: int) -> dict[str, Any]:
    assert reply.status == status, reply.body[:300]
    err = reply.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def _compact(body: dict[str, Any]) -> bytes:
    return json.dumps(body, separators=(",", ":")).encode()


# --- 7. bad and hostile input ----------------------------------------------------------------


@pytest.mark.parametrize("path", [C, CHAT, FLIP])
@pytest.mark.parametrize("body", [b"[" * 100_000, b'{"a":' * 100_000], ids=["array", "object"])
def test_deeply_nested_json_is_a_400_not_a_crash(
    api: ApiHarness, no_crash_logged: None, path: str, body: bytes
) -> None:
    url = api.serve(backend=_with_admin(api))
    err = _error(raw_request(url, "POST", path, body), 400)
    assert err["code"] == "invalid_json" and "nests arrays/objects" in err["message"]
    assert raw_request(url, "POST", C, OK).status == 200


def test_nesting_a_real_client_sends_is_accepted(api: ApiHarness) -> None:
    parts = [{"type": "text", "text": "[[{{ not brackets }}]]"}]
    body = {"messages": [{"role": "user", "content": parts}], "max_tokens": 2}
    assert raw_request(api.base_url, "POST", CHAT, body).status == 200


# (case id, path, body, error.param, text in the message)
TOO_LONG: list[tuple[str, str, dict[str, Any], str, str]] = [
    ("stop-token-ids", C, {**OK, "stop_token_ids": [0] * 2_000_000}, "stop_token_ids", "at most"),
    ("stop", C, {**OK, "stop": ["x"] * 17}, "stop", "at most 16"),
    ("messages", CHAT, {"messages": MSG * 4097}, "messages", "at most 4096 messages"),
    (
        "content-parts",
        CHAT,
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}] * 1025}]},
        "messages[0].content",
        "at most 1024 content parts",
    ),
    ("prompt-ids", C, {**OK, "prompt": [7] * 2_000_000}, "prompt", "context"),
]


@pytest.mark.parametrize(
    ("path", "body", "param", "text"), [c[1:] for c in TOO_LONG], ids=[c[0] for c in TOO_LONG]
)
def test_every_list_field_has_a_length_cap(
    api: ApiHarness, no_crash_logged: None, path: str, body: dict[str, Any], param: str, text: str
) -> None:
    err = _error(raw_request(api.base_url, "POST", path, _compact(body)), 400)
    assert err["param"] == param and text in err["message"], err


def test_token_ids_beyond_the_model_vocabulary_are_refused(api: ApiHarness) -> None:
    """The tokenizer here knows more ids than the model has embeddings (vocab_size): an id the
    model lacks would crash a worker, whether sent or produced by tokenizing text."""
    tok = api.backend.tokenizer
    high = len(tok) - 1
    word = tok.decode([high])
    assert tok.encode(word, add_special_tokens=False) == [high]
    vocab = high - 10
    url = api.serve(backend=_View(api.backend, vocab_size=vocab))
    cases = [
        (C, {**OK, "prompt": [5, high]}, "prompt", f"outside the vocabulary [0, {vocab})"),
        (C, {**OK, "stop_token_ids": [high]}, "stop_token_ids", "outside the vocabulary"),
        (C, {**OK, "prompt": f"say{word}"}, "prompt", "outside the model's vocabulary"),
        (
            CHAT,
            {"messages": [{"role": "user", "content": word}], "max_tokens": 2},
            "messages",
            "outside the model's vocabulary",
        ),
    ]
    for path, body, param, text in cases:
        err = _error(raw_request(url, "POST", path, body), 400)
        assert err["param"] == param and text in err["message"], err
    assert raw_request(url, "POST", C, {**OK, "prompt": [5, vocab - 1]}).status == 200


class _GatedTokenizer:
    """The backend's tokenizer, with ``encode`` and ``apply_chat_template`` held at a gate."""

    def __init__(self, tokenizer: Any) -> None:
        self._tok = tokenizer
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tok, name)

    def __len__(self) -> int:
        return len(self._tok)

    def _hold(self) -> None:
        self.calls += 1
        self.entered.set()
        self.gate.wait(30)  # bounded: with tokenizing on the event loop the test fails, not hangs

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self._hold()
        return self._tok.encode(*args, **kwargs)

    def apply_chat_template(self, *args: Any, **kwargs: Any) -> Any:
        self._hold()
        return self._tok.apply_chat_template(*args, **kwargs)


@pytest.mark.parametrize(
    ("path", "body"), [(C, OK), (CHAT, {"messages": MSG, "max_tokens": 2})], ids=["text", "chat"]
)
def test_tokenizing_does_not_stall_the_server(
    api: ApiHarness, path: str, body: dict[str, Any]
) -> None:
    tok = _GatedTokenizer(api.backend.tokenizer)
    url = api.serve(backend=_View(api.backend, tokenizer=tok))
    replies: list[Any] = []
    client = threading.Thread(target=lambda: replies.append(raw_request(url, "POST", path, body)))
    client.start()
    try:
        assert tok.entered.wait(20), "the request never reached the tokenizer"
        assert raw_request(url, "GET", "/health", timeout_s=10).status == 200
        assert raw_request(api.base_url, "POST", C, OK, timeout_s=20).status == 200
    finally:
        tok.gate.set()
        client.join(60)
    assert replies and replies[0].status == 200, replies


def test_a_prompt_too_long_for_the_context_is_refused_before_tokenizing(api: ApiHarness) -> None:
    tok = _GatedTokenizer(api.backend.tokenizer)
    tok.gate.set()
    url = api.serve(backend=_View(api.backend, tokenizer=tok))
    longest = max(map(len, tok.get_vocab()))
    text = "a" * (api.backend.max_model_len * longest * 4 + 1)
    for path, body, param in [
        (C, {**OK, "prompt": text}, "prompt"),
        (CHAT, {"messages": [{"role": "user", "content": text}]}, "messages"),
    ]:
        err = _error(raw_request(url, "POST", path, body), 400)
        assert err["code"] == "context_length_exceeded" and err["param"] == param
        assert "characters" in err["message"]
    assert tok.calls == 0


# --- 7. connections --------------------------------------------------------------------------


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=20)


@pytest.mark.parametrize(
    "sent", [b"", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n"], ids=["idle", "slow-head"]
)
def test_idle_and_slow_connections_are_closed(api: ApiHarness, sent: bytes) -> None:
    url = api.serve(keepalive_timeout_s=0.5)
    with _connect(url) as sock:
        sock.sendall(sent)
        assert sock.recv(65536) == b""  # closed by the server (a timeout here raises)


def test_connections_beyond_the_cap_get_503_with_retry_after(api: ApiHarness) -> None:
    url = api.serve(max_connections=2)
    host, port = url.removeprefix("http://").split(":")
    held = [http.client.HTTPConnection(host, int(port), timeout=20) for _ in range(2)]
    for conn in held:  # a full request each: both are open and counted
        conn.request("GET", "/health")
        assert conn.getresponse().read() and conn.sock is not None
    reply = raw_request(url, "GET", "/health")
    err = _error(reply, 503)
    assert err["code"] == "too_many_connections" and reply.headers["retry-after"] == "1"
    held[0].close()
    assert wait_until(lambda: raw_request(url, "GET", "/health").status == 200)
    held[1].close()


# --- 8. a workstation's browser ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("host", "status"),
    [
        ("evil.example", 421),
        ("evil.example:8000", 421),
        ("127.0.0.1.evil.example", 421),
        ("localhost:1234", 200),
        ("LOCALHOST", 200),
        ("127.0.0.1", 200),
        ("[::1]:8000", 200),
    ],
)
def test_loopback_server_answers_only_to_loopback_host_names(
    api: ApiHarness, host: str, status: int
) -> None:
    for path in ("/v1/models", "/metrics"):
        reply = raw_request(api.base_url, "GET", path, headers={"Host": host})
        assert reply.status == status, reply.body
    if status == 421:
        err = reply.json()["error"]
        assert err["code"] == "host_not_allowed" and repr(host) in err["message"]


def test_a_loopback_bind_spelled_otherwise_keeps_the_host_checks(api: ApiHarness) -> None:
    """Regression (review of session 64): --host 127.1 binds 127.0.0.1, but was not taken for
    loopback (ipaddress does not read that spelling), so the DNS-rebinding Host check and the
    cross-site Origin check were off."""
    from tetri_server.config import ServerConfig

    assert ServerConfig(host="127.1").is_loopback and ServerConfig(host="127.0.0.1").is_loopback
    assert not ServerConfig(host="0.0.0.0").is_loopback
    url = api.serve(host="127.1")
    assert raw_request(url, "GET", "/v1/models", headers={"Host": "evil.example"}).status == 421


def test_allowed_hosts_and_non_loopback_binds(api: ApiHarness) -> None:
    url = api.serve(allowed_hosts=("box.lan",))
    assert raw_request(url, "GET", "/v1/models", headers={"Host": "box.lan:8000"}).status == 200
    assert raw_request(url, "GET", "/v1/models", headers={"Host": "evil.example"}).status == 421
    url = api.serve(host="0.0.0.0")  # not loopback: no Host check unless configured
    assert raw_request(url, "GET", "/v1/models", headers={"Host": "box.lan"}).status == 200
    url = api.serve(host="0.0.0.0", allowed_hosts=("box.lan",))
    assert raw_request(url, "GET", "/v1/models", headers={"Host": "other.lan"}).status == 421


@pytest.mark.parametrize(
    ("origin", "status"),
    [
        ("https://evil.example", 403),
        ("http://localhost.evil.example", 403),
        ("null", 403),
        ("http://localhost:3000", 200),
        ("http://127.0.0.1:8000", 200),
        ("http://[::1]", 200),
    ],
)
def test_loopback_server_refuses_cross_site_browser_requests(
    api: ApiHarness, origin: str, status: int
) -> None:
    reply = raw_request(api.base_url, "POST", C, OK, headers={"Origin": origin})
    assert reply.status == status, reply.body
    if status == 403:
        err = reply.json()["error"]
        assert err["code"] == "origin_not_allowed" and repr(origin) in err["message"]


def test_allowed_origins(api: ApiHarness) -> None:
    url = api.serve(allowed_origins=("https://ui.example",))
    assert raw_request(url, "POST", C, OK, headers={"Origin": "https://ui.example"}).status == 200
    assert raw_request(url, "POST", C, OK, headers={"Origin": "https://evil.example"}).status == 403
    url = api.serve(host="0.0.0.0")
    assert raw_request(url, "POST", C, OK, headers={"Origin": "https://evil.example"}).status == 200


def _post(url: str, path: str, body: bytes, headers: dict[str, str]) -> tuple[int, Any]:
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request("POST", path, body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


@pytest.mark.parametrize("path", [C, CHAT, FLIP])
@pytest.mark.parametrize(
    "headers",
    [{}, {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"}],
    ids=["missing", "text-plain", "form"],
)
def test_post_bodies_must_be_declared_json(
    api: ApiHarness, path: str, headers: dict[str, str]
) -> None:
    url = api.serve(backend=_with_admin(api))
    status, body = _post(url, path, _compact(OK), headers)
    assert status == 415 and body["error"]["code"] == "unsupported_media_type", body
    assert "application/json" in body["error"]["message"]


def test_json_with_a_charset_is_json(api: ApiHarness) -> None:
    headers = {"Content-Type": "application/json; charset=utf-8"}
    assert _post(api.base_url, C, _compact(OK), headers)[0] == 200


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs curl")
def test_the_readme_curl_command_works(api: ApiHarness) -> None:
    def curl(*args: str) -> str:
        cmd = ["curl", "-s", "--max-time", "60", *args, "-d", json.dumps(OK), api.base_url + C]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=90).stdout

    assert json.loads(curl("-H", "Content-Type: application/json"))["usage"]["total_tokens"] > 0
    assert json.loads(curl())["error"]["code"] == "unsupported_media_type"  # form-encoded


def test_admin_routes_take_their_own_key(api: ApiHarness) -> None:
    url = api.serve(backend=_with_admin(api), api_key="user", admin_api_key="root")

    def status(path: str, key: str) -> int:
        return raw_request(url, "GET", path, headers={"Authorization": f"Bearer {key}"}).status

    assert (status("/admin/workers", "root"), status("/admin/workers", "user")) == (200, 401)
    assert (status("/v1/models", "user"), status("/v1/models", "root")) == (200, 401)
    url = api.serve(backend=_with_admin(api), admin_api_key="root")  # /v1 stays open
    assert raw_request(url, "GET", "/v1/models").status == 200
    reply = raw_request(url, "GET", "/admin/workers")
    assert reply.status == 401 and "admin API key" in reply.json()["error"]["message"]


# --- 8. where the keys come from ----------------------------------------------------------------


def test_api_key_precedence_file_then_env_then_set(tmp_path: Path) -> None:
    path = tmp_path / "config.toml"
    path.write_text('[server]\napi_key = "from-file"\n')
    assert load_config(path, environ={}).server.api_key == "from-file"
    env = {"TETRI_API_KEY": "from-env", "TETRI_ADMIN_API_KEY": "admin-env"}
    cfg = load_config(path, environ=env).server
    assert (cfg.api_key, cfg.admin_api_key) == ("from-env", "admin-env")
    assert load_config(path, ["server.api_key=from-set"], environ=env).server.api_key == "from-set"


def test_vllms_api_key_variable_is_honoured() -> None:
    """Regression: a vLLM unit or container setting VLLM_API_KEY (with --host 0.0.0.0) got a
    server with no authentication at all, silently. TETRI_API_KEY wins where both are set."""
    assert load_config(None, environ={"VLLM_API_KEY": "v"}).server.api_key == "v"
    both = {"VLLM_API_KEY": "v", "TETRI_API_KEY": "t"}
    assert load_config(None, environ=both).server.api_key == "t"


def test_vllms_api_key_variable_beside_our_key_file_leaves_the_file_in_charge(caplog, tmp_path) -> None:  # noqa: ANN001, E501
    """Regression: VLLM_API_KEY left in a shared environment (a unit's EnvironmentFile) beside
    server.api_key_file refused to start, naming only TETRI_API_KEY. The file wins, with a
    warning; our own variable or --api-key beside the file is still refused."""
    env = {"VLLM_API_KEY": "v"}
    cfg = load_config(None, ["server.api_key_file=/etc/tetri/key"], environ=env).server
    assert (cfg.api_key, cfg.api_key_file) == ("", "/etc/tetri/key")
    assert "VLLM_API_KEY is ignored" in caplog.text
    with pytest.raises(ConfigError, match="both"):
        load_config(None, ["server.api_key_file=/k"], environ={"TETRI_API_KEY": "t"})
    with pytest.raises(ConfigError, match="both"):
        load_config(None, ["server.api_key_file=/k", "server.api_key=x"], environ=env)
    # an explicit key equal to the variable's (a vLLM unit's --api-key $VLLM_API_KEY)
    with pytest.raises(ConfigError, match="both"):
        load_config(None, ["server.api_key_file=/k", "server.api_key=v"], environ=env)
    with pytest.raises(ConfigError, match="both"):
        load_config(None, ["server.api_key_file=/k"], environ=env,
                    flags={"server": {"api_key": "v"}})
    both = tmp_path / "both.toml"  # the file's own conflict stays one with the variable set
    both.write_text('[server]\napi_key = "a"\napi_key_file = "/k"\n')
    with pytest.raises(ConfigError, match="both"):
        load_config(both, environ=env)
    # a copy of the shipped config.toml (``api_key = ""``) gives no key: it was refused
    shipped = tmp_path / "shipped.toml"
    shipped.write_text('[server]\napi_key = ""\napi_key_file = "/k"\n')
    assert load_config(shipped, environ=env).server.api_key_file == "/k"


def test_every_secret_is_redacted() -> None:
    cfg = load_config(None, ["server.api_key=a", "server.admin_api_key=b"], environ={})
    server = cfg.to_dict()["server"]
    assert (server["api_key"], server["admin_api_key"]) == ("<redacted>", "<redacted>")
    assert Config.from_dict(cfg.to_dict(redact=False)) == cfg
    assert "<redacted>" not in json.dumps(Config().to_dict())


def test_api_key_file_is_read_at_start_up(
    api: ApiHarness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    key_file = tmp_path / "key"
    key_file.write_text("  s3cret\n")
    os.chmod(key_file, 0o600)
    caplog.set_level(logging.WARNING)
    url = api.serve(api_key_file=str(key_file))
    assert raw_request(url, "GET", "/v1/models").status == 401
    ok = raw_request(url, "GET", "/v1/models", headers={"Authorization": "Bearer s3cret"})
    assert ok.status == 200
    assert "api_key_file" not in caplog.text
    os.chmod(key_file, 0o644)
    api.serve(api_key_file=str(key_file))
    assert "can be read by other users" in caplog.text


def test_api_key_file_errors_name_the_key(api: ApiHarness, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="api_key_file.*cannot read"):
        api.serve(api_key_file=str(tmp_path / "missing"))
    (tmp_path / "empty").write_text(" \n")
    with pytest.raises(ConfigError, match="api_key_file.*empty"):
        api.serve(api_key_file=str(tmp_path / "empty"))
    with pytest.raises(ConfigError, match="both set"):
        load_config(None, ["server.api_key_file=/k"], environ={"TETRI_API_KEY": "x"})


class _Endless:
    """A backend whose every request streams long tokens until aborted."""

    def __init__(self, like: Any) -> None:
        self.model_name, self.max_model_len = like.model_name, like.max_model_len
        self.tokenizer, self.eos_token_ids = like.tokenizer, like.eos_token_ids
        self.vocab_size = like.vocab_size
        vocab = self.tokenizer.get_vocab().values()
        self.token = max(vocab, key=lambda t: len(self.tokenizer.decode([t])))
        self.aborted: list[int] = []

    def is_ready(self) -> bool:
        return True

    def submit(self, prompt_ids, params, *, prompt_text="", true_output_len=None):  # noqa: ANN001, ANN201
        import asyncio

        from tetri_server.messages import TokenDelta

        backend = self

        class Stream:
            req_id = 0

            async def __aiter__(self):  # noqa: ANN204
                while True:
                    await asyncio.sleep(0.001)
                    yield TokenDelta(0, [backend.token])

            async def abort(self, *, stopped: bool = False) -> None:
                backend.aborted.append(self.req_id)

        return Stream()


def test_a_stream_past_its_deadline_is_aborted_before_its_error_event_is_written(
        api: ApiHarness, monkeypatch: pytest.MonkeyPatch) -> None:
    """Regression: after request_timeout_s the handler wrote the error event, then aborted the
    request: to a client that stopped reading, the write waited for good, and the request kept
    generating (and holding KV) and counted as in flight until the client closed its socket."""
    import asyncio

    from tetri_server.api import sse

    async def never_written(self, err) -> None:  # noqa: ANN001 - a client that reads nothing
        await asyncio.Event().wait()

    monkeypatch.setattr(sse.EventStream, "fail", never_written)
    backend = _Endless(api.backend)
    url = api.serve(backend=backend, request_timeout_s=1.0)
    sock = open_stream(url, "/v1/completions", {"prompt": "hi", "max_tokens": 100,
                                                "stream": True})
    try:
        assert wait_until(lambda: backend.aborted, 20), "the request was never aborted"
    finally:
        sock.close()


def test_the_closing_writes_to_a_client_that_reads_nothing_are_bounded(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The error event and [DONE] wait at most TAIL_TIMEOUT_S, then the connection closes."""
    import asyncio
    from types import SimpleNamespace

    from tetri_server.api import sse
    from tetri_server.api.errors import timeout_error

    monkeypatch.setattr(sse, "TAIL_TIMEOUT_S", 0.2, raising=False)
    aborted: list[bool] = []

    async def main() -> None:
        stream = sse.EventStream(SimpleNamespace(transport=SimpleNamespace(
            abort=lambda: aborted.append(True))))  # type: ignore[arg-type]

        async def blocked(data: bytes) -> None:
            await asyncio.Event().wait()

        stream.response = SimpleNamespace(prepared=True, write=blocked)  # type: ignore[assignment]
        await asyncio.wait_for(stream.fail(timeout_error(1.0)), 5)
        with pytest.raises(ConnectionResetError):
            await asyncio.wait_for(stream.done({"usage": {}}), 5)

    asyncio.run(main())
    assert aborted == [True, True]


def test_odd_but_valid_bodies_and_impossible_counts_get_the_right_status(
        api: ApiHarness) -> None:
    """Review of session 63: a gzip body that does not decompress was a 500 (the error
    middleware's catch-all), a body opening with a UTF-8 BOM a 400 (json.loads and vLLM take
    it), and more choices than server.max_queued_requests a 429 that no retry could pass."""
    body = json.dumps({"prompt": "hi", "max_tokens": 1}).encode()
    broken = raw_request(api.base_url, "POST", "/v1/completions", body,
                         {"Content-Encoding": "gzip"})
    assert broken.status == 400 and broken.json()["error"]["code"] == "invalid_body"
    bom = raw_request(api.base_url, "POST", "/v1/completions", b"\xef\xbb\xbf" + body)
    assert bom.status == 200, bom.body
    small = api.serve(max_queued_requests=4)
    too_many = raw_request(small, "POST", "/v1/completions",
                           {"prompt": "hi", "max_tokens": 1, "n": 8})
    assert too_many.status == 400 and too_many.json()["error"]["param"] == "n"


def test_the_response_id_carries_the_clients_request_id(api: ApiHarness) -> None:
    """Review of session 63: vLLM builds the id from X-Request-Id, else the body's request_id;
    ours was always random."""
    body = {"prompt": "hi", "max_tokens": 1}
    got = raw_request(api.base_url, "POST", "/v1/completions", body,
                      {"X-Request-Id": "abc-123"}).json()
    assert got["id"] == "cmpl-abc-123"
    got = raw_request(api.base_url, "POST", "/v1/chat/completions",
                      {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1,
                       "request_id": "r7"}).json()
    assert got["id"] == "chatcmpl-r7"
    # a header byte that is no UTF-8 (aiohttp's surrogate escape could not be written as JSON:
    # a stream got HTTP 200 and an error event, no tokens); read as latin-1, as vLLM does
    streamed = raw_request(api.base_url, "POST", "/v1/completions", {**body, "stream": True},
                           {"X-Request-Id": "ab\xffc"})
    assert b'"id":"cmpl-ab\xc3\xbfc"' in streamed.body and b"[DONE]" in streamed.body

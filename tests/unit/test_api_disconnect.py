"""A client that goes away aborts its request: its KV blocks are freed and it is counted as
``tetri_requests_total{finish_reason="abort"}``, streaming or not, at any point."""

from __future__ import annotations

import random
import threading
import time

from tests.unit.test_api_double import EngineBackend
from tests.unit.test_api_support import (
    ApiHarness,
    metric,
    open_stream,
    read_events,
    slow_generation,
    wait_until,
)

pytest_plugins = ["tests.unit.test_api_support"]

C, CHAT = "/v1/completions", "/v1/chat/completions"
LONG = {"prompt": "Go on", "max_tokens": 200, "temperature": 0, "ignore_eos": True}


def _aborts(api: ApiHarness) -> float:
    return metric(api.base_url, "tetri_requests_total", finish_reason="abort")


def _idle(api: ApiHarness) -> bool:
    return (
        metric(api.base_url, "tetri_kv_blocks_used") == 0
        and metric(api.base_url, "tetri_requests_running") == 0
    )


def _num_aborted(api: ApiHarness) -> int:
    backend = api.backend
    return len(backend.aborted) if isinstance(backend, EngineBackend) else 0


def test_stream_disconnect_aborts_the_request(api: ApiHarness) -> None:
    before, aborted = _aborts(api), _num_aborted(api)
    with slow_generation(api), open_stream(api.base_url, C, {**LONG, "stream": True}) as sock:
        assert read_events(sock, until=b"data: ", count=3).count(b"data: ") == 3
        assert metric(api.base_url, "tetri_kv_blocks_used") > 0
        sock.close()
        assert wait_until(lambda: _aborts(api) == before + 1)
        assert wait_until(lambda: _idle(api))
    if isinstance(api.backend, EngineBackend):
        assert _num_aborted(api) == aborted + 1


def test_non_streaming_disconnect_aborts_the_request(api: ApiHarness) -> None:
    before = _aborts(api)
    with (
        slow_generation(api),
        open_stream(
            api.base_url,
            CHAT,
            {
                "messages": [{"role": "user", "content": "hi"}],
                **LONG,
                "prompt": None,
            },
        ) as sock,
    ):
        assert wait_until(lambda: metric(api.base_url, "tetri_kv_blocks_used") > 0)
        sock.close()
        assert wait_until(lambda: _aborts(api) == before + 1)
        assert wait_until(lambda: _idle(api))


def test_many_clients_leaving_at_random_points_free_everything(api: ApiHarness) -> None:
    rng = random.Random(7)
    num_clients = 12
    plans = [rng.choice([0, 1, 2, 5, 9, None]) for _ in range(num_clients)]  # None: read all
    errors: list[BaseException] = []

    def client(events: int | None, path: str) -> None:
        body = {**LONG, "max_tokens": 40, "stream": True}
        if path == CHAT:
            body = {**body, "prompt": None, "messages": [{"role": "user", "content": "x"}]}
        try:
            with open_stream(api.base_url, path, body) as sock:
                if events is None:
                    assert b"data: [DONE]" in read_events(sock, until=b"data: [DONE]")
                elif events:
                    read_events(sock, until=b"data: ", count=events)
                else:
                    time.sleep(rng.random() * 0.05)
        except BaseException as e:  # reported below, in the test's thread
            errors.append(e)

    with slow_generation(api, 0.005):
        threads = [
            threading.Thread(target=client, args=(plan, C if i % 2 else CHAT))
            for i, plan in enumerate(plans)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert wait_until(lambda: _idle(api))
    assert metric(api.base_url, "tetri_kv_blocks_total") > 0


def test_a_cancel_that_lands_with_a_token_is_not_lost() -> None:
    """Regression (review of session 64): the control's stream waited with asyncio.wait_for,
    which on Python 3.11 returns the item and drops a cancel of the same loop turn: a client
    that left as a token arrived (or the request's HTTP deadline) was lost, and its request
    ran on to max_tokens, holding its KV blocks, counted as finished, not aborted."""
    import asyncio

    from tetri_server.control.requests import Request, Stream
    from tetri_server.messages import SamplingParams, TokenDelta

    class Owner:
        def fail(self, req, error, retry_after_s=None) -> None:  # noqa: ANN001
            pass

        def abort(self, req_id: int, *, stopped: bool = False) -> None:
            pass

    async def main() -> tuple[bool, list[list[int]]]:
        req = Request(7, [1, 2], SamplingParams(max_tokens=4), "", None)
        seen: list[list[int]] = []

        async def consume() -> None:
            async for d in Stream(Owner(), req, 600.0):
                seen.append(d.token_ids)

        task = asyncio.ensure_future(consume())
        await asyncio.sleep(0.01)
        req.queue.put_nowait(TokenDelta(req.req_id, [5]))  # a token arrives ...
        task.cancel()  # ... as the client goes away
        await asyncio.sleep(0.05)
        for tok in (6, 7):
            req.queue.put_nowait(TokenDelta(req.req_id, [tok]))
            await asyncio.sleep(0.01)
        return task.cancelled(), seen

    cancelled, seen = asyncio.run(main())
    assert cancelled and seen == []

"""TEST DOUBLE of ``control.protocol.Backend`` for the API tests (no tests here).

``EngineBackend``: one in-process ``LLMEngine`` stepped in a worker thread, so the real model
produces the tokens without the multi-process cluster. It reports KV usage and busy time to
``Metrics`` as the real backend does, and has fault knobs for tests that need them:
``ready``, ``queue_full``, ``fail_after``, ``step_delay_s`` and ``script`` (every request
answers these token ids instead of the model's, a few per delta, then ``stop``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from tetri_server.control.protocol import (
    GenerationError,
    InvalidRequestError,
    QueueFullError,
    join_prompt_part,
)
from tetri_server.engine.grammar import GuideError
from tetri_server.messages import PromptLogprobs, SamplingParams, TokenDelta
from tetri_server.metrics import Metrics

MAX_MODEL_LEN = 256
NUM_BLOCKS = 64  # 16-token blocks: room for 4 full-length sequences
MODEL_NAME = "tiny-test"

Close = Callable[[], Awaitable[None]]


class _Stream:
    """RequestStream of the test double."""

    def __init__(self, backend: EngineBackend, req_id: int) -> None:
        self.req_id = req_id
        self._backend = backend
        self.queue: asyncio.Queue[TokenDelta | Exception] = asyncio.Queue()
        self.num_tokens = 0
        self.prompt_part: PromptLogprobs | None = None

    def __aiter__(self) -> AsyncIterator[TokenDelta]:
        return self._iter()

    async def _iter(self) -> AsyncIterator[TokenDelta]:
        while True:
            item = await self.queue.get()
            if isinstance(item, Exception):
                raise item
            yield item
            if item.finish_reason is not None:
                return

    async def abort(self, *, stopped: bool = False) -> None:
        self._backend.abort(self.req_id)


class EngineBackend:
    """TEST DOUBLE of the cluster backend: a single in-process engine (see module doc)."""

    def __init__(self, model_path: Path, metrics: Metrics) -> None:
        from transformers import AutoTokenizer

        from tetri_server.llm import make_engine

        self.engine = make_engine(str(model_path), f"kv.num_blocks={NUM_BLOCKS}",
                                  f"model.max_model_len={MAX_MODEL_LEN}")
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self.model_name = MODEL_NAME
        self.max_model_len = self.engine.max_model_len
        self.eos_token_ids = tuple(self.engine.spec.eos_token_ids)
        self.vocab_size = self.engine.spec.vocab_size
        self.metrics = metrics
        self.ready = True  # knob: is_ready()
        self.queue_full = False  # knob: submit raises QueueFullError
        self.fail_after: int | None = None  # knob: new requests fail after this many tokens
        self.step_delay_s = 0.0  # knob: extra seconds per engine step (slow generation)
        self.script: list[int] | None = None  # knob: the reply of every request, as token ids
        self.aborted: list[int] = []  # request ids abort() was called for
        self._streams: dict[int, _Stream] = {}
        self._fail_at: dict[int, int] = {}
        self._commands: list[tuple[str, int, Any]] = []
        self._ids = itertools.count()
        self._wake = asyncio.Event()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="engine")
        self._busy_s = 0.0
        self._driver = asyncio.get_running_loop().create_task(self._drive())

    def is_ready(self) -> bool:
        return self.ready

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        *,
        prompt_text: str = "",
        true_output_len: int | None = None,
    ) -> _Stream:
        if self.queue_full:
            raise QueueFullError(retry_after_s=2.0)
        stream = _Stream(self, next(self._ids))
        if self.script is not None:
            for i in range(0, len(self.script), 3):
                reason = "stop" if i + 3 >= len(self.script) else None
                stream.queue.put_nowait(TokenDelta(stream.req_id, self.script[i : i + 3], None,
                                                   reason))
            return stream
        self._streams[stream.req_id] = stream
        if self.fail_after is not None:
            self._fail_at[stream.req_id] = self.fail_after
        self._commands.append(("add", stream.req_id, (prompt_ids, params)))
        self._wake.set()
        return stream

    def abort(self, req_id: int) -> None:
        self.aborted.append(req_id)
        if self._streams.pop(req_id, None) is not None:
            self._commands.append(("abort", req_id, None))
            self._wake.set()

    async def close(self) -> None:
        self._driver.cancel()
        self._pool.shutdown(wait=True)

    def _apply_commands(self) -> None:
        commands, self._commands = self._commands, []
        for op, req_id, arg in commands:
            if op == "abort":
                self.engine.abort(req_id)
                continue
            try:
                self.engine.add_request(req_id, *arg)
            except GuideError as e:  # as a worker reports it: RequestFailed(invalid=True)
                self._fail(req_id, str(e), InvalidRequestError)
            except ValueError as e:
                self._fail(req_id, str(e))

    def _fail(self, req_id: int, reason: str,
              error: type[GenerationError] = GenerationError) -> None:
        stream = self._streams.pop(req_id, None)
        self.engine.abort(req_id)
        if stream is not None:
            stream.queue.put_nowait(error(reason))

    def _timed_step(self) -> list[TokenDelta]:
        t0 = time.perf_counter()
        if self.step_delay_s:
            time.sleep(self.step_delay_s)
        try:
            return self.engine.step()
        finally:
            self._busy_s += time.perf_counter() - t0

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._wake.wait()
            self._wake.clear()
            self._apply_commands()
            while self.engine.has_unfinished():
                deltas = await loop.run_in_executor(self._pool, self._timed_step)
                self._deliver(deltas)
                self._apply_commands()
            self._report()

    def _deliver(self, deltas: list[TokenDelta]) -> None:
        for d in deltas:
            stream = self._streams.get(d.req_id)
            if stream is None:
                continue
            if d.prompt_logprobs is not None:  # as the cluster joins the parts
                stream.prompt_part, forward = join_prompt_part(stream.prompt_part, d)
                if not forward:
                    continue
            stream.num_tokens += len(d.token_ids)
            limit = self._fail_at.get(d.req_id)
            if limit is not None and stream.num_tokens > limit and d.finish_reason is None:
                self._fail(d.req_id, "injected failure (test double)")
                continue
            stream.queue.put_nowait(d)
            if d.finish_reason is not None:
                self._streams.pop(d.req_id, None)
        self._report()

    def _report(self) -> None:
        load = self.engine.loop.admission.load()
        self.metrics.set_requests(running=load.num_running,
                                  waiting=len(self.engine.loop.queue) + load.num_waiting)
        alloc = self.engine.allocator
        self.metrics.set_worker(
            0,
            "coupled",
            blocks_used=alloc.num_used,
            blocks_total=alloc.num_blocks,
            busy_s=self._busy_s,
        )


async def make_engine_backend(model_path: Path, metrics: Metrics) -> tuple[Any, Close]:
    backend = EngineBackend(model_path, metrics)
    return backend, backend.close

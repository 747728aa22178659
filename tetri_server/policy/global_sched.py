"""The global scheduler's pick: which worker receives a new request.

Contract: the control process feeds every load report (a ``views.WorkerLoad``) to ``on_report``
and calls ``pick(num_prompt_tokens)`` per new request. Reports are up to one monitor interval
old, so the picker adds what it sent to each worker since that worker's last report (a report
resets it); without that, a burst of arrivals would all land on the same worker.

Load, disaggregated: prompt tokens queued or being prefilled on a ``prefill`` worker. Coupled
(every worker prefills and decodes): requests waiting or running, then queued prompt tokens.
Ties go to the lowest worker id.

Elastic (``local_prefill``, disaggregated only): the prompt goes to a decode worker instead of
the least-loaded prefill worker where ``LocalPrefill`` says it finishes sooner there (or, with no
prefill worker serving, to a decode worker with room); both sides' backlogs count what was sent
since their last report. The router and the simulator call this one pick, so they place prompts
alike.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass

from tetri_server.policy.elastic import LocalPrefill
from tetri_server.policy.views import WorkerLoad


@dataclass(frozen=True)
class _Sent:
    num_requests: int = 0
    num_prompt_tokens: int = 0


class LeastLoadedPicker:
    """Least-loaded worker choice for new requests (TetriInfer's global scheduler)."""

    def __init__(self, *, coupled: bool = False, local_prefill: LocalPrefill | None = None) -> None:
        self.coupled = coupled
        self.local_prefill = None if coupled else local_prefill
        self._reports: dict[int, WorkerLoad] = {}
        self._sent: dict[int, _Sent] = {}

    def on_report(self, report: WorkerLoad) -> None:
        """Adopt a worker's latest report; forget what was sent to it before."""
        self._reports[report.worker_id] = report
        self._sent[report.worker_id] = _Sent()

    def remove_worker(self, worker_id: int) -> None:
        """A worker died or left; it is not picked until it reports again."""
        self._reports.pop(worker_id, None)
        self._sent.pop(worker_id, None)

    def queued_tokens(self, worker_id: int) -> int:
        """Prompt tokens queued on ``worker_id``: its report's plus those sent since."""
        return (self._reports[worker_id].num_queued_prompt_tokens
                + self._sent[worker_id].num_prompt_tokens)

    def load(self, worker_id: int) -> tuple[int, ...]:
        """The sort key of ``worker_id`` (smaller is less loaded)."""
        r, sent = self._reports[worker_id], self._sent[worker_id]
        if self.coupled:
            return (r.num_waiting + r.num_running + sent.num_requests,
                    self.queued_tokens(worker_id), worker_id)
        return (self.queued_tokens(worker_id), worker_id)

    def pick(self, num_prompt_tokens: int, exclude: Collection[int] = (),
             chunk_sizes: Mapping[int, int] | None = None) -> int | None:
        """The least-loaded eligible worker (or, elastic, a decode worker that finishes the
        prompt sooner, or one with room when no prefill worker is eligible), counted as loaded
        with this request; None when no worker is eligible.
        ``exclude``: workers not to route to (draining, restarting); ``chunk_sizes``: each
        prefill worker's chunk (missing: 1)."""
        eligible = [
            wid
            for wid, r in self._reports.items()
            if wid not in exclude and (self.coupled or r.role == "prefill")
        ]
        worker_id = min(eligible, key=self.load) if eligible else None
        if self.local_prefill is not None:
            decodes = [(wid, self.queued_tokens(wid),
                        r.num_waiting + r.num_running + self._sent[wid].num_requests,
                        r.num_free_blocks)
                       for wid, r in self._reports.items()
                       if wid not in exclude and r.role == "decode"]
            backlog, chunk = None, 1  # no prefill worker: any decode worker with room
            if worker_id is not None:
                backlog = self.queued_tokens(worker_id)
                chunk = (chunk_sizes or {}).get(worker_id) or 1
            other = self.local_prefill.pick(num_prompt_tokens, backlog, chunk, decodes)
            worker_id = worker_id if other is None else other
        if worker_id is None:
            return None
        sent = self._sent[worker_id]
        self._sent[worker_id] = _Sent(
            sent.num_requests + 1, sent.num_prompt_tokens + num_prompt_tokens
        )
        return worker_id

"""The global scheduler's pick: which worker receives a new request.

Contract: the control process feeds every load report (a ``views.WorkerLoad``) to ``on_report``
and calls ``pick(num_prompt_tokens)`` per new request. Reports are up to one monitor interval
old, so the picker adds what it sent to each worker since that worker's last report (a report
resets it); without that, a burst of arrivals would all land on the same worker.

Load, disaggregated: prompt tokens queued or being prefilled on a ``prefill`` worker. Coupled
(every worker prefills and decodes): requests waiting or running, then queued prompt tokens.
Ties go to the lowest worker id.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from tetri_server.policy.views import WorkerLoad


@dataclass(frozen=True)
class _Sent:
    num_requests: int = 0
    num_prompt_tokens: int = 0


class LeastLoadedPicker:
    """Least-loaded worker choice for new requests (TetriInfer's global scheduler)."""

    def __init__(self, *, coupled: bool = False) -> None:
        self.coupled = coupled
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

    def load(self, worker_id: int) -> tuple[int, ...]:
        """The sort key of ``worker_id`` (smaller is less loaded)."""
        r, sent = self._reports[worker_id], self._sent[worker_id]
        num_tokens = r.num_queued_prompt_tokens + sent.num_prompt_tokens
        if self.coupled:
            return (r.num_waiting + r.num_running + sent.num_requests, num_tokens, worker_id)
        return (num_tokens, worker_id)

    def pick(self, num_prompt_tokens: int, exclude: Collection[int] = ()) -> int | None:
        """The least-loaded eligible worker, counted as loaded with this request; None when no
        worker is eligible. ``exclude``: workers not to route to (draining, restarting)."""
        eligible = [
            wid
            for wid, r in self._reports.items()
            if wid not in exclude and (self.coupled or r.role == "prefill")
        ]
        if not eligible:
            return None
        worker_id = min(eligible, key=self.load)
        sent = self._sent[worker_id]
        self._sent[worker_id] = _Sent(
            sent.num_requests + 1, sent.num_prompt_tokens + num_prompt_tokens
        )
        return worker_id

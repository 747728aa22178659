"""The global scheduler's pick: which worker receives a new request.

Contract: the control process feeds every load report (a ``views.WorkerLoad``) to ``on_report``
and calls ``pick(num_prompt_tokens)`` per new request. Reports are up to one monitor interval
old, so the picker adds what it sent to each worker that the report does not count yet;
without that, a burst of arrivals would all land on the same worker. Each prompt sent is
stamped (``stamp``: the worker's ``AddRequest.add_seq``) and a report says the last stamp its
worker handled (``last_add_seq``): a report sent just before a prompt arrived leaves it
counted, as does a worker in a long step that cannot report (None: the report counts all).

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

from tetri_server.policy.local_prefill import DecodeRoom, LocalPrefill
from tetri_server.policy.views import WorkerLoad


class LeastLoadedPicker:
    """Least-loaded worker choice for new requests (TetriInfer's global scheduler)."""

    def __init__(self, *, coupled: bool = False, local_prefill: LocalPrefill | None = None) -> None:
        self.coupled = coupled
        self.local_prefill = None if coupled else local_prefill
        self._reports: dict[int, WorkerLoad] = {}
        self._sent: dict[int, list[tuple[int, int]]] = {}  # (stamp, prompt tokens) not reported
        self._stamps: dict[int, int] = {}  # the last stamp given per worker

    def on_report(self, report: WorkerLoad) -> bool:
        """Adopt a worker's latest report; forget what was sent to it that the report counts.
        True when it says a decode worker has no prompt left to prefill after having some
        (the decode view goes out again: prefill workers stop keeping requests for it)."""
        wid, seen = report.worker_id, report.last_add_seq
        before = self.queued_tokens(wid) if wid in self._reports else 0
        self._reports[wid] = report
        self._sent[wid] = ([] if seen is None
                           else [e for e in self._sent.get(wid, []) if e[0] > seen])
        return report.role == "decode" and before > 0 and self.queued_tokens(wid) == 0

    def remove_worker(self, worker_id: int) -> None:
        """A worker died or left; it is not picked until it reports again."""
        self._reports.pop(worker_id, None)
        self._sent.pop(worker_id, None)

    def stamp(self, worker_id: int) -> int:
        """The stamp of the last prompt ``pick`` sent to ``worker_id`` (its ``add_seq``)."""
        return self._stamps.get(worker_id, 0)

    def queued_tokens(self, worker_id: int) -> int:
        """Prompt tokens queued on ``worker_id``: its report's plus those sent since."""
        return (self._reports[worker_id].num_queued_prompt_tokens
                + sum(n for _, n in self._sent[worker_id]))

    def load(self, worker_id: int) -> tuple[int, ...]:
        """The sort key of ``worker_id`` (smaller is less loaded)."""
        r = self._reports[worker_id]
        if self.coupled:
            return (r.num_waiting + r.num_running + len(self._sent[worker_id]),
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
            decodes = [DecodeRoom(wid, self.queued_tokens(wid),
                                  r.num_waiting + r.num_running + len(self._sent[wid]),
                                  r.num_free_blocks, r.step_s, r.fastest_step_s)
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
        stamp = self._stamps[worker_id] = self.stamp(worker_id) + 1
        self._sent[worker_id].append((stamp, num_prompt_tokens))
        return worker_id

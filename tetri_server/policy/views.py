"""What the policies see: plain read-only views, defined here (not the wire structs). The wire
messages that carry them (``messages.DecodeView``, ``messages.LoadReport``) satisfy these
protocols field for field, so the runtime and the simulator pass either without conversion."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol


class DecodeInstanceLoad(Protocol):
    """One decode worker as a dispatcher sees it."""

    @property
    def worker_id(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def num_total_blocks(self) -> int: ...
    @property
    def num_heavy(self) -> int: ...
    @property
    def num_light(self) -> int: ...
    @property
    def predicted_demand_blocks(self) -> int: ...
    @property
    def num_queued_prompt_tokens(self) -> int: ...  # elastic: prompts routed to it
    @property
    def step_s(self) -> float: ...  # elastic: its recent decode step time (0: idle)
    @property
    def fastest_step_s(self) -> float: ...  # ... the fastest that has been (0: no step yet)
    @property
    def report_seq(self) -> int: ...  # moves with each of its reports (-1: not tracked)
    @property
    def handoffs_read(self) -> Mapping[int, int] | None: ...  # per source: last seq (None: -)
    @property
    def incarnation(self) -> int: ...  # moves when it (re)starts: what it read is gone


class DecodeSnapshot(Protocol):
    """The cluster monitor's view of the decode workers; a newer one has a higher ``seq``."""

    @property
    def seq(self) -> int: ...
    @property
    def decodes(self) -> Sequence[DecodeInstanceLoad]: ...
    @property
    def generation(self) -> int: ...  # the same: built from the same reports


class WorkerLoad(Protocol):
    """One worker's latest load, as the global pick and the flip rule see it."""

    @property
    def worker_id(self) -> int: ...
    @property
    def role(self) -> str: ...
    @property
    def num_waiting(self) -> int: ...
    @property
    def num_running(self) -> int: ...
    @property
    def num_queued_prompt_tokens(self) -> int: ...
    @property
    def num_free_blocks(self) -> int: ...
    @property
    def busy_s(self) -> float: ...
    @property
    def last_add_seq(self) -> int | None: ...
    @property
    def step_s(self) -> float: ...  # a decode worker's recent step (0: idle, or not decode)
    @property
    def fastest_step_s(self) -> float: ...  # ... the fastest that has been (0: no step yet)


@dataclass(frozen=True)
class DecodeInstance:
    """A decode worker's view with a dispatcher's own dispatches since the view applied."""

    worker_id: int
    num_free_blocks: int
    num_total_blocks: int
    num_heavy: int
    num_light: int
    predicted_demand_blocks: int
    num_queued_prompt_tokens: int = 0
    step_s: float = 0.0
    fastest_step_s: float = 0.0
    report_seq: int = -1
    incarnation: int = 0
    handoffs_read: Mapping[int, int] | None = None  # own dispatches are applied: not needed

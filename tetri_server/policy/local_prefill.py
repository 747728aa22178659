"""Elastic P/D, the decode side (``decode.local_prefill_*``): a decode worker prefills a prompt
in slices riding in its decode steps when it would finish it sooner than the prefill worker
(``LocalPrefill``; the prefill side, ``LocalDecode``, is in ``policy/elastic.py``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tetri_server.policy.chunker import num_blocks_for
from tetri_server.policy.prefill import PrefillQueue


class DecodeRoom(NamedTuple):
    """What ``LocalPrefill.pick`` reads of a serving decode worker."""

    worker_id: int
    num_queued_tokens: int  # prompt tokens routed to it, not yet prefilled
    num_held: int  # requests it holds (waiting and running)
    num_free_blocks: int
    step_s: float = 0.0  # its recent step (``StepTimes.recent_s``; 0: idle)
    fastest_step_s: float = 0.0  # the fastest that has been (0: no step yet)


@dataclass(frozen=True)
class LocalPrefill:
    """The decode side (``decode.local_prefill_tokens``): a prompt goes to a decode worker
    instead of the prefill worker the global pick chose when the decode worker would finish it
    sooner: the prefill worker's backlog exceeds the decode worker's own prompt backlog by more
    than a chunk (a margin for the decode rows that share its steps), so the prompt would not
    even start in the prefill worker's next chunk. A prompt finishes on either side after the
    prompt tokens queued ahead of it plus its own, so comparing the backlogs compares the
    finish times where both sides prefill at about the same rate: the decode worker's slices
    (``slice_tokens``) are about a chunk. The decode worker prefills it in those slices riding
    in its decode steps, so while the prefill worker is busy a second core prefills and prompts
    stop queueing behind one prefill server; the price is the decode batch's gap during those
    steps (what a coupled worker pays for every prompt).

    Only a decode worker with room takes a prompt: the KV of its queued prompts and this one
    must fit in half of its free blocks (it reserves a prompt's blocks whole before the first
    slice, and the other half stays for its running requests' growth and the hand-offs on their
    way), so a long prompt never waits there for blocks behind hand-offs. With no prefill worker
    serving (the only one restarting or dead), a decode worker with room takes the prompt
    instead of it waiting for one.

    ``margin`` (``decode.local_prefill_margin``) is that margin in prefill chunks: at 0 a
    prompt goes to the decode worker whenever the prefill worker has more prompt tokens queued
    than the decode worker, as a coupled cluster spreads its prompts; below 0 never while a
    prefill worker is serving, so the decode worker's steps carry prompt slices only while the
    prefill worker restarts. The server's default is 8 with ``max_gap_x`` 2 (session 42): -1
    left HPLD's one prefill worker overloaded (JCT 3.75x coupled's at 2 req/s), 1 lost Mixed on
    TPOT (docs/benchmarks.md, "The decode worker's prompts again").

    ``max_gap_x`` (``decode.local_prefill_max_gap_x``; 0: no bound) keeps the decode worker's
    requests within a TPOT target: it takes a prompt only while its recent step (the gap its
    requests see, prompt slices included) is at most that many times the fastest it has had
    (about its one-request step), the way the benchmark's TPOT SLO is 3 x the unloaded step.
    Its slices then stop while they, or its batch, keep its steps past the bound, and resume as
    they come back under it. With no prefill worker serving, the bound does not apply: the
    prompt has nowhere else to go. Alone (margin 1), a bound of 3 cut the mean TPOT on Mixed
    past coupled's capacity 2-4 ms but raised TTFT up to 1.3x and held no more requests within
    the SLOs (docs/benchmarks.md, "An Intel machine (session 32)"); with a margin of 8, a bound
    of 2 held 88% of Mixed's requests within the SLOs at 1.65 req/s against 61% unbounded
    (session 42)."""

    block_size: int = 16
    margin: float = 1.0  # prefill chunks the prefill worker's backlog must exceed the decode
    # one; < 0: only while no prefill worker is serving
    max_gap_x: float = 0.0  # take a prompt only while the step is <= this x the fastest (0: any)

    def pick(self, num_prompt_tokens: int, backlog_tokens: int | None, chunk_size: int,
             decodes: Sequence[DecodeRoom]) -> int | None:
        """The decode worker to prefill the prompt, or None: the prefill worker takes it (or,
        with none serving, it waits for one). ``backlog_tokens``: prompt tokens queued on the
        picked prefill worker ahead of it, None if no prefill worker is serving; ``decodes``:
        each serving decode worker."""
        roomy = [d for d in decodes if self.fits(num_prompt_tokens + d.num_queued_tokens,
                                               d.num_free_blocks)
                 and (backlog_tokens is None or not self.over_gap(d))]
        if not roomy:
            return None
        best = min(roomy, key=lambda d: (d.num_queued_tokens, d.num_held, d.worker_id))
        if backlog_tokens is not None and (
                self.margin < 0
                or best.num_queued_tokens + self.margin * chunk_size >= backlog_tokens):
            return None  # no sooner there (the prefill worker starts it within the margin)
        return best.worker_id

    def over_gap(self, d: DecodeRoom) -> bool:
        """With ``max_gap_x``: the decode worker's recent step is past the bound (an idle one,
        or one with no step yet, never is)."""
        return (self.max_gap_x > 0 and d.fastest_step_s > 0
                and d.step_s > self.max_gap_x * d.fastest_step_s)

    @staticmethod
    def slice_tokens(limit: int, prefill_chunk: int, follow_chunk: bool = True) -> int:
        """The most prompt tokens a decode worker prefills in one step: ``limit``
        (``decode.local_prefill_tokens``), and with ``follow_chunk`` (``local_prefill_slice =
        "chunk"``) at most ``prefill_chunk``, the prefill side's chunk (0: none serving, the
        limit alone). A slice of a chunk keeps the decode rows' gap during a prompt about that
        of the prefill worker's kept rows and the two sides' prefill rates alike, as ``pick``
        assumes; on one Zen 5 core, slices of 1024 beside a 256-token chunk doubled the p99
        gap on Mixed (docs/benchmarks.md, "The decode worker's slice")."""
        return min(limit, prefill_chunk) if follow_chunk and prefill_chunk > 0 else limit

    def fits(self, num_tokens: int, num_free_blocks: int) -> bool:
        """The KV of ``num_tokens`` prompt tokens fits in half of ``num_free_blocks``."""
        return -(-num_tokens // self.block_size) <= num_free_blocks // 2


def head_prompt_need(queue: PrefillQueue, block_size: int) -> int:
    """Blocks the first prompt routed to a decode worker needs to start (it reserves them whole
    before its first slice; 0 once started, or with none queued). A hand-off it receives leaves
    them free: else each hand-off took the room the router had checked and the prompt, routed
    there to finish sooner, waited behind all of them."""
    head = next(iter(queue.iter_order()), None)
    if head is None or head.num_done_tokens > 0:
        return 0
    return num_blocks_for(head.num_prompt_tokens, block_size)

"""Elastic P/D: where a strict split of prefill and decode workers would leave one side idle
while the other queues, the idle side lends a hand. Two pure rules, both on by default
(``LocalDecode`` with a batch of 16, here; ``LocalPrefill`` with slices of up to a prefill
chunk a step, ``slice_tokens``, in ``policy/local_prefill.py``):

``LocalDecode`` (the prefill side, ``prefill.local_decode_batch``): when a prefill worker keeps
a request it has prefilled and decodes it itself instead of handing it off.

At equal hardware a strict split loses whenever one side idles while the other queues (on a
decode-heavy workload the prefill worker idles while one decode worker carries every request).
A prefill worker with ``LocalDecode`` keeps a prefilled request when (1) its own local batch
has room, (2) its prompt backlog fits in one chunk (prefill is not the bottleneck: the chunk has
room for decode rows), and (3) every decode worker in the last view holds more requests than it
decodes locally (decode is the busier side). Kept requests decode in the prefill worker's own
steps, their rows riding in its chunks (Sarathi-style, within the chunk size), so a prompt never
waits for them, and they finish where they are (no second hand-off). Only requests that can
decode more than ``min_tokens`` are kept (``worth_keeping``: the request's ``max_tokens`` and
its predicted bucket's upper end both above it): a short request takes little off the decode
worker and pays the prefill worker's chunk steps for each of its tokens (measured: on LPLD,
keeping every request raised mean TPOT 8% and JCT 9% over the strict split). With
``max_prompt_share`` below 1, none is kept while the worker spent more than that share of the
last ``PromptShare.window_s`` seconds in steps with prompt tokens (``PromptShare``): a kept
request's tokens come one per step, and a step with a prompt chunk is several decode steps long.
The server's default is 1.0, the rule off (since session 53; 0.3 in sessions 41-52, and
``config.toml`` has the history): ``balance`` already weighs this worker's prompt steps into
the gap a kept request would get, and on LPHD, where the decode worker saturates, JCT with the
rule off was 0.84-0.88x its JCT with 0.3 (docs/benchmarks.md, "The prompt-share rule off, five
workloads").

With ``balance`` (``prefill.local_decode_balance``) a request is kept only where its tokens
would come faster than on every decode worker: its expected gap here (``kept_gap_s``: this
worker's steps with prompt tokens and its decode-only steps, each by the share of the last
10 s it took, ``LocalSteps``) below each decode worker's recent decode step (``StepTimes``,
reported). With ``balance_backlog`` too (``prefill.local_decode_balance_backlog``), that
comparison also decides for a long request while more than a chunk of prompt tokens waits,
which rule (2) alone refuses. Without ``balance``, the rules above keep requests at any load,
and a kept request gets one token per chunk step while prompts arrive: on Mixed, most requests
that missed a 20 ms TPOT were kept ones (a median gap of 12-14 ms, but 3-32 chunk steps of
~80 ms).

With ``hand_back`` (``prefill.local_decode_hand_back``) a kept request does not stay to the
end: when more than a chunk of prompt tokens is waiting (``hands_back``), every kept request
whose KV is whole is handed off like a freshly prefilled one, its hand-off carrying the KV of
the tokens decoded here too. So the prefill worker decodes only in its idle spells, and a
burst of prompts no longer leaves its kept requests one token per chunk step behind it.

While every decode worker is prefilling prompts routed to it (``all_prefilling``), a hand-off
would wait there behind whole prompts: the prefill worker then keeps a request whatever the
decode workers hold, a short one (not ``worth_keeping``) too, and one whose ``max_tokens`` is
at most ``min_tokens`` whatever the prompt share (it decodes that few here, however slowly);
its own batch and backlog rules hold.

With ``finish_tokens`` (``prefill.local_finish_tokens``) a request whose ``max_tokens`` is at
most that many tokens is kept whatever the load (only the batch must have room): it ends within
that many steps, and a hand-off would cost it about two of the decode worker's steps and the KV
copy before its second token. While such a request decodes here, a step takes at most
``finish_tokens`` prompt tokens beside the rows (``step_tokens``), so its tokens come about a
decode step apart, not a chunk step apart; prompts go on in those small steps.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from tetri_server.policy.views import DecodeSnapshot

if TYPE_CHECKING:
    from tetri_server.policy.decode import DecodeAdmission, DecodeStepPlan
    from tetri_server.policy.prefill_book import PrefillBook


@dataclass(frozen=True, kw_only=True)
class LocalDecode:
    """The prefill side's rules (the module's docstring); built by keyword from the
    ``prefill.local_decode_*`` keys (``local_finish_tokens`` as ``finish_tokens``)."""

    max_batch: int  # most requests a prefill worker decodes itself
    min_tokens: int = 0  # a kept request can decode more than this many tokens
    max_prompt_share: float = 1.0  # keep only while prompt steps took at most this share
    hand_back: bool = False  # kept requests go to a decode worker when prompts queue
    balance: bool = False  # keep only where a request decodes faster than on every decode worker
    prompt_first: bool = False  # a backlog of at most a mixed step runs alone, in one step
    full_chunk_backlog: int = 0  # beyond this many queued prompt tokens, mixed steps: the chunk
    full_chunk_share: float = 0.0  # below this prompt share, mixed steps: the chunk
    finish_tokens: int = 0  # a request of at most this many tokens finishes here (0: none)
    balance_backlog: bool = False  # with balance: the gap decides past a chunk of backlog too
    loaded_x: float = 0.0  # keep only while every decode step is >= this x its fastest (0: any)
    min_held: int = 0  # keep only while every decode worker holds at least this many requests

    def finishes_here(self, max_tokens: int) -> bool:
        """Whether a request with this output cap is short enough to finish on the prefill
        worker whatever the load (``finish_tokens``)."""
        return 0 < max_tokens <= self.finish_tokens

    def worth_keeping(self, max_tokens: int, bucket_upper: int | None) -> bool:
        """Whether a request with this output cap and predicted bucket end (None: open, or no
        prediction) can decode more than ``min_tokens``; ``keep`` then says whether it stays."""
        most = max_tokens if bucket_upper is None else min(max_tokens, bucket_upper)
        return most > self.min_tokens

    def choose(self, held: Iterable[tuple[int, int, int | None]], num_local: int,
               num_queued_prompt_tokens: int, chunk_size: int, view: DecodeSnapshot | None,
               prompt_share: float = 0.0, gap_s: float = 0.0) -> list[int]:
        """The held requests to keep now, in their order: ``held`` gives (request id,
        max_tokens, predicted bucket's upper end) of each; ``num_local``: requests decoding
        here already; ``gap_s``: a kept request's expected gap here (``kept_gap_s``). The first
        long one refused ends the choice (kept in order) but for those that ``finishes_here``;
        a short one refused is passed over."""
        kept: list[int] = []
        refused = False  # a long one was refused: only those that finish here stay now
        for req_id, max_tokens, bucket_upper in held:
            if self.finishes_here(max_tokens):
                if num_local + len(kept) < self.max_batch:
                    kept.append(req_id)
                continue
            if refused:
                continue
            short = not self.worth_keeping(max_tokens, bucket_upper)
            capped = max_tokens <= self.min_tokens  # at most min_tokens here, whatever comes
            if self.keep(num_local + len(kept), num_queued_prompt_tokens, chunk_size, view,
                         0.0 if capped else prompt_share, short, gap_s):
                kept.append(req_id)
            elif not short:
                refused = True
        return kept

    def prompt_alone(self, num_queued_prompt_tokens: int, mixed_chunk: int,
                     last_alone: bool = False) -> bool:
        """With ``prompt_first`` (``prefill.local_decode_prompt_first``): the next step is a
        pure prefill step of the whole backlog while the kept requests wait one step, because
        every queued prompt token fits in a mixed step (``mixed_chunk``, so the kept rows wait
        no longer than one); never twice in a row (``last_alone``: the last step was one), so
        prompts arriving one by one cannot starve the kept requests. Without it, a short
        prompt's step also computes every kept row (up to ``max_batch``), where a coupled
        worker runs it alone. A larger backlog goes in mixed steps as before."""
        return (self.prompt_first and not last_alone
                and 0 < num_queued_prompt_tokens <= mixed_chunk)

    def step_tokens(self, num_queued_prompt_tokens: int, mixed_chunk: int,
                    chunk_size: int, prompt_share: float = 0.0, finishing: bool = False,
                    num_rows: int = 0) -> int:
        """The most tokens of the next step with kept rows: while a request kept because it
        ``finishes_here`` decodes (``finishing``), ``finish_tokens`` prompt tokens beside the
        step's ``num_rows`` rows (counted together, as the other caps are, 16 finishing rows
        would leave a 16-token step no prompt token at all); else ``mixed_chunk``, or the
        whole chunk with ``full_chunk_backlog`` (``prefill.local_decode_full_chunk_backlog``)
        while more prompt tokens than that wait, or with ``full_chunk_share``
        (``prefill.local_decode_full_chunk_share``) while steps with prompt tokens took less
        than that share of the worker's last 10 s (``prompt_share``).

        Small steps keep the kept rows' gap short, but prefill a token at a lower rate (on the
        Intel machine of session 32: 1849 tokens/s in steps of 128 against 2437 in the chunk of
        432, each beside 16 rows), and a prompt then takes several steps, each a long gap for
        every kept row. While prompts are rare, whole chunks gave the prompts the chunk's rate
        and the kept rows fewer long gaps; as they come more often, the long gaps of whole
        chunks become more than 1% of all (the p99 gap) and small steps win there (E35-E37 in
        docs/benchmarks.md, "Whole chunks on the prefill worker"). Both rules are off by
        default. The backlog rule at 1024 changed neither TTFT nor JCT on Mixed at 2.2 req/s
        (past a chunk of backlog ``keep`` keeps no new request, so such steps are rare). The
        share rule at 0.25 was within the noise of the default at 0.9 and 1.2 req/s (E38-E41;
        in E38 ``LocalSteps`` still scaled its whole-chunk steps down to ``mixed_chunk``)."""
        if finishing and self.finish_tokens > 0:
            return num_rows + min(self.finish_tokens, mixed_chunk)
        # rows as many as the cap (a local_decode_batch of 64 beside a calibrated chunk of
        # 64) would leave the prompts here no token until a kept request ends: a quarter of
        # the cap stays theirs
        floor = num_rows + max(1, mixed_chunk // 4)
        if (0 < self.full_chunk_backlog < num_queued_prompt_tokens
                or prompt_share < self.full_chunk_share):
            return max(chunk_size, mixed_chunk, floor)
        return max(mixed_chunk, floor)

    def hands_back(self, num_queued_prompt_tokens: int, chunk_size: int) -> bool:
        """Whether the requests kept here go to a decode worker now: prompts wait beyond the
        next chunk, which ``keep`` says is theirs (a kept request would get one token per chunk
        step for as long as the backlog lasts)."""
        return self.hand_back and num_queued_prompt_tokens > chunk_size

    def keep(self, num_local: int, num_queued_prompt_tokens: int, chunk_size: int,
             view: DecodeSnapshot | None, prompt_share: float = 0.0, short: bool = False,
             gap_s: float = 0.0) -> bool:
        """``prompt_share``: this worker's ``PromptShare.share`` now. ``short``: the request is
        not ``worth_keeping``; it stays only while every decode worker is prefilling prompts
        (``all_prefilling``): there it would wait behind whole prompts (``choose`` passes a
        share of 0 for one whose ``max_tokens`` caps it at ``min_tokens``: here it decodes that
        few however slowly; a prediction alone may be wrong). ``gap_s``: with ``balance``, the
        request stays only if this is below every decode worker's recent step
        (``DecodeInstanceLoad.step_s``; 0, an idle one, never). With ``balance_backlog``
        (``prefill.local_decode_balance_backlog``) a long request whose gap here is below every
        decode worker's step stays though more than a chunk of prompt tokens waits
        (``faster_here``)."""
        if num_local >= self.max_batch:
            return False
        if num_queued_prompt_tokens > chunk_size and not self.faster_here(view, short, gap_s):
            return False  # prompts are waiting: the chunks are theirs
        if prompt_share > self.max_prompt_share:
            return False  # prefill keeps this worker busy: a kept request would crawl
        blocked = all_prefilling(view)
        if short:
            return blocked
        if view is None or not view.decodes:
            return True  # no decode worker known (none up yet, or all restarting)
        if blocked:
            return True
        if self.balance and not faster_than_decodes(view, gap_s):
            return False  # it decodes at least as fast there
        if self.loaded_x > 0 and not decodes_loaded(view, self.loaded_x):
            return False  # a decode side near its fastest: nothing to win here
        held = min(d.num_heavy + d.num_light for d in view.decodes)
        return num_local < held and held >= self.min_held

    def faster_here(self, view: DecodeSnapshot | None, short: bool, gap_s: float) -> bool:
        """``balance_backlog``: a long request's gap here (``gap_s``) is below every decode
        worker's recent step, none of them prefilling (``keep``'s backlog rule then yields)."""
        return (self.balance_backlog and self.balance and not short and view is not None
                and bool(view.decodes) and not all_prefilling(view)
                and faster_than_decodes(view, gap_s))


def decodes_loaded(view: DecodeSnapshot, x: float) -> bool:
    """``loaded_x`` (``prefill.local_decode_loaded_x``): every decode worker's recent step is
    at least ``x`` times the fastest it has had (one with no step yet is not loaded)."""
    return all(d.fastest_step_s > 0 and d.step_s >= x * d.fastest_step_s for d in view.decodes)


def faster_than_decodes(view: DecodeSnapshot, gap_s: float) -> bool:
    """``balance``: a kept request's gap here (``gap_s``) is below every decode worker's
    recent step (0, an idle one, never)."""
    return all(gap_s < d.step_s for d in view.decodes)


class LocalDecodeKeys(Protocol):
    """The ``prefill.local_decode_*`` keys and ``prefill.local_finish_tokens``, as the
    ``[prefill]`` section and the simulator's config both name them."""

    @property
    def local_decode_batch(self) -> int: ...
    @property
    def local_decode_min_tokens(self) -> int: ...
    @property
    def local_decode_max_prompt_share(self) -> float: ...
    @property
    def local_decode_hand_back(self) -> bool: ...
    @property
    def local_decode_balance(self) -> bool: ...
    @property
    def local_decode_prompt_first(self) -> bool: ...
    @property
    def local_decode_full_chunk_backlog(self) -> int: ...
    @property
    def local_decode_full_chunk_share(self) -> float: ...
    @property
    def local_finish_tokens(self) -> int: ...
    @property
    def local_decode_balance_backlog(self) -> bool: ...
    @property
    def local_decode_loaded_x(self) -> float: ...
    @property
    def local_decode_min_held(self) -> int: ...


def local_decode_of(keys: LocalDecodeKeys) -> LocalDecode | None:
    """The prefill side's rules from its keys; None where ``local_decode_batch`` is 0 (the
    prefill worker keeps nothing: the strict split)."""
    if not keys.local_decode_batch:
        return None
    return LocalDecode(max_batch=keys.local_decode_batch,
                       min_tokens=keys.local_decode_min_tokens,
                       max_prompt_share=keys.local_decode_max_prompt_share,
                       hand_back=keys.local_decode_hand_back,
                       balance=keys.local_decode_balance,
                       prompt_first=keys.local_decode_prompt_first,
                       full_chunk_backlog=keys.local_decode_full_chunk_backlog,
                       full_chunk_share=keys.local_decode_full_chunk_share,
                       finish_tokens=keys.local_finish_tokens,
                       balance_backlog=keys.local_decode_balance_backlog,
                       loaded_x=keys.local_decode_loaded_x,
                       min_held=keys.local_decode_min_held)


def all_prefilling(view: DecodeSnapshot | None) -> bool:
    """Every decode worker in the view has prompts routed to it waiting (``LocalPrefill``):
    a request handed off now waits behind those prompts' slices, whole prompts riding in its
    decode steps (session 22's HPLD ablation: a 21-token request handed off while the decode
    worker prefilled a 989-token prompt took 63 ms a token, against 21 on an idle one), while
    the prefill worker that just finished it may be idle."""
    return view is not None and bool(view.decodes) and all(
        d.num_queued_prompt_tokens > 0 for d in view.decodes)


@dataclass
class StepTimes:
    """A worker's recent step time (an exponential average of the steps it is given) and the
    fastest that average has been. A decode worker gives it every step with decode rows (the
    average is then the mean gap its requests see, the steps that also prefill prompt slices
    included; the fastest is about its one-request step); a prefill worker one for its steps
    with prompt tokens and one for those without."""

    weight: float = 0.2  # of the newest step in the average
    recent_s: float = 0.0  # 0: no step since the last idle spell
    fastest_s: float = 0.0  # 0: no step yet

    def add(self, step_s: float) -> None:
        r = self.recent_s
        self.recent_s = step_s if not r else r + self.weight * (step_s - r)
        if not self.fastest_s or self.recent_s < self.fastest_s:
            self.fastest_s = self.recent_s

    def idle(self) -> None:
        """Nothing to step here: the next busy spell starts a new average."""
        self.recent_s = 0.0


def kept_gap_s(prompt_share: float, prompt_step_s: float, decode_step_s: float) -> float:
    """The mean gap between a kept request's tokens: one token per step, where a share
    ``prompt_share`` of the time goes to steps with prompt tokens (``prompt_step_s`` each) and
    the rest to decode-only steps (``decode_step_s`` each)."""
    if decode_step_s <= 0:
        return 0.0
    if prompt_share <= 0 or prompt_step_s <= 0:
        return decode_step_s
    return 1.0 / (prompt_share / prompt_step_s + (1.0 - prompt_share) / decode_step_s)


def mixed_chunk(chunk_size: int, limit: int) -> int:
    """The most tokens of an elastic step that carries decode rows (a prefill worker's kept
    requests, or a decode worker's batch beside a prompt slice): the chunk, and at most
    ``limit`` (``prefill.local_decode_chunk``; 0: no limit), so the rows do not wait a whole
    chunk behind each prompt (Sarathi's token budget). On one Zen 5 core, 128 beside a
    272-token chunk took 28-50% off the p99 inter-token gap on Mixed, and in sweeps with the
    modes interleaved it held more requests within the SLOs on Mixed and LPHD; ablations past
    LPHD's capacity measured JCT 4-12% higher (docs/benchmarks.md, "Capping the steps with
    decode rows at 128 tokens")."""
    return min(limit, chunk_size) if limit > 0 else chunk_size


def calibration_rows(local_decode_batch: int, local_decode_chunk: int,
                     full_chunk_backlog: int, full_chunk_share: float) -> int:
    """The decode rows a prefill worker calibrates its chunk with (``resolve_chunk_size``):
    its kept requests' rows ride in whole chunks only where a step with rows may take the
    whole chunk (``prefill.local_decode_chunk`` 0, or a full-chunk rule on). Otherwise those
    steps take at most ``local_decode_chunk`` tokens and the chunk always runs without rows,
    so its knee is that of prompts alone (64 against 240 with 16 rows on the AMD VM of
    session 41, whose short prompts then wait a 32 ms step, not a 120 ms one)."""
    if local_decode_chunk == 0 or full_chunk_backlog > 0 or full_chunk_share > 0:
        return local_decode_batch
    return 0


@dataclass
class PromptShare:
    """Share of the last ``window_s`` seconds a worker spent in steps that carried prompt
    tokens. The owner adds each such step's (start, end) in order, with its own clock."""

    window_s: float = 10.0
    _steps: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, start_s: float, end_s: float) -> None:
        self._steps.append((start_s, end_s))
        self._forget(end_s - self.window_s)  # bounded even when nobody asks for the share

    def share(self, now_s: float) -> float:
        lo = now_s - self.window_s
        self._forget(lo)
        busy = sum(end - max(start, lo) for start, end in self._steps)
        return min(1.0, busy / self.window_s)

    def _forget(self, before_s: float) -> None:
        """Drop the steps that ended at or before ``before_s``."""
        while self._steps and self._steps[0][1] <= before_s:
            self._steps.popleft()


@dataclass
class LocalSteps:
    """A prefill worker's own steps, as ``LocalDecode`` reads them: the share of the last
    window in steps with prompt tokens, their recent time and that of its decode-only steps
    (the requests it kept, alone). The owner adds each step (start, end) with its own clock and
    says ``idle`` when nothing it kept decodes any more.

    A step with prompt tokens counts as the time a step of ``wait_tokens`` would take (the most
    tokens of a step that carries kept requests' rows at that moment, ``LocalDecode.step_tokens``:
    ``prefill.local_decode_chunk``, or the whole chunk under a full-chunk rule; its time by
    ``wait_tokens`` / its tokens, when it had more), so a worker whose full chunks are long
    still sees that a kept request would wait only a mixed step behind each prompt."""

    prompt_share: PromptShare = field(default_factory=PromptShare)
    prompt: StepTimes = field(default_factory=StepTimes)
    decode: StepTimes = field(default_factory=StepTimes)

    def add(self, start_s: float, end_s: float, *, prompt: bool, num_tokens: int = 0,
            wait_tokens: int = 0) -> None:
        """``num_tokens``: the step's tokens (decode rows and prompt slices); ``wait_tokens``:
        the most tokens a step with kept rows takes now (0: no limit, the step as it was)."""
        if prompt:
            self.prompt_share.add(start_s, end_s)
            scale = wait_tokens / num_tokens if 0 < wait_tokens < num_tokens else 1.0
            self.prompt.add((end_s - start_s) * scale)
        else:
            self.decode.add(end_s - start_s)

    def idle(self) -> None:
        self.decode.idle()

    def gap_s(self, prompt_share: float, view: DecodeSnapshot | None) -> float:
        """A kept request's expected gap here (``kept_gap_s``), ``prompt_share`` being
        ``self.prompt_share.share`` now (the caller has it already). With nothing decoding
        here, a decode-only step is about the fastest a decode worker has had (one request, the
        same model); 0 when that is not known either."""
        decode_s = self.decode.recent_s or min(
            (d.fastest_step_s for d in (view.decodes if view else ()) if d.fastest_step_s),
            default=0.0)
        return kept_gap_s(prompt_share, self.prompt.recent_s, decode_s)


def kept_prompt_room(admission: DecodeAdmission, book: PrefillBook[Any],
                     plan: DecodeStepPlan | None, free: int) -> int:
    """Blocks a prefill worker's prompt slices may take beside ``plan`` (None: a chunk without
    the kept rows). What its kept requests' waiting head needs (one preempted: its KV is
    computed again there, it cannot be handed back) stays free while blocks come back without
    a prompt completing (a kept row runs, a hand-off's KV is there): new prompts took each
    block as it came back and left it waiting for good. With none coming back, prompts keep
    them all: a head that needs more than is free would stop them, and the hand-offs with
    them, for good. A chunk without the kept rows leaves them what their next step needs (it
    took those blocks, and the next step preempted a kept request). The worker and the
    simulator both plan with it."""
    rows = plan.run_ids if plan is not None else admission.running_ids
    hold = bool(rows) or book.kv_returning()
    if plan is None:
        free = max(0, free - admission.next_step_need())
    return admission.prompt_room(plan, free, hold_head=hold)

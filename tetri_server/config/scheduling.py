"""The sections of ``config.toml`` that the prefill and decode workers' policies read: the
prefill queue and chunker (``[prefill]``, with the prefill side of elastic P/D) and decode
admission (``[decode]``, with its side of elastic P/D). Same contract as ``sections.py``: one
frozen, validated dataclass per section, one field per key, its docstring the key's
documentation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, Literal

from tetri_server.config.sections import ConfigError, _Section

PrefillPolicyName = Literal["fcfs", "sjf", "ljf", "srpt"]
DecodePolicyName = Literal["greedy", "reserve-static", "reserve-dynamic"]
DecodeEstimate = Literal["bucket", "refined"]
LocalPrefillSlice = Literal["chunk", "fixed"]


@dataclass(frozen=True, kw_only=True)
class PrefillConfig(_Section):
    """``[prefill]``: the prefill queue and chunker."""

    SECTION: ClassVar[str] = "prefill"

    chunk_size: int = 0
    """Tokens per prefill forward pass (the knee); 0 = calibrated by each worker at start-up."""
    policy: PrefillPolicyName = "srpt"
    """Queue order by prompt length: fcfs, sjf (shortest first) or ljf (longest first), within
    the sort window; or srpt (the fewest remaining prompt tokens first, over the whole queue,
    pausing a started prompt for a shorter one at a step boundary; the default since session
    41: with ``finish_alone`` it took the Mixed prompts under 128 tokens from 0.20 s to 0.05 s
    to their first token in the strict split, and the requests within the SLOs at 1.5 req/s
    from 80% to 93%; docs/benchmarks.md, "SLO goodput on Mixed and LPHD")."""
    sched_batch: int = 16
    """Sort window: waiting requests reordered together by the policy (not srpt)."""
    finish_alone: bool = True
    """A prefill worker's chunk whose first prompt (in the queue's order) completes in it
    carries only prompts that complete in it, no slice of a longer one: a short prompt's first
    token waits for its own tokens, not a whole chunk's. The longer prompt loses one step's
    fixed cost (its weight reads) each time."""
    starve_tokens: int = 8192
    """srpt: a prompt passed over by more than this many prompt tokens of others (prefilled on
    this worker since it was queued) goes ahead of every prompt not yet passed over that much."""
    overtake_share: float = 0.5
    """Disaggregated mode: while a started prompt is being prefilled, up to this share of each
    prefill step's prompt tokens (a prefill worker's chunks and its mixed steps; a decode
    worker's prompt slices stay FCFS: shared too, JCT on LPHD at 1.0 req/s rose in four
    repeats of four, session 37) goes first to waiting prompts that fit in it whole (shortest
    remaining work first, at step granularity: a short prompt waits one step, not the rest of
    a long one); the started prompt keeps the rest of each step, so it finishes at most
    1 / (1 - share) times later. 0: prefill is non-preemptive (the paper; the default to
    session 37, when 0.5 took the mean TTFT of Mixed prompts under 128 tokens from 1.20-1.61x
    coupled's to 0.60-0.80x: docs/benchmarks.md, "Short prompts overtake a started long
    one")."""
    token_budget: int = 512
    """coupled-chunked mode: tokens per step, decode tokens first, prompt chunks fill the rest."""
    local_decode_batch: int = 16
    """Elastic P/D (disaggregated mode): a prefill worker decodes up to this many of the
    requests it prefilled itself, their rows riding in its chunks, while its prompt backlog fits
    in one chunk, every decode worker holds more requests and the two rules below allow
    (``policy/elastic.py``; docs/benchmarks.md, "Which requests a prefill worker keeps"). 0:
    the strict split of the paper."""
    local_decode_min_tokens: int = 128
    """Elastic P/D: a prefill worker keeps only requests that can decode more than this many
    tokens (their max_tokens and predicted bucket's upper end); 0 = any request."""
    local_decode_max_prompt_share: float = 1.0
    """Elastic P/D: ... and only while steps with prompt tokens took at most this share of the
    worker's last 10 s (a kept request gets one token per step); 1 = whatever the load. 0.3 in
    sessions 41-52 (on Mixed the kept requests' tokens had waited behind prompt steps); 1 again
    since session 53, where ``local_decode_balance`` already weighs the prompt steps into the
    gap a kept request would get: on the AVX2 VM without the oracle, LPHD's JCT 0.84-0.88x the
    0.3 rule's over two repeats; LPLD, HPLD, Mixed level, HPHD 1.11x and 0.99x
    (docs/benchmarks.md, "The prompt-share rule off, five workloads")."""
    local_decode_hand_back: bool = False
    """Elastic P/D: when more than a chunk of prompt tokens waits, a prefill worker hands the
    requests it kept to a decode worker (with the KV of what it decoded) instead of decoding
    them to the end. Off: in session 59 it lowered Mixed's JCT (0.87-1.04x) but crowded the
    decode worker on LPHD (80-82% within the SLOs against 98%; docs/benchmarks.md, "Kept
    requests handed back when prompts queue, on today's defaults")."""
    local_decode_balance: bool = True
    """Elastic P/D: ... and only where the request's tokens would come faster than on every
    decode worker: the mean gap here (this worker's steps with and without prompt tokens, by
    the share of time each took, ``policy.kept_gap_s``) below each decode worker's recent
    decode step (docs/benchmarks.md, "Keeping a request only where it decodes faster"). False:
    the other rules alone."""
    local_decode_balance_backlog: bool = False
    """Elastic P/D, with ``local_decode_balance``: a prefill worker keeps a long request whose
    gap here is below every decode worker's recent step though more than a chunk of prompt
    tokens waits (without it, that backlog alone refuses every request); not while every
    decode worker prefills prompts (``LocalDecode.faster_here``). Off: level attainment on
    LPHD at 1.3 req/s, a loss on Mixed at 1.25-1.4 req/s (session 58, docs/benchmarks.md,
    "LPHD at 1.3 req/s: keeping past a prompt backlog")."""
    local_decode_loaded_x: float = 0.0
    """Elastic P/D: ... and only while every decode worker's recent step (the gap its requests
    see) is at least this many times the fastest it has had (about its one-request step): a
    decode side near its fastest has nothing to gain from a kept request, whose rows then wait
    behind this worker's prompt chunks and slow its prompts. 0 = at any decode load. Off: 1.5
    was level with the default on Mixed and LPHD in session 60 (docs/benchmarks.md, "Where the
    p99 gap and the long prompts' TTFT go at light load")."""
    local_decode_min_held: int = 0
    """Elastic P/D: ... and only while every decode worker holds at least this many requests (a
    decode side with a small batch steps near its fastest: a kept request gains little there,
    and its rows wait behind this worker's prompt chunks). 0 = at any decode load. Off: 6 held
    a lower or level p99 gap and mostly lower JCT on Mixed and LPHD in two runs in session 60; a
    third run and the other three workloads did not hold it up in session 61
    (docs/benchmarks.md, "Keeping only while the decode worker holds 6 requests, again")."""
    local_decode_chunk: int = 128
    """Elastic P/D: the most tokens (the kept requests' decode rows and prompt slices) in a
    step of a prefill worker that decodes requests it kept, and (``decode.local_prefill_slice
    = "chunk"``) the most prompt tokens a decode worker prefills beside its batch, so decode
    rows do not wait a whole chunk behind each prompt (Sarathi's token budget;
    docs/benchmarks.md, "Capping the steps with decode rows at 128 tokens"); 0 = the chunk."""
    local_decode_prompt_first: bool = False
    """Elastic P/D: while every queued prompt token fits in one step of
    ``local_decode_chunk`` tokens, a prefill worker that decodes requests it kept prefills them
    in a step of their own (its kept rows wait one step, never two in a row) instead of
    computing every kept row beside them; a larger backlog goes in mixed steps
    (``LocalDecode.prompt_alone``)."""
    local_decode_full_chunk_backlog: int = 0
    """Elastic P/D: while more than this many prompt tokens wait, a step that carries kept
    requests' rows takes the whole chunk, not ``local_decode_chunk`` (prompts then prefill at
    the chunk's rate, the rows waiting a chunk step each time). 0: never."""
    local_decode_full_chunk_share: float = 0.0
    """Elastic P/D: while steps with prompt tokens took less than this share of the worker's
    last 10 s, a step that carries kept requests' rows takes the whole chunk, not
    ``local_decode_chunk``: while prompts are rare, a prompt goes at the chunk's rate and the
    kept rows wait one long step for it, not several shorter ones (``LocalDecode.step_tokens``).
    0: never (the default: at 0.25 no gain on Mixed in session 33, docs/benchmarks.md, "Whole
    chunks on the prefill worker")."""
    local_finish_tokens: int = 16
    """Elastic P/D: a request whose max_tokens is at most this many tokens finishes on the
    prefill worker that prefilled it, whatever the load (only ``local_decode_batch`` must have
    room), and while one decodes there its steps take at most this many prompt tokens beside
    the rows: its tokens then come about a decode step apart, where a hand-off would cost about
    two decode steps and the KV copy before its second token (``LocalDecode.finishes_here``).
    0: none. 16 since session 42: on Mixed at 1.5-1.65 req/s, 3-6 of each run's 14 requests
    of 2-16 tokens had missed a 20 ms TPOT; none did with it (docs/benchmarks.md, "The decode
    worker's prompts again")."""

    def _validate(self) -> None:
        self._at_least("chunk_size", 0)
        self._at_least("local_finish_tokens", 0)
        if not 0 <= self.overtake_share < 1:
            raise ConfigError(f"prefill.overtake_share = {self.overtake_share} must be in [0, 1)")
        self._at_least("local_decode_chunk", 0)
        self._at_least("local_decode_full_chunk_backlog", 0)
        if not 0 <= self.local_decode_full_chunk_share <= 1:
            raise ConfigError(f"prefill.local_decode_full_chunk_share = "
                              f"{self.local_decode_full_chunk_share} must be in [0, 1]")
        self._at_least("local_decode_min_tokens", 0)
        if not 0 <= self.local_decode_max_prompt_share <= 1:
            raise ConfigError(f"prefill.local_decode_max_prompt_share = "
                              f"{self.local_decode_max_prompt_share} must be in [0, 1]")
        self._at_least("sched_batch", 1)
        self._at_least("starve_tokens", 1)
        self._at_least("token_budget", 1)
        self._at_least("local_decode_batch", 0)
        if (self.local_decode_hand_back and self.local_decode_balance
                and self.local_decode_balance_backlog):
            # past a chunk of backlog one hands every kept request back, the other keeps
            # it again at once where it decodes faster: each step, and none dispatched
            raise ConfigError("prefill.local_decode_hand_back and "
                              "prefill.local_decode_balance_backlog contradict each other "
                              "(past a chunk of prompt backlog the first hands kept requests "
                              "back, the second keeps them): set one of them")


@dataclass(frozen=True, kw_only=True)
class DecodeConfig(_Section):
    """``[decode]``: admission and batching on decode workers."""

    SECTION: ClassVar[str] = "decode"

    policy: DecodePolicyName = "reserve-dynamic"
    """Admission: greedy (while blocks are free), reserve-static or reserve-dynamic."""
    max_batch: int = 32
    """Most requests decoded together in one step."""
    estimate: DecodeEstimate = "bucket"
    """Output-length estimate of admission and preemption: bucket (the lower end of the
    predicted bucket, raised a bucket at a time on overrun; the paper) or refined (the expected
    output given the bucket and the tokens generated so far, from the artifact's length
    distributions; the victim of a preemption is the request expected to run longest)."""
    recompute_tokens: int = 256
    """A request preempted for KV blocks is recomputed (its prompt and the tokens it has
    generated) when it is admitted again: at most this many of those tokens a step, over as
    many steps as it takes, riding beside the batch's decode rows (at most what the rows leave
    of a step's cap too: ``prefill.token_budget`` in coupled-chunked mode, the kept rows' step
    on a prefill worker), so the others' inter-token gap never takes a whole prefill. 0: no
    limit of its own, a whole context in one step on a decode worker and in coupled mode
    (before session 49). Decode, coupled and prefill workers (the requests a prefill worker
    keeps)."""
    waiting_kv_first: bool = True
    """When the running batch's next step needs more KV blocks than are free and the KV held
    by requests waiting for admission (a hand-off's KV is pulled on arrival; a coupled
    worker's prefilled prompts) covers the shortfall, that KV goes, the newest first, and is
    recomputed when they are admitted; no running stream stalls (session 49;
    ``tetri_waiting_kv_drops`` counts them). false: running requests are preempted first (the
    newest admission, or the one expected to run longest) and waiting requests keep their KV
    while any request runs (either way, with nothing running, a head of the queue that does
    not fit takes the blocks of those waiting behind it). Decode and coupled workers; a
    prefill worker's waiting kept requests keep theirs while others run (they are handed back
    whole). The hand-off check of session 49 (a decode worker rejects a hand-off that would
    take the blocks its batch or its waiting head needs) stays on either way."""
    local_prefill_tokens: int = 1024
    """Elastic P/D (disaggregated mode): control sends a prompt to a decode worker when it
    would finish there sooner (the prefill worker has over a chunk more queued ahead of it than
    the decode worker), or when no prefill worker is serving, if the decode worker has room (its
    queued prompts and this one in half its free KV blocks); the decode worker prefills it in
    slices of at most this many tokens riding in its decode steps (``policy/local_prefill.py``; keep
    it >= the prefill chunk). 0: the strict split of the paper."""
    local_prefill_slice: LocalPrefillSlice = "chunk"
    """Elastic P/D: chunk = a decode worker's step also prefills at most the prefill workers'
    chunk (the smallest of those serving, at most ``prefill.local_decode_chunk``;
    ``local_prefill_tokens`` when none is), so its decode rows wait no longer behind a prompt
    slice than the prefill worker's kept rows wait behind theirs; fixed =
    ``local_prefill_tokens`` a step whatever the chunk (docs/benchmarks.md, "The decode
    worker's slice")."""
    local_prefill_margin: float = 8.0
    """Elastic P/D: a prompt goes to a decode worker only when the prefill worker has more than
    this many prefill chunks of prompt tokens queued beyond the decode worker's (0: more at
    all, as a coupled cluster spreads prompts); below 0: only while no prefill worker is
    serving. 8 with ``local_prefill_max_gap_x`` 2 since session 42: -1 (session 41) left HPLD's
    one prefill worker overloaded (JCT 3.75x coupled's at 2 req/s), 1 (to session 40) lost
    Mixed on TPOT (docs/benchmarks.md, "The decode worker's prompts again")."""
    local_prefill_max_gap_x: float = 2.0
    """Elastic P/D: a decode worker takes a prompt only while its recent step (the gap its
    requests see) is at most this many times the fastest it has had, about its one-request step
    (3 is the benchmark's TPOT SLO); while no prefill worker is serving it takes one anyway.
    0: no bound. 2 since session 42 (0 before), with the margin of 8."""

    def _validate(self) -> None:
        self._at_least("max_batch", 1)
        self._at_least("local_prefill_tokens", 0)
        self._at_least("recompute_tokens", 0)
        self._at_least("local_prefill_max_gap_x", 0)

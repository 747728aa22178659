"""Every type that crosses a process boundary. This file is the wire contract.

Rules: msgspec Structs only (no pickle, no tensors); every message on a channel is a member of
that channel's tagged union (members of one union must all be ``array_like``); fields are only
ever appended, never reordered or removed. Send deltas (new tokens, new block ids), not state.

Channels (one SPSC ring per direction between control and each worker, see ``channel.py``):
    control -> worker   ``ToWorker``       AddRequest, Abort, Shutdown, DecodeView, PeerPools,
                                           SetRole, Handoff, KVPulled, HandoffRejected
    worker  -> control  ``FromWorker``     Ready, StepOutput, LoadReport, RequestFailed,
                                           Handoff, KVPulled, HandoffRejected
Prefill<->decode messages (Handoff, KVPulled, HandoffRejected) travel through the control process,
which forwards them: a star keeps worker restarts and role flips local to one worker's channels,
and lets the request table always know a request's owner. KV bytes never travel in messages.
"""

from __future__ import annotations

from typing import Literal

import msgspec

Role = Literal["prefill", "decode", "coupled"]
"""What a worker does: the one name of roles shared by messages, policies and control."""
FLIP_ROLES: tuple[Role, ...] = ("prefill", "decode")  # the roles an instance flips between

class Guide(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A constraint on the reply (structured output: ``response_format``, vLLM's ``guided_*``,
    forced tool calls). It travels inside the request's ``SamplingParams`` (AddRequest,
    Handoff), so every worker that samples compiles it (cached per spec) and replays the tokens
    already generated; the control process never compiles it (the grammar library imports
    torch). A spec that does not compile fails the request with ``RequestFailed.invalid``."""

    kind: Literal["json_object", "json_schema", "regex", "choice", "grammar"]
    # json_schema: the schema as JSON text; regex: the pattern; choice: a JSON list of strings;
    # grammar: EBNF (GBNF) text with a ``root`` rule; json_object: empty (any JSON object)
    spec: str = ""


class SamplingParams(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """How to pick tokens. Stop *strings* are matched by the control process on detokenized
    text; workers only see token-level stops."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    seed: int | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    min_tokens: int = 0
    # appended for the OpenAI/vLLM sampling fields; neutral defaults change nothing
    presence_penalty: float = 0.0  # subtracted once from every token already in the output
    frequency_penalty: float = 0.0  # subtracted per occurrence in the output
    repetition_penalty: float = 1.0  # divides (>0) / multiplies (<0) logits of prompt+output tokens
    min_p: float = 0.0  # drop tokens with probability < min_p * the top probability
    logit_bias: dict[int, float] = {}  # token id -> added to its logit (API: ids < vocab, capped)
    top_logprobs: int = 0  # alternatives reported per token (API caps at 20)
    guide: Guide | None = None  # structured output: only tokens the grammar allows are sampled
    # logprobs of the prompt's own tokens and this many alternatives per position (None: off;
    # 0: the prompt token alone). Computed by the worker that prefills, in its chunks; a
    # re-run whose prompt holds streamed tokens has it off (the client already has them).
    prompt_logprobs: int | None = None
    # output tokens generated before this run (a re-run's prompt holds them): seeded draws go
    # on from that index (engine/sampling.py, draw_seed), and the grammar and the presence and
    # frequency penalties count them as output (Sequence.generated_ids)
    num_prior_output: int = 0

    @property
    def penalized(self) -> bool:
        """Logits need adjusting before sampling (also before greedy argmax)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.logit_bias
                    or self.repetition_penalty != 1.0)


class ChannelSpec(msgspec.Struct, frozen=True):
    """How a child process attaches to a channel: passed on argv as JSON by the parent, which
    also passes ``fds`` to ``Popen(pass_fds=...)`` so the fd numbers are valid in the child."""

    name: str  # shared-memory segment, without the leading slash
    capacity: int  # bytes of frame data
    data_fd: int  # eventfd: the producer writes after each push
    space_fd: int  # eventfd: the consumer writes after each pop batch

    @property
    def fds(self) -> list[int]:
        return [self.data_fd, self.space_fd]


class WorkerSpec(msgspec.Struct, frozen=True):
    """Everything a worker process needs, passed by the control process on argv as JSON."""

    worker_id: int
    role: Role
    generation: int  # restarts of this worker id so far (segment names differ per generation)
    run_id: str
    config: dict[str, dict[str, object]]  # Config.to_dict() (API key redacted), resolved
    inbox: ChannelSpec  # control -> worker
    outbox: ChannelSpec  # worker -> control
    cpus: list[int]  # CPU cores to pin to (empty = no pinning)
    num_threads: int
    parent_pid: int
    kv_segment: str  # name of the shared-memory segment of this worker's KV pool (shm)
    device: str = "cpu"  # cpu | cuda:<i>
    previous_num_blocks: int = 0  # a restart: its worker id's pool at the first start (0: none)


class PoolHandle(msgspec.Struct, frozen=True):
    """How a peer maps a worker's KV pool. Exported once at worker start-up.

    ``transport`` is ``shm`` (``name`` is a shared-memory segment) or ``cuda_ipc`` (``ipc_handle``
    is a cudaIpcMemHandle as bytes, ``device`` the CUDA ordinal). Layout: one contiguous buffer of
    ``[num_layers, 2, num_blocks * block_size, num_kv_heads, head_dim]`` elements of ``dtype``
    (``layout`` token-major), or ``[num_layers, 2, num_kv_heads, num_blocks * block_size,
    head_dim]`` (head-major).
    """

    worker_id: int
    transport: str
    name: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    ipc_handle: bytes = b""
    device: int = -1
    layout: str = "head-major"


# ---------------------------------------------------------------- control -> worker


class AddRequest(msgspec.Struct, tag=True, array_like=True):
    """A new request for a prefill (or coupled) worker. The worker owns it until it reports a
    finish, a failure, or hands it off (disaggregated: the decode worker then owns it)."""

    req_id: int
    prompt_ids: list[int]
    sampling: SamplingParams
    arrival_s: float
    true_output_len: int | None = None  # only for predictor.kind = "oracle"
    prompt_text: str = ""  # for the length predictor
    add_seq: int = 0  # the global pick's count of prompts sent to this worker, this one included
    # elastic, a prompt sent to a decode worker: the prefill side's chunk (0: none serving)
    prefill_chunk: int = 0


class Abort(msgspec.Struct, tag=True, array_like=True):
    """Drop a request wherever it is; its blocks are freed within one step."""

    req_id: int


class Shutdown(msgspec.Struct, tag=True, array_like=True):
    """Finish the current step, free everything, exit 0."""


class PeerPools(msgspec.Struct, tag=True, array_like=True):
    """The KV pools of the peers this worker may pull from (sent after all workers are ready,
    and again after a restart). A worker drops mappings of pools that are no longer listed."""

    pools: list[PoolHandle]


class DecodeInstanceView(msgspec.Struct, array_like=True):
    """One decode worker as the cluster monitor last saw it."""

    worker_id: int
    num_free_blocks: int
    num_total_blocks: int
    num_heavy: int
    num_light: int
    predicted_demand_blocks: int
    num_queued_prompt_tokens: int = 0  # elastic: prompts routed to it, not yet prefilled
    step_s: float = 0.0  # its recent decode step time (policy.StepTimes; 0: idle)
    fastest_step_s: float = 0.0  # the fastest that has been (0: no step yet)
    # moves with each report of this worker (and its restart): a dispatcher forgets its own
    # dispatches to it once it moves (-1: not tracked: the view's generation decides), unless
    # the report says which hand-offs it had read (LoadReport.handoffs_read)
    report_seq: int = -1
    handoffs_read: dict[int, int] | None = None
    incarnation: int = 0  # moves when it (re)starts in this role: what it read is gone

    @classmethod
    def of(cls, r: LoadReport, num_queued_prompt_tokens: int, report_seq: int = -1,
           incarnation: int = 0) -> DecodeInstanceView:
        """A decode worker as its report ``r`` shows it, its queued prompt tokens given (the
        monitor and the simulator count prompts routed since the report)."""
        return cls(r.worker_id, r.num_free_blocks, r.num_total_blocks, r.num_heavy,
                   r.num_light, r.predicted_demand_blocks, num_queued_prompt_tokens, r.step_s,
                   r.fastest_step_s, report_seq, r.handoffs_read, incarnation)


class DecodeView(msgspec.Struct, tag=True, array_like=True):
    """Broadcast by the cluster monitor to every prefill worker every ``monitor.interval_ms``."""

    seq: int
    decodes: list[DecodeInstanceView]
    # moves only when the decode workers' reports (or set) change: a view re-sent between
    # reports keeps it, so a dispatcher keeps counting the hand-offs it sent since them;
    # -1: not tracked (every view is from newer reports)
    generation: int = -1


class SetRole(msgspec.Struct, tag=True, array_like=True):
    """Instance flip: once drained, the worker switches role without reloading weights.
    ``cancel``: control gave up waiting; a flip to ``role`` still pending is dropped (one that
    already happened stands: its ``Ready`` tells control)."""

    role: Role
    cancel: bool = False


# ---------------------------------------------------------------- worker -> control


class Ready(msgspec.Struct, tag=True, array_like=True):
    """The worker has loaded the model and exported its KV pool; sent again, with the new
    role, when it has switched roles after a ``SetRole``."""

    worker_id: int
    role: Role
    pool: PoolHandle
    chunk_size: int
    pid: int
    switch_s: float = 0.0  # after a SetRole: seconds from drained to serving in the new role


class StartFailed(msgspec.Struct, tag=True, array_like=True):
    """The worker could not start (its model, its KV pool, its device); it exits non-zero
    right after. The control process names ``error`` when it reports the failed start."""

    worker_id: int
    error: str


class PromptLogprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of prompt tokens (token 0 has none), one entry per token: from the logits of
    the position before it, raw (no sampling parameters applied). Sent in parts, so no message
    grows with the prompt: each step that computes prompt positions before the last chunk sends
    its part on a ``TokenDelta`` with no tokens, the first token's delta carries the last part;
    the control process joins them in order (``control.protocol.join_prompt_part``) and the API
    receives the whole on the first token's delta."""

    logprobs: list[float]  # of the prompt's own token
    ranks: list[int]  # its rank among the vocabulary, 1 = the most likely
    top: list[list[tuple[int, float]]]  # (token id, logprob) best first; [] when k = 0


class TokenDelta(msgspec.Struct, array_like=True, gc=False):
    """New tokens of one request since the last StepOutput. ``finish_reason`` is set on the
    last delta of a request: ``stop`` | ``length`` | ``abort``. The worker that prefilled a
    request fills the ``first delta`` fields on the first delta it sends for it (the defaults
    elsewhere); control keeps the first it receives."""

    req_id: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    finish_reason: str | None = None
    # per token of token_ids, when sampling.top_logprobs > 0: [(token id, logprob), ...] best first
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # the prompt's logprobs, when sampling.prompt_logprobs asked for them: on deltas with no
    # tokens (parts) and on the first token's delta (the last part)
    prompt_logprobs: PromptLogprobs | None = None
    # first delta: time.monotonic() (one clock for every process of the host) when the
    # request's first prompt chunk was scheduled: arrival -> this is queue time, this -> the
    # first token prefill time
    scheduled_s: float | None = None
    # first delta of a prefill worker: the output-length bucket it predicted (-1: none)
    predicted_bucket: int = -1


class StepOutput(msgspec.Struct, tag=True, array_like=True, gc=False):
    """The tokens one model step of one worker produced: one message, or several in order
    where the step's prompt logprobs would not fit one (``Worker.send_deltas``)."""

    worker_id: int
    deltas: list[TokenDelta]


class RequestFailed(msgspec.Struct, tag=True, array_like=True):
    """The request cannot finish; the control process turns this into an error for the client."""

    req_id: int
    error: str
    invalid: bool = False  # the request itself is bad (its guide does not compile): a 400
    # a prompt reached a worker whose role takes none (a flip raced the routing): control
    # routes it again, knowing the role by then (the worker's Ready came before this)
    misrouted: bool = False


class StepFailed(msgspec.Struct, tag=True, array_like=True):
    """A step raised: the worker sends this, then exits (its state, and on CUDA its context, may
    be broken). ``req_ids`` were in that step; the control process suspects them: a request
    that is in two failed steps fails alone instead of killing a third worker."""

    worker_id: int
    req_ids: list[int]
    error: str


class LoadReport(msgspec.Struct, tag=True, array_like=True):
    """Sent every ``monitor.interval_ms`` by every worker to the cluster monitor."""

    worker_id: int
    role: Role
    num_waiting: int
    num_running: int
    num_queued_prompt_tokens: int
    num_free_blocks: int
    num_total_blocks: int
    num_heavy: int
    num_light: int
    predicted_demand_blocks: int
    busy_s: float  # cumulative seconds spent in model steps
    num_preemptions: int = 0
    # the highest AddRequest.add_seq this worker process handled before the report; None:
    # whatever was sent before the report is in it (the simulator, a restart's empty report)
    last_add_seq: int | None = None
    # decode: its recent step time (steps with decode rows: its requests' gap) and the fastest
    # that has been (policy.StepTimes; 0: idle, or no step yet)
    step_s: float = 0.0
    fastest_step_s: float = 0.0
    # cumulative: requests waiting for admission whose KV was dropped (num_preemptions counts
    # only running requests)
    num_kv_drops: int = 0
    # decode: prefill worker -> the last Handoff.dispatch_seq this process read from it (its
    # free blocks count that hand-off and those before it); None: not tracked
    handoffs_read: dict[int, int] | None = None


# ------------------------------------------------ prefill <-> decode (forwarded by control)


class Handoff(msgspec.Struct, tag=True, array_like=True):
    """A prefilled request moves to a decode worker. Its blocks in the prefill worker's pool stay
    held until the decode worker answers with KVPulled (or HandoffRejected)."""

    req_id: int
    src_worker: int
    src_block_ids: list[int]
    # prompt + the tokens generated so far: the first, or (a kept request handed back, elastic
    # P/D) all it decoded on the prefill worker; the KV of all but the last is in the blocks
    token_ids: list[int]
    num_prompt_tokens: int
    sampling: SamplingParams
    predicted_bucket: int
    predicted_len: int
    arrival_s: float
    dst_worker: int = -1  # the decode worker chosen by the dispatcher
    dispatch_seq: int = 0  # DispatchPlan.seq: echoed in the decode worker's LoadReport


class KVPulled(msgspec.Struct, tag=True, array_like=True):
    """The decode worker holds its own copy of the KV: the prefill worker frees its blocks."""

    req_id: int


class HandoffRejected(msgspec.Struct, tag=True, array_like=True):
    """The decode worker could not take the request (no room, pool unmapped); the prefill worker
    keeps the KV and re-dispatches on the next view."""

    req_id: int
    reason: str


ToWorker = (AddRequest | Abort | Shutdown | PeerPools | DecodeView | SetRole | Handoff | KVPulled
            | HandoffRejected)
FromWorker = (Ready | StepOutput | RequestFailed | LoadReport | Handoff | KVPulled | HandoffRejected
              | StepFailed | StartFailed)

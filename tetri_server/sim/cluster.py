"""A simulated cluster: instances, the global pick, the cluster monitor and the KV links on
one event loop. ``Simulation(cfg, cost, requests).run()`` -> ``SimResult``.

Control as in ``control/``: a new request goes to the least-loaded entry instance
(``LeastLoadedPicker`` fed by load reports, as ``Monitor.pick``), stamped as ``AddRequest.add_seq``
is; every ``monitor_interval_ms`` each idle instance reports (an instance inside a step reports
when the step ends, as a worker does) and the decode view is broadcast to the prefill instances
(``Monitor.decode_view``). Messages through the control star cost no time; a KV
hand-off occupies the receiving decode instance's inbound link for bytes / bandwidth + latency.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field

from tetri_server.messages import DecodeInstanceView, DecodeView, LoadReport
from tetri_server.policy import (
    DECODE_POLICIES,
    ESTIMATES,
    PREFILL_ORDERS,
    DecodeLoad,
    DecodePolicyName,
    EstimateName,
    FlipPlan,
    FlipPolicy,
    LeastLoadedPicker,
    LengthTail,
    LocalPrefill,
    PrefillOrder,
    mixed_chunk,
    num_blocks_for,
)
from tetri_server.sim.cost import CostModel
from tetri_server.sim.coupled import CoupledInstance
from tetri_server.sim.disaggregated import DecodeInstance, PrefillInstance
from tetri_server.sim.events import EventLoop
from tetri_server.sim.instances import Instance, SimRequest, SimSeq

MODES = ("disaggregated", "coupled", "coupled-chunked")


@dataclass(frozen=True)
class SimConfig:
    """What the simulated cluster runs; written beside every result."""

    mode: str = "disaggregated"
    num_prefill: int = 1  # disaggregated
    num_decode: int = 1  # disaggregated
    num_instances: int = 1  # coupled modes
    block_size: int = 16
    num_kv_blocks: int = 0  # per instance; 0 = what fits beside the weights (cost model)
    chunk_size: int = 512  # TetriInfer ChunkSize
    prefill_policy: PrefillOrder = "fcfs"
    sched_batch: int = 16  # PrefillSchedBatch
    starve_tokens: int = 8192  # srpt: passed over by more prompt tokens than this: goes first
    finish_alone: bool = False  # a chunk that finishes its first prompt finishes prompts only
    overtake_share: float = 0.0  # share of a prefill step for waiting prompts that fit whole
    token_budget: int = 512  # coupled-chunked
    local_decode_batch: int = 0  # elastic: requests a prefill instance decodes itself
    local_decode_min_tokens: int = 128  # elastic: ... only if they can decode more than this
    local_decode_max_prompt_share: float = 1.0  # ... and while prompt steps take at most this
    local_decode_hand_back: bool = False  # elastic: kept ones go to decode when prompts queue
    local_decode_balance: bool = False  # ... and only where it decodes faster than on decode
    local_decode_balance_backlog: bool = False  # ... which then decides past a chunk of backlog
    local_decode_loaded_x: float = 0.0  # ... only while decode steps are >= x their fastest
    local_decode_min_held: int = 0  # ... only while every decode instance holds this many
    local_decode_chunk: int = 0  # elastic: most tokens of a step with kept rows; 0 = chunk_size
    local_decode_prompt_first: bool = False  # elastic: a backlog within a mixed step: alone
    local_decode_full_chunk_backlog: int = 0  # ... beyond it, mixed steps take the chunk
    local_decode_full_chunk_share: float = 0.0  # ... below this prompt share, too
    local_finish_tokens: int = 0  # elastic: a request of at most this many tokens ends there
    local_prefill_tokens: int = 0  # elastic: prompt tokens a decode instance prefills a step
    local_prefill_slice: str = "chunk"  # ... and at most chunk_size of them, or "fixed"
    local_prefill_margin: float = 1.0  # ... when prefill's backlog exceeds it by this many chunks
    local_prefill_max_gap_x: float = 0.0  # ... while its step is <= this x its fastest (0: any)
    decode_policy: DecodePolicyName = "reserve-dynamic"
    # [decode] estimate; "refined" reads the length tails of the shipped predictor artifact
    # whose granularity is ``granularity`` (none matching: the simulation does not start)
    decode_estimate: EstimateName = "bucket"
    max_batch: int = 256
    recompute_tokens: int = 256  # [decode] recompute_tokens (0: a preempted context in one step)
    waiting_kv_first: bool = True  # [decode] waiting_kv_first (false: preempt running ones first)
    granularity: int = 200
    # the server's predictor.artifact (``sim --config``): its bucket count and length tails;
    # "" = a trained artifact's count at ``granularity`` and the shipped one's tails
    predictor_artifact: str = ""
    heavy_decode_tokens: int = 128
    predictor_accuracy: float = 1.0  # 1.0 = oracle
    predictor_miss: str = "neighbour"  # a miss: a neighbouring bucket, or "uniform": any other
    predictor_model: str = ""  # e.g. "OPT-125M": its prefill time runs in-line; "" = free
    dispatch: str = "power-of-two"  # or "round-robin"
    seed: int = 0
    monitor_interval_ms: float = 100.0
    max_model_len: int = 2048
    flip: bool = False  # instance flip (disaggregated): policy.FlipPolicy on every monitor tick
    flip_window_s: float = 60.0  # [flip] window_s
    flip_idle_s: float = 60.0  # [flip] idle_s
    flip_low_load: float = 0.1  # [flip] low_load
    flip_min_interval_s: float = 120.0  # [flip] min_interval_s (the policy's cooldown)
    flip_switch_s: float = 0.006  # drained -> serving in the new role (paper: 5-7 ms)
    # a drain not done by then is cancelled (FlipController.timeout_s: [server]
    # drain_timeout_s + 60 s) and the worker serves its old role again
    flip_timeout_s: float = 90.0
    # The paper's mock KV transfer (its KV precomputed offline): a prefilled prompt's blocks
    # are freed on the prefill instance at once, so it never waits for decode room or the
    # pull; the decode side still reserves the KV and waits bytes / bandwidth. Not the server.
    mock_handoff: bool = False
    # The paper's fixed-size chunks: a prefill instance runs each chunk padded to chunk_size,
    # which costs compute where the profile's padding does (GPUs). The server runs only a
    # chunk's real tokens (its prefill worker never pads), as this does by default.
    pad_chunks: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if min(self.num_prefill, self.num_decode, self.num_instances, self.block_size,
               self.chunk_size, self.sched_batch, self.starve_tokens, self.token_budget,
               self.max_batch) < 1:
            raise ValueError("instance counts, sizes and budgets must be >= 1")
        if self.prefill_policy not in PREFILL_ORDERS:
            raise ValueError(f"prefill_policy must be one of {PREFILL_ORDERS}")
        if self.decode_policy not in DECODE_POLICIES:
            raise ValueError(f"decode_policy must be one of {DECODE_POLICIES}")
        if self.decode_estimate not in ESTIMATES:
            raise ValueError(f"decode_estimate must be one of {ESTIMATES}")
        if self.local_prefill_slice not in ("chunk", "fixed"):
            raise ValueError("local_prefill_slice must be chunk or fixed")
        if self.dispatch not in ("power-of-two", "round-robin"):
            raise ValueError("dispatch must be power-of-two or round-robin")
        if self.monitor_interval_ms <= 0:
            raise ValueError("monitor_interval_ms must be > 0")
        if self.predictor_miss not in ("neighbour", "uniform"):
            raise ValueError("predictor_miss must be neighbour or uniform")
        if (self.local_decode_hand_back and self.local_decode_balance
                and self.local_decode_balance_backlog):
            raise ValueError("local_decode_hand_back and local_decode_balance_backlog "
                             "contradict each other (as the server's config says)")
        if self.mock_handoff and self.local_decode_batch:
            raise ValueError("mock_handoff frees the prompt's KV: no local decode (elastic)")

    @property
    def num_buckets(self) -> int:
        """The server's bucket count: its artifact's, else a trained one's at granularity."""
        if self.predictor_artifact:
            from tetri_server.predictor import artifact

            meta = artifact.read_meta(artifact.resolve(self.predictor_artifact))
            return int(meta["num_buckets"])
        from tetri_server.sim.predictor import num_buckets

        return num_buckets(self.granularity)

    @property
    def num_held_instances(self) -> int:
        if self.mode == "disaggregated":
            return self.num_prefill + self.num_decode
        return self.num_instances

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass
class SimResult:
    requests: list[SimRequest]
    instances: list[dict[str, object]]  # per instance: id, role, busy_s, steps, preemptions,
    # kv_drops (waiting requests' KV dropped)
    duration_s: float  # virtual: 0 to the last request's end
    num_events: int
    wall_s: float  # real seconds the simulation took
    flips: list[dict[str, object]] = field(default_factory=list)  # time_s, worker, from, to


class Simulation:
    def __init__(self, cfg: SimConfig, cost: CostModel, requests: Sequence[SimRequest],
                 predictor_cost: CostModel | None = None,
                 on_finished: Callable[[SimRequest], None] | None = None) -> None:
        self.cfg = cfg
        self.cost = cost
        self.predictor_cost = predictor_cost
        self.on_finished = on_finished  # e.g. a progress bar
        self.loop = EventLoop()
        self.requests = list(requests)
        self._tails: dict[str, LengthTail] = {}  # by predictor kind, read once (length_tail)
        num_blocks = cfg.num_kv_blocks or cost.num_kv_blocks(cfg.block_size)
        # a prompt that can never have its blocks waited forever (a worker refuses to start
        # with a pool that does not hold max_model_len tokens; a small pool that holds the
        # prompts is simulated, and one that outgrows it decoding fails as on a worker)
        longest = max((r.prompt_len for r in self.requests), default=0)
        if num_blocks_for(longest, cfg.block_size) > num_blocks:
            raise ValueError(f"a prompt of {longest} tokens does not fit a KV pool of "
                             f"{num_blocks} blocks of {cfg.block_size}; raise num_kv_blocks")
        self.instances: list[Instance] = []
        if cfg.mode == "disaggregated":
            for wid in range(cfg.num_prefill):
                self.instances.append(PrefillInstance(self, wid, num_blocks))
            for wid in range(cfg.num_prefill, cfg.num_prefill + cfg.num_decode):
                self.instances.append(DecodeInstance(self, wid, num_blocks))
        else:
            chunked = cfg.mode == "coupled-chunked"
            self.instances = [CoupledInstance(self, wid, num_blocks, chunked=chunked)
                              for wid in range(cfg.num_instances)]
        self.prefills = [i for i in self.instances if isinstance(i, PrefillInstance)]
        self.picker = LeastLoadedPicker(
            coupled=cfg.mode != "disaggregated",
            local_prefill=(LocalPrefill(cfg.block_size, cfg.local_prefill_margin,
                                        cfg.local_prefill_max_gap_x)
                           if cfg.local_prefill_tokens
                           else None))
        self.flip_policy = (FlipPolicy(window_s=cfg.flip_window_s, idle_window_s=cfg.flip_idle_s,
                                       low_util=cfg.flip_low_load,
                                       cooldown_s=cfg.flip_min_interval_s)
                            if cfg.flip and cfg.mode == "disaggregated" else None)
        self.draining: dict[int, FlipPlan] = {}  # flipping instances: no new work
        self._drain_start_s: dict[int, float] = {}  # when each began to drain
        self._switching: set[int] = set()  # drained, switch under way
        self.flips: list[dict[str, object]] = []
        # worker id -> (preemptions, waiting-KV drops) of the roles it flipped from
        self._before_flips: dict[int, tuple[int, int]] = {}
        self._view_seq = 0
        self._reports: dict[int, LoadReport] = {}  # each instance's latest (Monitor.reports)
        self._view_generation = 0
        self._report_seq: dict[int, int] = {}  # ``Monitor._report_seq``
        self._incarnation: dict[int, int] = {}  # ``Monitor._incarnation``
        self._num_done = 0
        self.parked: list[SimRequest] = []

    # ------------------------------------------------------------------ control

    def run(self) -> SimResult:
        wall0 = time.perf_counter()
        for inst in self.instances:
            self._incarnation[inst.worker_id] = 1
            self.on_report(inst.report())  # Monitor.on_ready
        for req in self.requests:
            self.loop.at(req.arrival_s, functools.partial(self.arrive, req))
        self.loop.at(0.0, self.tick)
        self.loop.run()
        stuck = [r for r in self.requests if r.end_s is None and r.error is None]
        for req in stuck:  # nothing left to happen, yet unfinished: a bug or a deadlock
            req.error = "never finished (simulation ran out of events)"
        ends = [r.end_s for r in self.requests if r.end_s is not None]
        return SimResult(
            requests=self.requests,
            instances=[dict(id=i.worker_id, role=i.role, busy_s=i.busy_s, steps=i.num_steps,
                            active_s=i.last_end_s - i.first_start_s if i.num_steps else 0.0,
                            preemptions=load.num_preemptions
                            + self._before_flips.get(i.worker_id, (0, 0))[0],
                            kv_drops=load.num_kv_drops
                            + self._before_flips.get(i.worker_id, (0, 0))[1])
                       for i, load in zip(self.instances, map(_load, self.instances),
                                          strict=True)],
            duration_s=max(ends, default=0.0),
            num_events=self.loop.num_handled,
            wall_s=time.perf_counter() - wall0,
            flips=self.flips,
        )

    def arrive(self, req: SimRequest) -> None:
        chunks = {i.worker_id: self.cfg.chunk_size for i in self.instances}
        wid = self.picker.pick(req.prompt_len, exclude=self.draining, chunk_sizes=chunks)
        if wid is None:
            self.parked.append(req)
            return
        if self.instances[wid].role == "decode":  # Monitor.prefill_chunk: 0 if none serves
            serving = any(i.role == "prefill" and i.worker_id not in self.draining
                          for i in self.instances)
            chunk = mixed_chunk(self.cfg.chunk_size, self.cfg.local_decode_chunk) if serving else 0
            self.instances[wid].deliver(("add", req, self.picker.stamp(wid), chunk))
            self._broadcast_view()  # Router.on_decode_prompt
        else:
            self.instances[wid].deliver(("add", req, self.picker.stamp(wid)))

    def tick(self) -> None:
        """The monitor: every idle instance reports (one in a step reports when it ends), the
        decode view goes to the prefill side."""
        for inst in self.instances:
            if inst.busy:
                inst.report_due = True
            else:
                self.on_report(inst.report())
        if self.flip_policy is not None:
            self.flip_step(self._serving())
        self._broadcast_view()
        if self._num_done < len(self.requests):
            self.loop.after(self.cfg.monitor_interval_ms / 1000.0, self.tick)

    def on_report(self, report: LoadReport) -> None:
        """``Cluster._on_report``: adopt it (``Monitor.on_report``); the view goes out again at
        once when a decode instance has no routed prompt left to prefill after having some."""
        self._reports[report.worker_id] = report
        emptied = self.picker.on_report(report)
        if report.role == "decode":
            self._view_generation += 1
            self._report_seq[report.worker_id] = self._view_generation
        if emptied:
            self._broadcast_view()

    def _serving(self) -> list[LoadReport]:
        """The latest reports of the instances not flipping."""
        return [r for wid, r in sorted(self._reports.items()) if wid not in self.draining]

    def _broadcast_view(self) -> None:
        """``Cluster.broadcast_view``: from the latest reports, with the prompts routed to each
        decode instance since."""
        if self.prefills:
            self._view_seq += 1
            view = decode_view(self._view_seq, self._serving(), self.picker.queued_tokens,
                               self._view_generation, self._report_seq, self._incarnation)
            for inst in self.prefills:
                inst.deliver(("view", view))

    def send(self, dst: Instance, msg: tuple[object, ...]) -> None:
        """Instance -> control -> instance: delivered by the loop (no time passes), never inside
        the sender's handler, as on the rings (a reply cannot change what its sender is
        iterating over)."""
        self.loop.after(0.0, functools.partial(dst.deliver, msg))

    def handoff(self, src: PrefillInstance, seq: SimSeq, decode_worker: int,
                dispatch_seq: int) -> None:
        dst = self.instances[decode_worker]
        if decode_worker in self.draining or not isinstance(dst, DecodeInstance):
            self.send(src, ("rejected", seq.req.req_id))  # Router.forward_handoff: draining
            return
        self.send(dst, ("handoff", src, seq.req, seq.num_tokens, dispatch_seq))

    # ------------------------------------------------------------------ instance flip

    def flip_step(self, serving: list[LoadReport]) -> None:
        """``FlipController.on_tick`` and the drain: a flipping instance gets no new work;
        once drained it switches role in place (same id and pool) after ``flip_switch_s``."""
        assert self.flip_policy is not None
        now = self.loop.now_s
        for wid, plan in list(self.draining.items()):
            inst = self.instances[wid]
            if wid in self._switching:
                continue
            if now - self._drain_start_s[wid] > self.cfg.flip_timeout_s:  # cancelled
                del self.draining[wid]
                self.flip_policy.on_done(plan, now)
                self.flips.append({"time_s": now, "worker": wid, "from": plan.from_role,
                                   "to": plan.to_role, "cancelled": True})
                self._route_parked()  # Cluster.route_parked: it serves its old role again
                continue
            self.check_drained(inst)
        decided = self.flip_policy.plan(serving, now)
        if decided is not None:
            self.draining[decided.worker_id] = decided
            self._drain_start_s[decided.worker_id] = now

    def check_drained(self, inst: Instance) -> None:
        """A flipping instance that has drained switches now (``Worker.run``: as soon as its
        loop finds it drained), not at the next monitor tick."""
        wid = inst.worker_id
        plan = self.draining.get(wid)
        if plan is None or wid in self._switching or inst.busy or not inst.is_drained():
            return
        self._switching.add(wid)
        self.loop.after(self.cfg.flip_switch_s, functools.partial(self._switch, wid, plan))

    def _route_parked(self) -> None:
        """``Cluster.route_parked``: requests that found no serving entry worker try again."""
        parked, self.parked = self.parked, []
        for req in parked:
            self.arrive(req)

    def _switch(self, wid: int, plan: FlipPlan) -> None:
        old = self.instances[wid]
        load, (pre, drops) = _load(old), self._before_flips.get(wid, (0, 0))
        self._before_flips[wid] = (pre + load.num_preemptions, drops + load.num_kv_drops)
        cls = DecodeInstance if plan.to_role == "decode" else PrefillInstance
        new = cls(self, wid, old.alloc.num_blocks)
        new.alloc, new.busy_s, new.num_steps = old.alloc, old.busy_s, old.num_steps
        new.first_start_s, new.last_end_s = old.first_start_s, old.last_end_s
        new.last_add_seq = old.last_add_seq  # one worker process across the flip
        self.instances[wid] = new
        self.prefills = [i for i in self.instances if isinstance(i, PrefillInstance)]
        del self.draining[wid]
        self._switching.discard(wid)
        self._incarnation[wid] += 1  # Monitor.on_ready
        self.on_report(new.report())
        assert self.flip_policy is not None
        self.flip_policy.on_done(plan, self.loop.now_s)
        self.flips.append({"time_s": self.loop.now_s, "worker": wid,
                           "from": plan.from_role, "to": plan.to_role})
        self._broadcast_view()  # Cluster._on_ready: the view before the prompts
        self._route_parked()  # Cluster._on_ready

    def pull(self, dst: DecodeInstance, req_id: int, num_tokens: int) -> None:
        """The KV of ``num_tokens`` crosses ``dst``'s inbound link, after what is on it."""
        start_s = max(self.loop.now_s, dst.link_free_s)
        dst.link_free_s = start_s + self.cost.handoff_s(num_tokens)
        self.loop.at(dst.link_free_s, functools.partial(dst.deliver, ("kv_ready", req_id)))

    @property
    def tail_kind(self) -> str:
        """Whose length tails the refined estimate reads: the true buckets' (oracle) when the
        emulated predictor never misses, else the shipped classifier's rows by predicted
        bucket, which are as wide as a predictor's misses make them (the oracle's, inside one
        true bucket, were overconfident for a missed one)."""
        return "oracle" if self.cfg.predictor_accuracy >= 1.0 else "classifier"

    def length_tail(self, kind: str) -> LengthTail | None:
        """``workers.base.length_tail`` for the simulator: the refined estimate's distribution
        for predictor ``kind``, or None under ``decode_estimate = "bucket"``. Instances ask when
        made, so a missing artifact stops the simulation before its first event."""
        if self.cfg.decode_estimate == "bucket":
            return None
        if kind not in self._tails:
            self._tails[kind] = load_tail(kind, self.cfg.granularity,
                                          self.cfg.predictor_artifact)
        return self._tails[kind]

    def predictor_s(self, prompt_lens: Sequence[int]) -> float:
        if self.predictor_cost is None or not prompt_lens:
            return 0.0
        return self.predictor_cost.step_s([(n, 0) for n in prompt_lens])

    def finished(self, req: SimRequest) -> None:
        self._num_done += 1
        if self.on_finished is not None:
            self.on_finished(req)


def _load(inst: Instance) -> DecodeLoad:
    """An instance's decode-side counts (all 0 where it has no admission)."""
    admission = getattr(inst, "admission", None)
    return DecodeLoad(0, 0, 0, 0, 0, 0) if admission is None else admission.load()


def load_tail(kind: str, granularity: int, artifact_name: str = "") -> LengthTail:
    """The tails of predictor ``kind`` from ``artifact_name`` (the server's artifact), else from
    the shipped artifact of ``granularity`` tokens."""
    from tetri_server.predictor import artifact, tails  # numpy and JSON: only when refined

    if artifact_name:
        return tails.load(kind, artifact_name)
    for name in artifact.shipped_artifacts():
        if int(artifact.read_meta(artifact.resolve(name))["granularity"]) == granularity:
            return tails.load(kind, name)
    raise ValueError(f"decode_estimate = refined: no shipped predictor artifact has granularity "
                     f"{granularity} (shipped: {', '.join(artifact.shipped_artifacts())})")


def decode_view(seq: int, reports: list[LoadReport],
                queued: Callable[[int], int] | None = None, generation: int = -1,
                report_seqs: Mapping[int, int] | None = None,
                incarnations: Mapping[int, int] | None = None) -> DecodeView:
    """``Monitor.decode_view`` from the decode instances' latest reports; ``queued``: a
    worker's queued prompt tokens with those routed since its report (default: the report's);
    ``report_seqs``, ``incarnations``: each worker's ``report_seq`` (default: not tracked)
    and ``incarnation`` (default 0)."""
    seqs, lives = report_seqs or {}, incarnations or {}
    return DecodeView(seq, [DecodeInstanceView.of(r, r.num_queued_prompt_tokens if queued is None
                                                     else queued(r.worker_id),
                                                  seqs.get(r.worker_id, -1),
                                                  lives.get(r.worker_id, 0))
                            for r in sorted(reports, key=lambda r: r.worker_id)
                            if r.role == "decode"], generation)

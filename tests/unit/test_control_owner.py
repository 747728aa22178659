"""The control process's message handlers trust only the worker that holds a request: on a
real ``Cluster`` that is never started (its request table, router and handlers; no worker
process, no channel)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import msgspec
from prometheus_client.parser import text_string_to_metric_families

from tetri_server.config import load_config
from tetri_server.control.cluster import Cluster
from tetri_server.control.flip import FlipRefused
from tetri_server.control.requests import ReqState
from tetri_server.messages import (
    Abort,
    AddRequest,
    Handoff,
    KVPulled,
    LoadReport,
    RequestFailed,
    SamplingParams,
    SetRole,
    StepOutput,
    TokenDelta,
)
from tetri_server.metrics import Metrics


def unstarted(metrics: Metrics | None = None, *sets: str) -> Cluster:
    """A cluster over the built-in tiny model, constructed but never started."""
    return Cluster(load_config(None, ["model.path=builtin:tiny",
                                      "cluster.mode=disaggregated", *sets]), metrics)


def worker(wid: int) -> SimpleNamespace:
    return SimpleNamespace(worker_id=wid)  # what the handlers read of a WorkerHandle


def handoff_count(m: Metrics) -> float:
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            if (s.name == "tetri_request_phase_seconds_count"
                    and s.labels.get("phase") == "handoff"):
                return s.value
    return 0.0


def test_a_failure_from_a_worker_that_no_longer_holds_the_request_is_ignored() -> None:
    """Regression: a RequestFailed from a former owner (a CUDA hand-off withdrawn and re-run
    elsewhere, the old owner not yet through its Abort) failed the request that was running
    fine on its new worker."""

    async def main() -> None:
        cluster = unstarted()
        req = cluster.table.add([1, 2], SamplingParams(), "", None)
        req.owner = 2  # re-run on worker 2; worker 1 held it before
        cluster._on_request_failed(worker(1), RequestFailed(req.req_id, "stale"))  # type: ignore[arg-type]
        assert cluster.table.get(req.req_id) is req and req.queue.empty()
        cluster._on_request_failed(worker(2), RequestFailed(req.req_id, "bad"))  # type: ignore[arg-type]
        assert cluster.table.get(req.req_id) is None and not req.queue.empty()

    asyncio.run(main())


def test_a_pulled_handoff_whose_prefill_worker_died_is_decoding() -> None:
    """Regression: a KVPulled for a request whose prefill worker had died meanwhile (its source
    reset: the shm pool outlives it) left it in HANDOFF for good, its hand-off time never
    observed (and a later death of its decode worker took it for a hand-off in flight)."""

    async def main() -> None:
        metrics = Metrics("m")
        cluster = unstarted(metrics)
        req = cluster.table.add([1, 2], SamplingParams(), "", None)
        req.owner, req.src, req.state = 2, -1, ReqState.HANDOFF  # its prefill worker died
        cluster.router.on_kv_pulled(worker(1), KVPulled(req.req_id))  # type: ignore[arg-type]
        assert req.state is ReqState.HANDOFF and handoff_count(metrics) == 0  # not the owner
        cluster.router.on_kv_pulled(worker(2), KVPulled(req.req_id))  # type: ignore[arg-type]
        assert req.state is ReqState.DECODE and handoff_count(metrics) == 1

    asyncio.run(main())


def test_a_suspect_is_cleared_by_a_decode_steps_token_not_by_its_prefill_token() -> None:
    """Regression: a suspect's mark was cleared by its first token after the re-run, which in
    disaggregated mode comes from the prefill worker: a request that crashed a decode step was
    cleared before it reached one, the next suspect was released, and a second crash of the
    decode batch again named no one. Two tokens (a prefill and a decode step's) clear it."""

    async def main() -> None:
        posted: list[int] = []
        cluster = unstarted()
        router = cluster.router
        # where a re-run goes (no worker here): recorded, owned by worker 0
        router.route = lambda req: (setattr(req, "owner", 0), posted.append(req.req_id))  # type: ignore[method-assign]
        a, b = (cluster.table.add([1, 2], SamplingParams(), "", None) for _ in range(2))
        for req in (a, b):
            req.suspect = True
            router.rerun(req)
        assert posted == [a.req_id]  # b waits for a's trial
        cluster._on_step_output(worker(0),  # type: ignore[arg-type]
                                StepOutput(0, [TokenDelta(a.wire_id, [7])]))  # prefill's token
        assert a.suspect and posted == [a.req_id]
        cluster._on_step_output(worker(0),  # type: ignore[arg-type]
                                StepOutput(0, [TokenDelta(a.wire_id, [8])]))  # a decode step's
        assert not a.suspect and posted == [a.req_id, b.req_id]

    asyncio.run(main())


def live(wid: int, role: str, posted: list[object]) -> SimpleNamespace:
    """A serving worker as the router and handlers read it; what control sends it is kept."""
    return SimpleNamespace(worker_id=wid, role=role, is_ready=True, alive=True, pool=None,
                           chunk_size=64 if role == "prefill" else 0, post=posted.append)


def idle_report(wid: int, role: str) -> LoadReport:
    return LoadReport(worker_id=wid, role=role, num_waiting=0, num_running=0,
                      num_queued_prompt_tokens=0, num_free_blocks=100, num_total_blocks=100,
                      num_heavy=0, num_light=0, predicted_demand_blocks=0, busy_s=0.0)


def serving(cluster: Cluster, roles: dict[int, str]) -> dict[int, list[object]]:
    """Live workers of these roles on ``cluster``, each with an idle report; what control
    posts to each, by worker id."""
    posted: dict[int, list[object]] = {wid: [] for wid in roles}
    for wid, role in roles.items():
        cluster.workers[wid] = live(wid, role, posted[wid])  # type: ignore[assignment]
        cluster.monitor.on_report(cluster.workers[wid], idle_report(wid, role))
    return posted


def die(cluster: Cluster, wid: int) -> None:
    """Worker ``wid`` exits, as the supervisor reports it."""
    cluster.workers[wid].alive = cluster.workers[wid].is_ready = False
    cluster._on_death(cluster.workers[wid], -9)  # type: ignore[arg-type]


def test_a_withdrawn_attempt_handed_to_the_same_decode_worker_again_keeps_its_tokens_out(
        ) -> None:
    """Regression (review of session 61): a hand-off withdrawn from a decode worker (CUDA IPC,
    its prefill worker dead) re-ran on another prefill worker, which handed it to that same
    decode worker again. A token of the old attempt, from a step still in flight there when
    the Abort came, then arrived from the request's owner and counted as the re-run's: a token
    twice, HTTP 200. Each attempt now has its own id on the wire, and the old one's messages
    (a token, a KVPulled) are ignored."""

    async def main() -> None:
        cluster = unstarted()
        posted = serving(cluster, {0: "prefill", 1: "decode", 2: "prefill"})
        cluster.workers[2].is_ready = False  # the second prefill worker comes up later
        req = cluster.table.add([1, 2, 3], SamplingParams(max_tokens=8), "", None)
        cluster.router.route(req)
        first = posted[0][-1]
        assert isinstance(first, AddRequest)
        old = first.req_id

        def handoff(wire_id: int, src: int) -> Handoff:
            return Handoff(wire_id, src, [0], [1, 2, 3, *req.output_ids], 3, SamplingParams(),
                           0, 8, req.arrival_s, dst_worker=1)

        def tokens(wid: int, wire_id: int, token: int) -> None:
            cluster._on_step_output(cluster.workers[wid],  # type: ignore[arg-type]
                                    StepOutput(wid, [TokenDelta(wire_id, [token])]))

        tokens(0, old, 5)  # the prefill step's token
        cluster.router.forward_handoff(cluster.workers[0], handoff(old, 0))  # type: ignore[arg-type]
        cluster.router.on_kv_pulled(cluster.workers[1], KVPulled(old))  # type: ignore[arg-type]
        tokens(1, old, 6)  # a decode step's
        assert req.output_ids == [5, 6]
        req.state, req.src = ReqState.HANDOFF, 0  # (as if the pull were still under way)
        cluster.workers[0].alive = cluster.workers[0].is_ready = False
        cluster.workers[2].is_ready = True
        cluster.router.withdraw(req)  # the prefill worker died under the hand-off
        assert [m.req_id for m in posted[1] if isinstance(m, Abort)] == [old]
        again = posted[2][-1]
        assert isinstance(again, AddRequest) and again.prompt_ids == [1, 2, 3, 5, 6]
        new = again.req_id
        tokens(2, new, 7)  # the re-run's prefill token
        cluster.router.forward_handoff(cluster.workers[2], handoff(new, 2))  # type: ignore[arg-type]
        assert req.owner == 1 and req.state is ReqState.HANDOFF  # the same decode worker
        tokens(1, old, 7)  # the old attempt's step, in flight when the Abort came
        cluster.router.on_kv_pulled(cluster.workers[1], KVPulled(old))  # type: ignore[arg-type]
        assert req.output_ids == [5, 6, 7] and req.state is ReqState.HANDOFF
        cluster.router.on_kv_pulled(cluster.workers[1], KVPulled(new))  # type: ignore[arg-type]
        tokens(1, new, 8)
        assert req.output_ids == [5, 6, 7, 8] and req.state is ReqState.DECODE

    asyncio.run(main())


def test_a_flip_that_the_death_of_the_other_worker_of_its_role_would_leave_alone_ends() -> None:
    """Regression (review of session 62): a decode worker flipping to prefill went on
    draining after the other decode worker died, then switched, leaving no decode worker:
    the requests on the prefill worker got 503 at ``cluster.worker_wait_s`` (or never went on
    with restarts off). The flip now ends with FlipRefused, the worker is told to cancel it,
    and it serves as a decode worker again."""

    async def main() -> None:
        cluster = unstarted()
        posted = serving(cluster, {0: "prefill", 1: "decode", 2: "decode"})
        flip = asyncio.ensure_future(cluster.flipper.flip(1, "prefill"))
        await asyncio.sleep(0.01)
        assert posted[1] == [SetRole("prefill")] and cluster.draining == {1}
        die(cluster, 2)
        try:
            await asyncio.wait_for(flip, 5)
            raise AssertionError("the flip went on")
        except FlipRefused as e:
            assert "worker 2 died" in str(e)
        assert SetRole("prefill", cancel=True) in posted[1] and cluster.draining == set()
        assert cluster.router.has_live("decode")

    asyncio.run(main())


def test_an_automatic_flip_planned_just_before_the_other_worker_of_its_role_died_is_dropped(
        ) -> None:
    """Regression (session 66 review): the flip policy planned worker 0's flip at a tick
    (two prefill workers serving), and worker 1 died in the same loop turn, before the flip's
    task ran: the death saw no flip pending, and the flip went on to leave no prefill worker."""
    from tetri_server.policy import FlipPlan

    async def main() -> None:
        cluster = unstarted(None, "flip.enabled=true", "cluster.prefill_workers=2")
        posted = serving(cluster, {0: "prefill", 1: "prefill", 2: "decode"})
        plan = FlipPlan(0, "prefill", "decode", 0.0)
        policy = cluster.flipper.policy

        def planned(reports: object, now: float) -> FlipPlan:
            policy.begin(plan)
            return plan

        policy.plan = planned  # type: ignore[method-assign]
        cluster.flipper.on_tick()
        die(cluster, 1)
        await asyncio.sleep(0.05)
        assert not [m for m in posted[0] if isinstance(m, SetRole)]
        assert cluster.draining == set() and cluster.router.has_live("prefill")
        assert policy.refusal("prefill", 2, 1e9) is None  # the plan ended: flips go on later

    asyncio.run(main())


def test_requests_parked_while_a_flip_drained_go_on_when_it_is_cancelled() -> None:
    """Regression (review of session 62): requests parked because the only other worker of
    the flipping worker's role was down stayed parked when the flip was cancelled and the
    worker served its old role again (only a Ready routed them), and got 503 at their
    deadline beside an idle worker."""

    async def main() -> None:
        cluster = unstarted(None, "decode.local_prefill_tokens=0")  # no prompt to decode
        posted = serving(cluster, {0: "prefill", 1: "decode", 3: "prefill"})
        flip = asyncio.ensure_future(cluster.flipper.flip(0, "decode"))
        await asyncio.sleep(0.01)
        die(cluster, 3)
        req = cluster.table.add([1, 2, 3], SamplingParams(), "", None)
        cluster.router.route(req)  # worker 0 still drains: no prefill worker serves
        assert req in cluster.table.parked
        await asyncio.wait_for(asyncio.gather(flip, return_exceptions=True), 5)
        assert req.owner == 0 and isinstance(posted[0][-1], AddRequest)

    asyncio.run(main())


def test_a_prompt_that_reached_a_worker_of_another_role_is_routed_again() -> None:
    """Regression (review of session 63): a prompt routed just as a cancelled flip switched its
    worker to decode (local prefill off) sat there unprefilled until request_timeout_s, and
    kept that worker from ever draining. The worker now refuses it as misrouted and control,
    which knows the new role by then, routes it again; a plain failure still fails."""

    async def main() -> None:
        cluster = unstarted(None, "decode.local_prefill_tokens=0")
        posted = serving(cluster, {0: "prefill", 1: "decode", 2: "prefill"})
        cluster.monitor.on_report(cluster.workers[2], msgspec.structs.replace(  # 0 is less loaded
            idle_report(2, "prefill"), num_queued_prompt_tokens=500))
        req = cluster.table.add([1, 2, 3], SamplingParams(), "", None)
        cluster.router.route(req)
        [sent] = posted[0]
        assert isinstance(sent, AddRequest)
        cluster.workers[0].role = "decode"  # its Ready as a decode worker came first
        cluster.monitor.on_report(cluster.workers[0], idle_report(0, "decode"))
        cluster._on_request_failed(cluster.workers[0], RequestFailed(  # type: ignore[arg-type]
            sent.req_id, "routed to a decode worker", misrouted=True))
        again = posted[2][-1]
        assert isinstance(again, AddRequest) and again.prompt_ids == [1, 2, 3]
        assert cluster.table.get(req.req_id) is req and req.owner == 2 and req.queue.empty()

    asyncio.run(main())


def test_a_decode_worker_without_local_prefill_refuses_a_prompt_as_misrouted() -> None:
    from tetri_server.workers.decode import DecodeRole

    sent: list[object] = []
    role = DecodeRole.__new__(DecodeRole)
    role.w = SimpleNamespace(cfg=load_config(None, ["decode.local_prefill_tokens=0"]),  # type: ignore[assignment]
                             send=sent.append, worker_id=1)
    role.handle(AddRequest(7, [1, 2], SamplingParams(), 0.0))
    assert sent == [RequestFailed(7, "routed to a decode worker", misrouted=True)]


def test_a_decode_worker_that_starts_to_flip_leaves_the_dispatchers_view_at_once() -> None:
    """Regression (review of session 63): the view without it went out at the next monitor
    tick; until then a prefill worker could dispatch to it, control refused the hand-off, and
    that prefill worker sent no hand-off until the next view (up to one interval lost)."""
    from tetri_server.messages import DecodeView

    async def main() -> None:
        cluster = unstarted()
        posted = serving(cluster, {0: "prefill", 1: "decode", 2: "decode"})
        flip = asyncio.ensure_future(cluster.flipper.flip(1, "prefill"))
        await asyncio.sleep(0.01)
        views = [m for m in posted[0] if isinstance(m, DecodeView)]
        assert views and [d.worker_id for d in views[-1].decodes] == [2]
        flip.cancel()
        await asyncio.gather(flip, return_exceptions=True)

    asyncio.run(main())


def test_the_decode_view_stamps_each_worker_with_its_own_last_report() -> None:
    """What lets a dispatcher keep counting its hand-offs to a worker that has not reported
    since (``DecodeInstanceView.report_seq``; review of session 63)."""
    cluster = unstarted()
    serving(cluster, {0: "prefill", 1: "decode", 2: "decode"})
    first = {d.worker_id: d.report_seq for d in cluster.monitor.decode_view().decodes}
    cluster.monitor.on_report(cluster.workers[2], idle_report(2, "decode"))
    second = {d.worker_id: d.report_seq for d in cluster.monitor.decode_view().decodes}
    assert min(first.values()) >= 0 and second[1] == first[1] and second[2] > first[2]


def test_a_hand_off_refused_and_forwarded_again_counts_once_in_the_metrics() -> None:
    """Regression (review of session 63): each forward of a hand-off the decode worker had
    refused observed the prefill phase again and added its KV bytes again, though the KV moved
    once (four prefill observations and four times the bytes for one request here)."""
    from tetri_server.messages import HandoffRejected, PoolHandle

    async def main() -> None:
        metrics = Metrics("m")
        cluster = unstarted(metrics)
        serving(cluster, {0: "prefill", 1: "decode"})
        cluster.workers[0].pool = PoolHandle(0, "shm", "x", 2, 64, 16, 4, 8, "float32")
        req = cluster.table.add([1, 2, 3], SamplingParams(max_tokens=8), "", None)
        cluster.router.route(req)
        wid = req.wire_id
        h = Handoff(wid, 0, [0], [1, 2, 3, 5], 3, SamplingParams(max_tokens=8), 0, 8,
                    req.arrival_s, dst_worker=1)
        for _ in range(3):
            cluster.router.forward_handoff(cluster.workers[0], h)  # type: ignore[arg-type]
            cluster.router.on_handoff_rejected(  # type: ignore[arg-type]
                cluster.workers[1], HandoffRejected(wid, "no room"))
        cluster.router.forward_handoff(cluster.workers[0], h)  # type: ignore[arg-type]
        cluster.router.on_kv_pulled(cluster.workers[1], KVPulled(wid))  # type: ignore[arg-type]
        got = {}
        for fam in text_string_to_metric_families(metrics.render().decode()):
            for s in fam.samples:
                if s.name == "tetri_request_phase_seconds_count":
                    got[s.labels["phase"]] = s.value
                if s.name == "tetri_handoff_bytes_total":
                    got["bytes"] = s.value
        assert got["prefill"] == got["handoff"] == 1
        assert got["bytes"] == 2 * 2 * 4 * 16 * 8 * 4  # one block of 2 layers, K and V

    asyncio.run(main())


def test_the_workers_are_told_the_context_the_api_accepts() -> None:
    """Control reads the context from config.json raw, the workers through transformers: they
    get control's (resolved) number, so a worker whose transformers reads less refuses to
    start, naming both, instead of cutting outputs at its own limit with "length"."""
    cluster = unstarted()
    assert cluster.max_model_len > 0
    assert cluster.cfg.model.max_model_len == cluster.max_model_len


def test_a_rerun_tells_the_oracle_what_is_left_to_generate() -> None:
    """Regression (review of session 64): a request re-run after a worker death has its
    streamed tokens in its prompt and max_tokens lowered by them, but the oracle still got the
    whole true length: 800 of 900 tokens streamed, admission reserved 800 more."""
    from tetri_server.messages import AddRequest

    async def main() -> None:
        cluster = unstarted()
        posted = serving(cluster, {0: "prefill", 1: "decode"})
        req = cluster.table.add([1, 2, 3], SamplingParams(max_tokens=4000), "", 900)
        req.output_ids = [5] * 800
        cluster.router.route(req)
        [add] = [m for m in posted[0] if isinstance(m, AddRequest)]
        assert (add.true_output_len, add.sampling.max_tokens) == (100, 3200)
        assert len(add.prompt_ids) == 803

    asyncio.run(main())


def test_a_parked_prompt_goes_to_an_elastic_decode_worker_once_it_has_room() -> None:
    """Regression (review of session 64): with no prefill worker serving and the decode
    worker full, a prompt was parked, and only a worker's Ready routed parked prompts again:
    once the decode worker had room it took later prompts while the parked one got a 503 at
    its deadline. The monitor tick routes parked prompts again."""
    from tetri_server.messages import AddRequest

    async def main() -> None:
        cluster = unstarted(None, "decode.local_prefill_tokens=1024")
        posted = serving(cluster, {0: "prefill", 1: "decode"})
        die(cluster, 0)
        cluster.monitor.on_report(cluster.workers[1], msgspec.structs.replace(
            idle_report(1, "decode"), num_free_blocks=2))
        req = cluster.table.add(list(range(1, 200)), SamplingParams(max_tokens=4), "", None)
        cluster.router.route(req)
        assert req in cluster.table.parked
        cluster.monitor.on_report(cluster.workers[1], idle_report(1, "decode"))  # room now
        cluster.monitor.check_stalls = lambda now: None  # type: ignore[method-assign]
        cluster.supervisor.abandon_stuck = lambda now: None  # type: ignore[method-assign]
        cluster._on_tick()
        cluster._tick.cancel()
        assert req.owner == 1 and not cluster.table.parked
        assert any(isinstance(m, AddRequest) and m.req_id == req.wire_id for m in posted[1])

    asyncio.run(main())


def test_a_new_prefill_worker_has_the_decode_view_before_its_first_prompt() -> None:
    """Regression (review of session 64): a worker that became a prefill worker (flip,
    restart) got its first decode view at the next tick, but the parked prompts at once; with
    no view it kept (elastic) every request it prefilled meanwhile, for good."""
    from tetri_server.messages import AddRequest, DecodeView, PoolHandle, Ready

    async def main() -> None:
        cluster = unstarted(None, "decode.local_prefill_tokens=0")  # parked, not routed
        posted = serving(cluster, {0: "prefill", 1: "decode"})
        die(cluster, 0)
        req = cluster.table.add([1, 2, 3], SamplingParams(), "", None)
        cluster.router.route(req)
        assert req in cluster.table.parked
        h = cluster.workers[0]
        h.alive = h.is_ready = True
        h.ready, h.generation = asyncio.get_running_loop().create_future(), 1
        h.ready.set_result(None)
        cluster._broadcast_pools = lambda: None  # type: ignore[method-assign]
        pool = PoolHandle(0, "shm", "x", 2, 64, 16, 4, 8, "float32")
        cluster._on_ready(h, Ready(0, "prefill", pool, 64, 1))  # type: ignore[arg-type]
        kinds = [type(m) for m in posted[0]]
        assert DecodeView in kinds and AddRequest in kinds
        assert kinds.index(DecodeView) < kinds.index(AddRequest)

    asyncio.run(main())


def test_a_model_with_another_tokenizer_than_the_predictors_is_named(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """Review of session 64: the shipped predictor counts lengths in the project tokenizer's
    tokens; a model with another tokenizer got buckets in other units, and nothing said so."""
    from tetri_server.control.cluster import predictor_tokenizer_mismatch
    from tetri_server.modelinfo import resolve_model_path

    same = resolve_model_path("builtin:tiny")  # the project tokenizer
    assert predictor_tokenizer_mismatch(same, None) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    why = predictor_tokenizer_mismatch(tmp_path, "arena_g400")
    assert why is not None and "arena_g400" in why and "retrain" in why


def test_gpus_without_peer_access_are_refused_at_start(monkeypatch) -> None:  # noqa: ANN001
    """Regression (review of session 64): a decode worker on a GPU that cannot map the
    prefill worker's GPU (no peer access, as on many consumer boards) refused every hand-off,
    and each request was dispatched again until it timed out. Now the server does not start,
    and says why; one GPU, or GPUs with peer access, start as before. (The query runs in a
    child process, so that the control process sets no CUDA context up.)"""
    import pytest

    from tetri_server.config import ConfigError
    from tetri_server.control import supervisor as sup

    assert sup._gpus_without_peer_access([3]) == []  # the child's query runs (no pair here)
    # on this CPU torch the query of two GPUs fails: a warning, not a crash at start
    assert sup._gpus_without_peer_access([0, 1]) == []
    asked: list[list[int]] = []

    def none_reach(ids: list[int]) -> list[tuple[int, int]]:
        asked.append(ids)
        return [(a, b) for a in ids for b in ids if a != b]

    monkeypatch.setattr(sup, "_num_cuda_devices", lambda: 2)
    monkeypatch.setattr(sup, "_gpus_without_peer_access", none_reach)
    gpu = ("cluster.device=cuda", "model.dtype=float32")
    with pytest.raises(ConfigError, match="GPU 1 cannot map GPU 0's memory"):
        unstarted(None, *gpu)
    assert asked == [[0, 1]]
    unstarted(None, *gpu, "cluster.mode=coupled")  # no hand-offs
    monkeypatch.setattr(sup, "_num_cuda_devices", lambda: 1)
    unstarted(None, *gpu)
    assert len(asked) == 1  # one GPU: nothing to ask
    monkeypatch.setattr(sup, "_num_cuda_devices", lambda: 2)
    monkeypatch.setattr(sup, "_gpus_without_peer_access", lambda ids: [])
    unstarted(None, *gpu)


def test_requests_left_at_the_end_of_a_drain_get_a_retryable_error() -> None:
    """Regression (review of session 64): a request still in flight when the shutdown's drain
    bound ran out got a 500, while one that arrived during the drain got a 503 with
    Retry-After; both may succeed on a retry (the restarted server, another replica)."""
    import asyncio

    from tetri_server.control.protocol import WorkerUnavailableError
    from tetri_server.messages import SamplingParams

    async def scenario() -> object:
        cluster = unstarted()

        async def shutdown() -> None:
            pass

        cluster.supervisor.shutdown = shutdown  # type: ignore[method-assign]
        req = cluster.table.add([1, 2, 3], SamplingParams(), "", None)
        await cluster.stop(drain_timeout_s=0)
        return req.queue.get_nowait()

    error = asyncio.run(scenario())
    assert isinstance(error, WorkerUnavailableError) and "shutting down" in str(error)


def test_a_decode_worker_coming_up_is_in_the_prefill_workers_view_at_once() -> None:
    """Regression (review of session 64): the decode view went out on a prefill worker's
    Ready only. At start, a prefill worker ready before the decode workers had a view without
    them until the first tick; a decode worker restarted was left out until the next tick
    too. Meanwhile dispatch held every request, and elastic kept each for good."""
    from tetri_server.messages import DecodeView, PoolHandle, Ready

    async def main() -> None:
        cluster = unstarted()
        posted = serving(cluster, {0: "prefill", 1: "decode"})
        del cluster.monitor.reports[1]  # worker 1 has not come up yet
        cluster.broadcast_view()
        assert [d.worker_id for d in posted[0][-1].decodes] == []
        h = cluster.workers[1]
        h.ready, h.generation = asyncio.get_running_loop().create_future(), 0
        cluster._broadcast_pools = lambda: None  # type: ignore[method-assign]
        pool = PoolHandle(1, "shm", "x", 2, 64, 16, 4, 8, "float32")
        cluster._on_ready(h, Ready(1, "decode", pool, 0, 1))  # type: ignore[arg-type]
        views = [m for m in posted[0] if isinstance(m, DecodeView)]
        assert [d.worker_id for d in views[-1].decodes] == [1]

    asyncio.run(main())

"""Golden decision trace of the disaggregated roles: a fixed arrival trace through a real
``PrefillRole`` and two real ``DecodeRole``s over fake workers (real block allocators and KV
managers, a fake runner, messages passed in-process the way control forwards them). Chunks,
dispatches, admissions and preemptions must equal ``tests/golden/decisions-disaggregated.jsonl``;
regenerate on purpose with ``TETRI_UPDATE_GOLDEN=1``."""

from __future__ import annotations

import json
import os
import random
from pathlib import Path

import torch

from tests.unit.test_decision_trace import FakeRunner
from tetri_server.config import load_config
from tetri_server.engine.stops import split_prompt_parts
from tetri_server.kv.blocks import BlockAllocator
from tetri_server.kv.manager import KVCacheManager
from tetri_server.messages import (
    AddRequest,
    Handoff,
    HandoffRejected,
    KVPulled,
    SamplingParams,
    StepOutput,
    TokenDelta,
)
from tetri_server.predictor import load_predictor
from tetri_server.sim.cluster import decode_view
from tetri_server.workers.decode import DecodeRole
from tetri_server.workers.prefill import PrefillRole
from tetri_server.workers.trace import DecisionLog

GOLDEN = Path(__file__).resolve().parent.parent / "golden" / "decisions-disaggregated.jsonl"


class FakeSpec:
    eos_token_ids: tuple[int, ...] = ()


class FakeTransport:
    def copy_blocks(self, src_worker: int, src_ids: list[int], dst_ids: list[int],
                    num_tokens: int) -> None:
        """The fake runner ignores KV: nothing to copy."""


class FakeWorker:
    """What a role uses of its worker runtime; ``sent`` collects its outgoing messages."""

    def __init__(self, worker_id: int, num_blocks: int, lines: list[str]) -> None:
        self.worker_id = worker_id
        self.cfg = load_config(None, ["prefill.chunk_size=128", "predictor.kind=none",
                                      "decode.policy=greedy", "decode.max_batch=8",
                                      "dispatch.policy=power-of-two",
                                      # every request here hands off (test_sim_golden_disagg
                                      # replays the same trace with no elastic rules)
                                      "prefill.local_finish_tokens=0"])
        self.block_size = 16
        self.allocator = BlockAllocator(num_blocks)
        self.kv = KVCacheManager(self.allocator, torch.zeros(1, 2, 1, num_blocks * 16, 1), 16)
        self.runner = FakeRunner()
        self.transport = FakeTransport()
        self.model_spec = FakeSpec()
        self.max_model_len = 2048
        self.device = torch.device("cpu")
        self.busy_s = 0.0
        self.pending_role: str | None = None  # no flip under way
        self.decisions = DecisionLog(lambda line: lines.append(f"w{worker_id} {line.rstrip()}"))
        self.sent: list[object] = []

    def send(self, msg: object) -> None:
        self.sent.append(msg)

    def send_deltas(self, deltas: list[TokenDelta]) -> None:
        """As ``Worker.send_deltas``, with a 4 MiB ring."""
        for group in split_prompt_parts(deltas, (4 << 20) // 4):
            self.send(StepOutput(self.worker_id, group))

    def predictor(self):  # noqa: ANN201 - the role's predictor
        return load_predictor("none", None)


def replay() -> list[str]:
    lines: list[str] = []
    pw = FakeWorker(0, 64, lines)
    dws = [FakeWorker(1, 48, lines), FakeWorker(2, 48, lines)]
    prefill = PrefillRole(pw)  # type: ignore[arg-type]
    decodes = [DecodeRole(w) for w in dws]  # type: ignore[arg-type]
    rng = random.Random(2401)
    pending = []
    step = 0
    for req_id in range(30):
        step += rng.choice((0, 1, 2, 4))
        pending.append((step, req_id, rng.choice((5, 40, 120, 300)), rng.randint(1, 80)))
    seq = 0
    step = 0
    while pending or not prefill.is_drained() or any(d.has_work() for d in decodes):
        while pending and pending[0][0] <= step:
            _, req_id, n, out = pending.pop(0)
            prefill.handle(AddRequest(req_id, [5 + (req_id + i) % 90 for i in range(n)],
                                      SamplingParams(max_tokens=out, temperature=0.0,
                                                     ignore_eos=True), float(step)))
        if step % 3 == 0:  # the monitor's broadcast, from the decode workers' reports
            seq += 1
            prefill.handle(decode_view(seq, [d.load_report() for d in decodes]))
        if prefill.has_work():
            prefill.step()
        for msg in pw.sent:  # control forwards hand-offs; acks go back
            if isinstance(msg, Handoff):
                d = decodes[msg.dst_worker - 1]
                d.handle(msg)
        pw.sent.clear()
        for d, w in zip(decodes, dws, strict=True):
            for msg in w.sent:
                if isinstance(msg, KVPulled | HandoffRejected):
                    prefill.handle(msg)
            w.sent.clear()
            if d.has_work():
                d.step()
        step += 1
        assert step < 5000, "the trace did not finish"
    assert all(w.allocator.num_free == w.allocator.num_blocks for w in (pw, *dws))
    return lines


def test_the_disaggregated_roles_decide_as_the_golden_trace_says():
    got = replay()
    if os.environ.get("TETRI_UPDATE_GOLDEN"):
        GOLDEN.write_text("".join(line + "\n" for line in got))
    want = GOLDEN.read_text().splitlines()
    kinds = {json.loads(line.split(" ", 1)[1])["kind"] for line in got}
    assert kinds >= {"chunk", "dispatch", "decode_step"}
    for i, (g, w) in enumerate(zip(got, want, strict=False)):
        assert g == w, f"decision {i} differs:\n got  {g}\n want {w}"
    assert len(got) == len(want)


def test_decode_waiting_kv_first_reaches_the_decode_worker() -> None:
    """``decode.waiting_kv_first`` (new key): a decode worker's admission takes it from the
    config; a prefill worker's kept requests never drop a waiting one's KV whatever it says."""
    for on in (True, False):
        w = FakeWorker(1, 48, [])
        w.cfg = load_config(None, ["prefill.chunk_size=128",
                                   f"decode.waiting_kv_first={str(on).lower()}"])
        assert DecodeRole(w).admission.waiting_kv_first is on  # type: ignore[arg-type]
        assert PrefillRole(w).admission.waiting_kv_first is False  # type: ignore[arg-type]


def test_a_prefill_workers_kept_requests_are_estimated_in_its_predictors_buckets() -> None:
    """Regression (session 66 review): a prefill worker's admission of its kept requests
    took the default granularity of 200 whatever the artifact (a g100 one: a bucket-3
    request estimated at 600 tokens, not 300), and so did the simulator's."""
    from tests.unit.test_sim_golden_disagg import LockStep
    from tetri_server.sim.cluster import SimConfig
    from tetri_server.sim.disaggregated import PrefillInstance

    w = FakeWorker(0, 48, [])
    w.predictor = lambda: load_predictor("classifier", "arena_g100")  # type: ignore[method-assign]
    assert PrefillRole(w).admission.granularity == 100  # type: ignore[arg-type]
    sim = LockStep(SimConfig(mode="disaggregated", granularity=100))
    assert PrefillInstance(sim, 0, 64).admission.granularity == 100


def test_a_prefill_worker_reports_its_kept_requests_preemptions_and_kv_drops() -> None:
    """Regression (review of session 50): a prefill worker's load report carried neither the
    preemptions of the requests it keeps nor the KV it drops from waiting ones (with nothing
    running, a head of its queue that does not fit takes their blocks), so neither reached
    /metrics."""
    w = FakeWorker(0, 48, [])
    role = PrefillRole(w)  # type: ignore[arg-type]
    adm = role.admission
    adm.add(1, 751, 752, 0, 500)  # 47 of the 48 blocks
    adm.on_done(adm.plan(1), set())  # 753 tokens: the next step needs a 48th block
    plan = adm.plan(0)
    assert plan.preempt.req_ids == (1,)
    adm.on_done(plan, set())
    adm.add(2, 15, 16, 0, 500)  # 1 block held, waiting behind the preempted head
    plan = adm.plan(47)  # the head needs all 48: 2's block goes
    assert plan.preempt.req_ids == (2,)
    adm.on_done(plan, set())
    report = role.load_report()
    assert (report.num_preemptions, report.num_kv_drops) == (1, 1)


def test_a_prompt_chunk_alone_leaves_the_kept_rows_their_next_blocks() -> None:
    """Regression (review of session 64): with prefill.local_decode_prompt_first, a chunk of
    prompt alone planned its blocks as if the kept requests would not grow: an 80-token prompt
    took the last free blocks of an 8-block pool, and the next step preempted the kept request
    whose next token needed a new block (its 48 tokens of KV computed again)."""
    from tetri_server.messages import AddRequest, DecodeInstanceView, DecodeView, SamplingParams
    from tetri_server.policy.prefill_book import Stage

    lines: list[dict[str, object]] = []
    pw = FakeWorker(0, 8, [])
    pw.cfg = load_config(None, [
        "prefill.chunk_size=128", "predictor.kind=none", "decode.policy=greedy",
        "prefill.local_finish_tokens=0", "prefill.local_decode_prompt_first=true",
        "prefill.local_decode_min_tokens=0"])
    pw.decisions = DecisionLog(lambda line: lines.append(json.loads(line)))
    role = PrefillRole(pw)  # type: ignore[arg-type]
    params = SamplingParams(max_tokens=500, temperature=0.0, ignore_eos=True)
    role.handle(AddRequest(1, list(range(5, 52)), params, 0.0))  # no view yet: kept
    while 1 not in role.book.ids(Stage.DECODING):
        role.step()
    role.handle(DecodeView(1, [DecodeInstanceView(1, 0, 48, 0, 1, 0, 0, 0.0, 0.0)], 1))  # full
    role.step()  # the kept request: 49 tokens in 3 blocks, its next one needs a fourth
    role.handle(AddRequest(2, list(range(5, 85)), params, 0.0))  # 5 blocks; 5 free
    # every step runs: with no room for the prompt beside them, the kept rows run (review
    # of session 65: the step found no chunk and waited, idle, up to a report interval)
    assert all([role.step() for _ in range(4)])
    assert not [d for d in lines if d.get("preempt")]
    assert role.book.get(1).num_tokens > 49  # it decoded on, never recomputed

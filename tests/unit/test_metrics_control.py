"""What the control process adds to the metrics (``RequestAccounting``, roles, flips): the
numbers a dashboard user reads are the ones the requests had."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from tetri_server.config import load_config
from tetri_server.control.accounting import RequestAccounting, block_bytes
from tetri_server.control.monitor import Monitor
from tetri_server.control.requests import Request
from tetri_server.messages import Handoff, LoadReport, PoolHandle, SamplingParams, TokenDelta
from tetri_server.metrics import Metrics

POOL = PoolHandle(worker_id=0, transport="shm", name="x", num_layers=2, num_blocks=64,
                  block_size=16, num_kv_heads=4, head_dim=8, dtype="float32")


def _samples(m: Metrics) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            labels = {k: v for k, v in s.labels.items() if k != "model_name"}
            out[(s.name, tuple(sorted(labels.items())))] = s.value
    return out


def _request(req_id: int, arrival_s: float) -> Request:
    return Request(req_id, [5] * 10, SamplingParams(max_tokens=300), "", None,
                   arrival_s=arrival_s)


def _handoff(req: Request, num_blocks: int, bucket: int) -> Handoff:
    return Handoff(req.req_id, 0, list(range(num_blocks)), req.prompt_ids + [7],
                   len(req.prompt_ids), req.params, bucket, bucket * 200, req.arrival_s)


def _run(acc: RequestAccounting, req: Request, times_s: list[float], reason: str) -> None:
    """One token at each time; the last delta finishes the request."""
    for i, t in enumerate(times_s):
        last = i == len(times_s) - 1
        d = TokenDelta(req.req_id, [9], finish_reason=reason if last else None)
        req.output_ids.extend(d.token_ids)
        acc.on_delta(req, d, t)


def test_queue_prefill_and_decode_time_come_from_first_and_last_token() -> None:
    m = Metrics("m")
    acc = RequestAccounting(load_config(None, []), m)
    a, b = _request(0, arrival_s=10.0), _request(1, arrival_s=20.0)
    _run(acc, a, [10.5, 11.0, 12.5], "length")  # 0.5 s to the first token, 2 s of decode
    _run(acc, b, [21.0, 21.5], "stop")
    c = _request(2, arrival_s=30.0)
    _run(acc, c, [30.2, 30.4], "abort")  # aborted: no finished-request times
    s = _samples(m)
    assert s[("tetri_request_queue_prefill_time_seconds_count", ())] == 2
    assert s[("tetri_request_queue_prefill_time_seconds_sum", ())] == 1.5
    assert s[("tetri_request_decode_time_seconds_count", ())] == 2
    assert s[("tetri_request_decode_time_seconds_sum", ())] == 2.5


def test_queue_and_prefill_time_split_at_the_workers_scheduled_stamp() -> None:
    m = Metrics("m")
    acc = RequestAccounting(load_config(None, []), m)
    a = _request(0, arrival_s=10.0)
    for t, first in ((10.5, TokenDelta(0, [9], scheduled_s=10.2)),
                     (11.0, TokenDelta(0, [9], finish_reason="stop", scheduled_s=99.0))):
        a.output_ids.extend(first.token_ids)
        acc.on_delta(a, first, t)  # the second stamp is ignored: only the first delta counts
    _run(acc, _request(1, arrival_s=0.0), [1.0, 2.0], "stop")  # no stamp: no split
    s = _samples(m)
    assert s[("tetri_request_queue_time_seconds_count", ())] == 1
    assert abs(s[("tetri_request_queue_time_seconds_sum", ())] - 0.2) < 1e-9
    assert abs(s[("tetri_request_prefill_time_seconds_sum", ())] - 0.3) < 1e-9
    assert s[("tetri_request_queue_prefill_time_seconds_count", ())] == 2


def test_a_bucket_on_the_first_delta_is_judged_without_a_handoff() -> None:
    """Requests a prefill worker finishes or decodes itself (elastic) never hand off."""
    m = Metrics("m")
    acc = RequestAccounting(load_config(None, []), m)
    req = _request(0, arrival_s=0.0)
    first = TokenDelta(0, [9], predicted_bucket=0)
    req.output_ids.extend(first.token_ids)
    acc.on_delta(req, first, 1.0)
    _run(acc, req, [1.1], "stop")
    s = _samples(m)
    assert s[("tetri_predictor_outcomes_total", (("finished_reason", "stop"),
                                                 ("outcome", "exact")))] == 1


def test_predictor_outcomes_compare_the_handed_off_bucket_with_the_true_length() -> None:
    m = Metrics("m")
    acc = RequestAccounting(load_config(None, []), m)
    g = acc.buckets.granularity
    cases = [(0, g // 2, "stop"), (0, g + 1, "stop"), (2, g + 1, "length"), (1, g, "length")]
    for i, (bucket, length, reason) in enumerate(cases):
        req = _request(i, arrival_s=0.0)
        acc.on_handoff(req, _handoff(req, num_blocks=3, bucket=bucket), POOL)
        acc.on_pulled(req)  # the bytes count once the decode worker has them
        _run(acc, req, [1.0 + k * 0.01 for k in range(length)], reason)
    coupled = _request(9, arrival_s=0.0)  # never handed off: no prediction to judge
    _run(acc, coupled, [1.0, 1.1], "stop")
    s = _samples(m)

    def outcome(o: str, r: str) -> float:
        return s[("tetri_predictor_outcomes_total", (("finished_reason", r), ("outcome", o)))]

    assert outcome("exact", "stop") == 1 and outcome("under", "stop") == 1
    assert outcome("over", "length") == 1 and outcome("exact", "length") == 1
    assert outcome("over", "stop") == 0 and outcome("under", "length") == 0
    key = (("actual_bucket", "1"), ("finished_reason", "length"), ("predicted_bucket", "2"))
    assert s[("tetri_predictor_buckets_total", key)] == 1
    # every hand-off moved 3 whole blocks of POOL
    assert s[("tetri_handoff_bytes_total", ())] == 4 * 3 * block_bytes(POOL)
    assert block_bytes(POOL) == 2 * 2 * 4 * 16 * 8 * 4


def test_roles_show_the_current_role_only_and_flips_count_with_durations() -> None:
    m = Metrics("m")
    s = _samples(m)
    assert s[("tetri_flips_total", (("from_role", "prefill"), ("to_role", "decode")))] == 0
    m.set_role(0, "prefill")
    m.set_role(1, "prefill")
    m.set_role(1, "decode")  # flipped
    m.observe_flip("prefill", "decode", total_s=2.0, switch_s=0.25)
    s = _samples(m)
    role = {(w, r): s[("tetri_worker_role", (("role", r), ("worker", w)))]
            for w in "01" for r in ("prefill", "decode", "coupled")}
    assert role == {("0", "prefill"): 1, ("0", "decode"): 0, ("0", "coupled"): 0,
                    ("1", "prefill"): 0, ("1", "decode"): 1, ("1", "coupled"): 0}
    assert s[("tetri_flips_total", (("from_role", "prefill"), ("to_role", "decode")))] == 1
    assert s[("tetri_flip_seconds_sum", (("part", "total"),))] == 2.0
    assert s[("tetri_flip_seconds_sum", (("part", "switch"),))] == 0.25


def test_a_flipped_worker_drops_the_gauges_of_its_old_role() -> None:
    """A decode worker's recent step and a prefill worker's chunk describe that role only:
    after a flip /metrics no longer shows the old role's last value for that worker."""
    m = Metrics("m")
    m.set_role(0, "prefill")
    m.set_chunk_size(0, 256)
    m.set_role(1, "decode")
    m.set_worker(1, "decode", blocks_used=0, blocks_total=64, busy_s=1.0, step_s=0.02)
    step, chunk = ("tetri_decode_step_seconds", (("worker", "1"),)), (
        "tetri_prefill_chunk_size", (("worker", "0"),))
    assert _samples(m)[step] == 0.02 and _samples(m)[chunk] == 256
    m.set_role(1, "prefill")  # both flipped
    m.set_role(0, "decode")
    assert step not in _samples(m) and chunk not in _samples(m)
    m.set_role(0, "decode")  # again, with nothing to drop
    m.set_role(1, "prefill")
    m.set_chunk_size(1, 128)
    assert _samples(m)[("tetri_prefill_chunk_size", (("worker", "1"),))] == 128


def test_a_dead_worker_shows_no_kv_in_use_and_no_recent_step() -> None:
    """Regression: a dead worker's KV usage and decode step kept its last report's values until
    a restart reported (forever with restarts off): saturation alerts read stale load."""
    m = Metrics("m", vllm_aliases=True)
    m.set_worker(1, "decode", blocks_used=48, blocks_total=64, busy_s=1.0, step_s=0.02)
    m.set_up(1, False)
    got = _samples(m)
    assert got[("tetri_kv_cache_usage_perc", (("worker", "1"),))] == 0.0
    assert got[("tetri_kv_blocks_used", (("worker", "1"),))] == 0.0
    assert ("tetri_decode_step_seconds", (("worker", "1"),)) not in got
    assert got[("tetri_worker_up", (("worker", "1"),))] == 0.0


def test_itl_counts_every_token_after_the_first_and_kv_usage_stays_in_0_1() -> None:
    m = Metrics("m")
    lengths = [1, 4, 7]
    for n in lengths:
        m.observe_tokens(1, None)  # the first token: its wait is the TTFT
        for _ in range(n - 1):
            m.observe_tokens(1, 0.01)
    m.observe_tokens(3, 0.03)  # a delta of 3 tokens: 3 gaps of 0.01 s
    m.set_worker(0, "decode", blocks_used=0, blocks_total=10, busy_s=0.0)
    m.set_worker(1, "decode", blocks_used=10, blocks_total=10, busy_s=0.0)
    m.set_worker(2, "prefill", blocks_used=0, blocks_total=0, busy_s=0.0)  # no pool yet
    s = _samples(m)
    assert s[("tetri_generation_tokens_total", ())] == sum(lengths) + 3
    assert s[("tetri_inter_token_latency_seconds_count", ())] == sum(lengths) - len(lengths) + 3
    assert abs(s[("tetri_inter_token_latency_seconds_sum", ())] - 0.01 * (9 + 3)) < 1e-9
    usage = {w: s[("tetri_kv_cache_usage_perc", (("worker", w),))] for w in "012"}
    assert usage == {"0": 0.0, "1": 1.0, "2": 0.0}


def test_decode_queue_prefill_times_have_vllm_aliases_and_their_sum_does_not() -> None:
    text = Metrics("m", vllm_aliases=True).render().decode()
    for name in ("decode", "queue", "prefill"):
        assert f"vllm:request_{name}_time_seconds_count" in text
    assert "vllm:request_queue_prefill" not in text  # not vLLM's quantity: no vLLM name


def test_waiting_from_stale_reports_never_makes_running_negative() -> None:
    m = Metrics("m")
    monitor = Monitor(load_config(None, []), {}, set(), m)
    monitor.reports[0] = LoadReport(worker_id=0, role="prefill", num_waiting=3, num_running=0,
                                    num_queued_prompt_tokens=0, num_free_blocks=8,
                                    num_total_blocks=8, num_heavy=0, num_light=0,
                                    predicted_demand_blocks=0, busy_s=0.0)
    monitor.count_requests(1)  # the report counts two requests that finished since
    s = _samples(m)
    assert s[("tetri_num_requests_running", ())] == 0
    assert s[("tetri_num_requests_waiting", ())] == 1
    monitor.count_requests(5)
    s = _samples(m)
    assert (s[("tetri_num_requests_running", ())], s[("tetri_num_requests_waiting", ())]) == (2, 3)

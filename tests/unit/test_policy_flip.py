"""The instance flip rule over hand-made load report histories."""

from __future__ import annotations

from collections.abc import Callable

from tetri_server.messages import LoadReport
from tetri_server.policy import FlipPlan, FlipPolicy


def report(wid: int, role: str, busy_s: float, waiting: int = 0, running: int = 0) -> LoadReport:
    return LoadReport(wid, role, waiting, running, 0, 100, 100, 0, 0, 0, busy_s)


Util = Callable[[int, str], tuple[float, int]]  # (worker, role) -> (utilisation, waiting)


def cluster(roles: dict[int, str], util: Util) -> Callable[[float], list[LoadReport]]:
    """Reports at time t of workers busy a fixed fraction of wall time since t = 0."""

    def at(t_s: float) -> list[LoadReport]:
        out = []
        for wid, role in roles.items():
            frac, waiting = util(wid, role)
            out.append(report(wid, role, frac * t_s, waiting, running=1 if frac else 0))
        return out

    return at


def run(
    policy: FlipPolicy, at: Callable[[float], list[LoadReport]], until_s: float
) -> list[tuple[int, FlipPlan]]:
    """Feed a report every second; returns (t, plan) for every plan made."""
    plans = []
    for t in range(int(until_s) + 1):
        plan = policy.plan(at(float(t)), float(t))
        if plan is not None:
            plans.append((t, plan))
    return plans


def idle_prefill_busy_decode(wid: int, role: str) -> tuple[float, int]:
    if role == "decode":
        return 0.95, 3
    return (0.02, 0) if wid == 1 else (0.5, 0)


ROLES = {0: "prefill", 1: "prefill", 2: "decode"}


def test_an_idle_prefill_worker_flips_to_an_overloaded_decode_role_after_the_window() -> None:
    plans = run(FlipPolicy(window_s=60), cluster(ROLES, idle_prefill_busy_decode), 90)
    assert plans and plans[0][0] == 60  # not before a whole window of evidence
    assert plans[0][1] == FlipPlan(1, "prefill", "decode", plans[0][1].utilisation)
    assert plans[0][1].utilisation < 0.1
    assert len(plans) == 1  # one flip in flight at a time


def test_the_last_worker_of_a_role_never_flips() -> None:
    roles = {1: "prefill", 2: "decode", 3: "decode"}
    assert run(FlipPolicy(window_s=60), cluster(roles, idle_prefill_busy_decode), 120) == []


def test_no_flip_when_the_other_role_is_not_overloaded() -> None:
    def calm(wid: int, role: str) -> tuple[float, int]:
        return (0.3, 0) if role == "decode" else (0.0, 0)

    assert run(FlipPolicy(window_s=60), cluster(ROLES, calm), 120) == []


def test_no_flip_when_load_is_above_the_threshold() -> None:
    def busy_enough(wid: int, role: str) -> tuple[float, int]:
        return (0.95, 3) if role == "decode" else (0.15, 0)

    assert run(FlipPolicy(window_s=60), cluster(ROLES, busy_enough), 120) == []


def test_a_queue_on_the_other_role_counts_as_overload() -> None:
    def queued(wid: int, role: str) -> tuple[float, int]:
        return (0.4, 2) if role == "decode" else (0.0, 0)

    assert run(FlipPolicy(window_s=60), cluster(ROLES, queued), 60)[0][1].worker_id in (0, 1)


def test_cooldown_after_a_flip_and_the_window_restarts_in_the_new_role() -> None:
    policy = FlipPolicy(window_s=10, cooldown_s=30)
    roles = {0: "prefill", 1: "prefill", 2: "prefill", 3: "decode"}

    def util(wid: int, role: str) -> tuple[float, int]:
        return (0.95, 3) if role == "decode" else (0.01, 0)

    at = cluster(roles, util)
    first = run(policy, at, 10)
    assert [(t, p.worker_id) for t, p in first] == [(10, 0)]  # least utilised, then lowest id
    roles[0] = "decode"
    policy.on_done(first[0][1], 12.0)
    later = []
    for t in range(13, 60):
        plan = policy.plan(at(float(t)), float(t))
        if plan is not None:
            later.append((t, plan.worker_id))
            roles[plan.worker_id] = "decode"
            policy.on_done(plan, float(t))
    assert later == [(42, 1)]  # nothing until the cooldown ends at 42, then the next cooldown


def test_a_worker_that_stops_reporting_is_forgotten() -> None:
    policy = FlipPolicy(window_s=10)
    at = cluster(ROLES, idle_prefill_busy_decode)
    for t in range(9):
        policy.plan(at(float(t)), float(t))
    without_1 = [r for r in at(10.0) if r.worker_id != 1]
    assert policy.plan(without_1, 10.0) is None
    assert policy.plan(at(11.0), 11.0) is None  # worker 1 starts a fresh window


def test_a_blocked_worker_with_a_queue_is_not_taken_for_idle() -> None:
    """Regression (review of session 64): a prefill worker whose pool is full of KV waiting
    for a saturated decode side runs no step, so its busy seconds stay flat: it looked under
    10% used and was flipped, and its drain then had to push its whole queue (84 prompts)
    into the overloaded decode side (the server cancels such a drain after 90 s, and the rule
    picked it again after each cooldown). A worker with waiting requests is not a candidate."""
    policy = FlipPolicy(window_s=60, idle_window_s=60, low_util=0.1, cooldown_s=120)
    for i in range(700):
        t = i * 0.1
        assert policy.plan([report(0, "prefill", 0.0, waiting=84, running=22),
                            report(1, "prefill", t * 0.9, waiting=2, running=18),
                            report(2, "decode", t * 0.95, waiting=3, running=17)], t) is None
    calm = FlipPolicy(window_s=60, idle_window_s=60, low_util=0.1, cooldown_s=120)
    plans = [calm.plan([report(0, "prefill", t * 0.05, running=1),  # 5% used, no queue
                        report(1, "prefill", t * 0.9, waiting=2, running=18),
                        report(2, "decode", t * 0.95, waiting=3, running=17)], t)
             for t in (i * 0.1 for i in range(700))]
    assert any(p is not None and p.worker_id == 0 for p in plans)



def test_a_restarted_process_starts_a_new_window_and_a_long_step_does_not() -> None:
    """A worker's busy total counts from 0 in a restarted process: its window starts again
    (read across the restart, it was busy a negative share). A step longer than the time
    between two reports comes in all at once: the same window (review of session 65: a
    bound on the growth restarted a saturated CPU prefill worker's window at every step)."""
    policy = FlipPolicy(window_s=10, idle_window_s=10)
    roles = {0: "prefill", 1: "decode"}
    for t in range(0, 11):  # worker 1 busy 90% of the time
        policy.plan([report(0, roles[0], 0.0), report(1, roles[1], 0.9 * t, running=1)], t)
    assert policy._stats(1, 10.0).utilisation == 0.9 and policy._stats(1, 10.0).complete
    policy.plan([report(0, roles[0], 0.0), report(1, roles[1], 20.0, running=1)], 11.0)
    assert policy._stats(1, 11.0).complete  # 11 s of work reported late, at once: kept
    policy.plan([report(0, roles[0], 0.0), report(1, roles[1], 0.5, running=1)], 12.0)
    assert not policy._stats(1, 12.0).complete  # restarted: a new window

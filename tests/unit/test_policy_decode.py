"""Decode admission (level 2) driven by a fake runtime that owns a block pool."""

from __future__ import annotations

import random
from collections.abc import Collection

import pytest

from tetri_server.policy import DecodeAdmission, DecodeStepPlan, TetriDispatcher, num_blocks_for

BLOCK = 16


class FakeRuntime:
    """Executes plans against a pool of ``num_total_blocks`` the way a decode worker does, and
    fails the test if a plan ever needs more blocks than are free."""

    def __init__(self, policy: str, num_total_blocks: int, **kwargs: int) -> None:
        self.num_total_blocks = num_total_blocks
        self.adm = DecodeAdmission(
            policy,  # type: ignore[arg-type]
            block_size=BLOCK,
            num_total_blocks=num_total_blocks,
            **kwargs,  # type: ignore[arg-type]
        )
        self.tokens: dict[int, int] = {}
        self.held: dict[int, int] = {}

    @property
    def free(self) -> int:
        return self.num_total_blocks - sum(self.held.values())

    def add(self, rid: int, prompt: int, bucket: int, max_tokens: int = 4000, gen: int = 1) -> None:
        self.tokens[rid] = prompt + gen
        self.held[rid] = num_blocks_for(prompt + gen - 1, BLOCK)  # the pulled KV
        assert self.free >= 0
        self.adm.add(rid, prompt, prompt + gen, bucket, max_tokens)

    def step(self, finished: Collection[int] = ()) -> DecodeStepPlan:
        plan = self.adm.plan(self.free)
        for rid in plan.preempt.req_ids:
            self.held[rid] = 0
        for rid in plan.fail_ids:
            del self.held[rid], self.tokens[rid]
        for rid in plan.run_ids:
            self.held[rid] = num_blocks_for(self.tokens[rid], BLOCK)
            assert self.free >= 0, "plan overcommitted the pool"
        for rid in plan.run_ids:
            if rid in finished:
                del self.held[rid], self.tokens[rid]
            else:
                self.tokens[rid] += 1
        self.adm.on_done(plan, finished)
        return plan


def with_long_running_request(policy: str) -> FakeRuntime:
    rt = FakeRuntime(policy, 100)
    rt.add(1, prompt=160, bucket=5)  # predicted 1000 more tokens: reserves 73 blocks
    assert rt.step().admit.req_ids == (1,)
    rt.add(2, prompt=320, bucket=1)  # 33 blocks predicted, 20 already held
    return rt


def test_reserve_static_refuses_what_greedy_admits() -> None:
    assert with_long_running_request("greedy").step().admit.req_ids == (2,)
    static = with_long_running_request("reserve-static")
    for _ in range(5):
        plan = static.step()
        assert plan.admit.req_ids == () and plan.run_ids == (1,)
    assert static.step(finished={1}).run_ids == (1,)
    assert static.step().admit.req_ids == (2,)  # room again once the reservation is gone


def near_finish_then_big_newcomer(policy: str, remaining: int) -> FakeRuntime:
    rt = FakeRuntime(policy, 100)
    rt.add(1, prompt=800, bucket=1, max_tokens=1000, gen=200 - remaining)
    rt.step()
    rt.add(2, prompt=320, bucket=3)  # 600 predicted tokens: 38 more blocks
    return rt


def test_reserve_dynamic_admits_when_the_shortest_running_request_is_about_to_finish() -> None:
    assert near_finish_then_big_newcomer("reserve-static", 10).step().admit.req_ids == ()
    assert near_finish_then_big_newcomer("reserve-dynamic", 10).step().admit.req_ids == (2,)


def test_reserve_dynamic_refuses_when_the_pool_runs_out_before_anyone_finishes() -> None:
    rt = FakeRuntime("reserve-dynamic", 100)
    rt.add(1, prompt=800, bucket=5)  # 1000 predicted tokens: outgrows the pool on its own
    rt.step()
    rt.add(2, prompt=320, bucket=3)
    assert rt.step().admit.req_ids == ()


def test_reserve_policies_admit_into_an_empty_batch_even_if_predicted_too_big() -> None:
    rt = FakeRuntime("reserve-static", 20)
    rt.add(1, prompt=64, bucket=10)  # 2000 predicted tokens > 320-token pool
    assert rt.step().admit.req_ids == (1,)


def test_misprediction_raises_the_estimate_then_the_newest_is_preempted() -> None:
    rt = FakeRuntime("reserve-static", 20, granularity=50)  # 320 tokens of KV
    rt.add(1, prompt=64, bucket=1)  # predicted 50 tokens, both really run far longer
    rt.add(2, prompt=64, bucket=1)
    assert rt.step().admit.req_ids == (1, 2)
    for _ in range(49):
        rt.step()
    assert rt.adm.predicted_len(1) == 100  # reached 50: raised to the next bucket
    preempted: tuple[int, ...] = ()
    for _ in range(100):
        plan = rt.step()
        if plan.preempt.req_ids:
            preempted = plan.preempt.req_ids
            break
    assert preempted == (2,)  # admitted last, evicted first; 1 keeps running
    assert rt.held[2] == 0 and rt.adm.running_ids == (1,)
    assert rt.adm.load().num_preemptions == 1
    rt.step(finished={1})
    plan = rt.step()
    assert plan.admit.req_ids == (2,) and plan.admit.recompute_ids == (2,)


def test_a_context_that_outgrows_the_whole_pool_fails_instead_of_hanging() -> None:
    rt = FakeRuntime("greedy", 4, watermark=0)  # 64 tokens
    rt.add(1, prompt=48, bucket=0)
    plans = [rt.step() for _ in range(18)]
    assert plans[-2].preempt.req_ids == (1,)
    assert plans[-1].fail_ids == (1,) and 1 not in rt.adm


def test_max_batch_caps_the_running_batch() -> None:
    rt = FakeRuntime("greedy", 100, max_batch=2)
    for rid in range(3):
        rt.add(rid, prompt=16, bucket=0)
    assert rt.step().run_ids == (0, 1)
    assert rt.step(finished={0}).run_ids == (0, 1)
    assert rt.step().run_ids == (1, 2)


def test_a_refused_head_blocks_later_requests_fcfs() -> None:
    rt = with_long_running_request("reserve-static")
    rt.add(3, prompt=16, bucket=0)  # small enough, but not allowed to overtake
    assert rt.step().admit.req_ids == ()


def test_abort_removes_a_request_wherever_it_is() -> None:
    rt = with_long_running_request("reserve-static")
    plan = rt.adm.plan(rt.free)
    assert rt.adm.remove(1) and rt.adm.remove(2)
    rt.adm.on_done(plan, finished=())  # ids removed meanwhile are ignored
    assert rt.adm.plan(100).run_ids == () and not rt.adm.remove(1)


def test_load_counts_heavy_light_and_predicted_demand() -> None:
    rt = FakeRuntime("greedy", 100)
    rt.add(1, prompt=32, bucket=1)  # 200 predicted: heavy
    rt.add(2, prompt=32, bucket=0)  # 0 predicted: light
    load = rt.adm.load()
    assert (load.num_waiting, load.num_running, load.num_heavy, load.num_light) == (2, 0, 1, 1)
    held_1, full_1 = num_blocks_for(32, BLOCK), num_blocks_for(232, BLOCK)
    # 2 has generated a token, past bucket 0's lower end: its estimate is raised to 200 too
    assert load.predicted_demand_blocks == 2 * (full_1 - held_1)
    rt.step()
    load = rt.adm.load()
    assert load.num_running == 2
    assert (load.num_heavy, load.num_light) == (1, 1)  # a raised reservation is not "heavy"
    for _ in range(128):
        rt.step()
    assert rt.adm.load().num_heavy == 2  # 2 has now generated more than 128 tokens


def test_a_request_capped_below_the_threshold_is_light_as_the_dispatcher_counts_it() -> None:
    """Bucket 2 (400 tokens) with max_tokens 64 was dispatched as light but reported heavy."""
    rt = FakeRuntime("greedy", 100)
    rt.add(1, prompt=32, bucket=2, max_tokens=64)
    rt.add(2, prompt=32, bucket=2, max_tokens=400)
    load = rt.adm.load()
    assert (load.num_heavy, load.num_light) == (1, 1)
    dispatcher = TetriDispatcher(random.Random(0), block_size=BLOCK)
    assert not dispatcher.is_heavy(2, 64)


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError):
        DecodeAdmission("lazy", block_size=16, num_total_blocks=10)  # type: ignore[arg-type]
    adm = DecodeAdmission("greedy", block_size=16, num_total_blocks=10)
    with pytest.raises(ValueError):
        adm.add(1, 10, 10, 0, 16)  # the first output token must be counted


def test_an_empty_batch_admits_a_request_that_fits_below_the_watermark():
    """Regression: with nothing running, a request needing more than free - watermark blocks
    (but no more than the free blocks) was never admitted: the decode worker stalled."""
    from tetri_server.policy import DecodeAdmission

    adm = DecodeAdmission("greedy", block_size=16, num_total_blocks=100, granularity=200,
                          max_batch=8, watermark=0.05)
    adm.add(1, 16 * 99, 16 * 99 + 1, 0, 10)  # 99 full blocks + 1 token: 100 blocks, watermark 5
    plan = adm.plan(num_free_blocks=100)
    assert plan.run_ids == (1,)


def test_a_preempted_head_is_not_starved_by_the_kv_of_requests_waiting_behind_it() -> None:
    """Regression (a deadlock the golden trace found): nothing running, the head of the queue
    was preempted (it needs its whole context again) and the blocks it needs are held by
    requests waiting behind it (their KV is in the pool). Nothing was ever admitted. Now their
    KV is dropped, newest first, until the head fits; they keep their places."""
    from tetri_server.policy import DecodeAdmission

    adm = DecodeAdmission("greedy", block_size=16, num_total_blocks=10, max_batch=8,
                          watermark=0)
    adm.add(1, 111, 112, 0, 50)  # 7 blocks of KV held
    plan = adm.plan(num_free_blocks=0)
    assert plan.run_ids == (1,)
    adm.on_done(plan, set())  # 113 tokens now: the next step needs an 8th block
    plan = adm.plan(num_free_blocks=0)
    assert plan.preempt.req_ids == (1,) and plan.run_ids == ()
    adm.on_done(plan, set())
    adm.add(2, 30, 31, 0, 50)  # 2 blocks held, behind the preempted head
    plan = adm.plan(num_free_blocks=6)  # the head needs 8: only with 2's blocks
    assert plan.preempt.req_ids == (2,)
    assert plan.run_ids == (1,) and plan.admit.recompute_ids == (1,)
    adm.on_done(plan, set())
    assert adm.running_ids == (1,) and len(adm) == 2


def test_a_bucket_0_request_is_not_counted_as_finishing_before_it_decodes() -> None:
    """Regression (over-admission): bucket 0's estimate (its lower end, 0 tokens) was kept at
    add although the request had already generated its first token, which the estimate's own
    rule raises at once; reserve-dynamic then counted its prompt blocks as freed at the first
    step and admitted a request the pool could not grow into."""
    rt = FakeRuntime("reserve-dynamic", 40)
    rt.add(1, prompt=160, bucket=0)  # holds 10 blocks
    assert rt.adm.predicted_len(1) == 200  # raised: it has generated one token already
    assert rt.step().admit.req_ids == (1,)
    rt.add(2, prompt=160, bucket=2)  # 10 held; 400 more tokens: 25 blocks in all
    assert rt.step().admit.req_ids == ()  # 1 grows 13 blocks past its prompt: no room for 2


def test_preempted_requests_go_back_oldest_admission_first() -> None:
    """Regression: victims re-entered the queue newest first (the comment said oldest), so on
    their re-admission the older one was again the newest, and preempted first again."""
    from tetri_server.policy.decode import AdmitPlan, PreemptPlan

    adm = DecodeAdmission("greedy", block_size=BLOCK, num_total_blocks=100)
    for rid in (1, 2, 3):
        adm.add(rid, 32, 33, 0, 1000)
    first = adm.plan(100)
    assert first.admit.req_ids == (1, 2, 3)
    adm.on_done(first, ())
    # a step that preempts two, newest admission first (as plan() lists them)
    adm.on_done(DecodeStepPlan(PreemptPlan((3, 2)), AdmitPlan(), run_ids=(1,)), ())
    assert adm.running_ids == (1,)
    again = adm.plan(100)
    assert again.admit.req_ids == (2, 3)  # 2 was admitted before 3, and is again
    adm.on_done(again, ())
    assert adm.running_ids == (1, 2, 3)


@pytest.mark.parametrize("chunked", [False, True])
def test_a_new_prompt_does_not_take_the_blocks_a_preempted_request_waits_for(
        chunked: bool) -> None:
    """Regression: a coupled worker prefilled new prompts into the blocks a preempted request
    (back at the head of its queue) needed; they then waited behind it holding their KV, and
    under memory pressure the batch shrank to one or none. Like vLLM, a prompt now starts only
    in blocks the waiting head does not need."""
    from tetri_server.policy import PrefillQueue
    from tetri_server.policy.coupled import coupled_step_plan

    adm = DecodeAdmission("greedy", block_size=16, num_total_blocks=20, max_batch=8,
                          watermark=0)
    adm.add(1, 111, 112, 0, 50)  # 7 blocks of KV each; 112 tokens fill them
    adm.add(2, 111, 112, 0, 50)
    plan = adm.plan(num_free_blocks=6)
    assert plan.run_ids == (1, 2)
    adm.on_done(plan, set())  # 113 tokens: each needs an 8th block
    plan = adm.plan(num_free_blocks=1)
    assert plan.preempt.req_ids == (2,) and plan.run_ids == (1,)
    adm.on_done(plan, set())
    queue = PrefillQueue("fcfs")
    queue.add(3, 60, 0.0)  # 4 blocks
    # 7 free: too few for 2 (8), room for 3 beside 1's step: 3 must not take them
    _, slices = coupled_step_plan(queue, adm, 7, chunked=chunked, token_budget=256,
                                  max_batch=8, max_prefill_tokens=2048, block_size=16)
    assert not slices
    # room for 2, 1's step and 3: it starts
    _, slices = coupled_step_plan(queue, adm, 8 + 1 + 4, chunked=chunked, token_budget=256,
                                  max_batch=8, max_prefill_tokens=2048, block_size=16)
    assert [p.req_id for p in slices] == [3]
    assert adm.head_need() == 8  # 2's whole context again


def test_a_recompute_after_a_preemption_is_spread_over_steps_beside_the_batch() -> None:
    """Regression (inter-token gap spike): a preempted request was recomputed whole in the step
    that re-admitted it, so every other row of that step waited for a prefill of its whole
    context. With ``recompute_chunk`` it computes at most that many tokens a step (the batch
    runs each of them), takes its whole context's blocks at once, and gains its next token
    only in the step that computes its last one."""
    adm = DecodeAdmission("greedy", block_size=16, num_total_blocks=20, max_batch=8,
                          watermark=0, recompute_chunk=40)
    adm.add(1, 111, 112, 0, 500)  # 7 blocks of KV each; 112 tokens fill them
    adm.add(2, 111, 112, 0, 500)
    plan = adm.plan(num_free_blocks=6)
    assert plan.run_ids == (1, 2) and plan.recompute == () and plan.num_tokens == 2
    adm.on_done(plan, set())  # 113 tokens each: an 8th block each, one is free
    plan = adm.plan(num_free_blocks=1)
    assert plan.preempt.req_ids == (2,) and plan.run_ids == (1,)
    adm.on_done(plan, set())
    plan = adm.plan(num_free_blocks=12)  # 1 holds 8 of the 20, and needs no 9th before 128
    assert plan.admit.recompute_ids == (2,) and plan.run_ids == (1, 2)
    assert plan.recompute == ((2, 40, 113),) and plan.num_tokens == 41
    assert plan.row_tokens(1) == 1 and plan.row_tokens(2) == 40 and plan.lacking(1) == 1
    steps = [plan]
    adm.on_done(plan, set())
    for _ in range(3):
        plan = adm.plan(num_free_blocks=0)  # 2 took its whole context's blocks: needs none
        steps.append(plan)
        assert plan.run_ids == (1, 2)
        adm.on_done(plan, set())
    # 113 tokens in 40 + 40 + 33: two steps without a token, then 2 decodes again
    assert [p.recompute_tokens for p in steps] == [[[2, 40]], [[2, 40]], [[2, 33]], []]
    assert [s.num_tokens for s in adm._running.values()] == [118, 115]  # 2: one token since


def test_a_recompute_chunk_is_shared_in_admission_order_and_holds_back_a_second_one() -> None:
    """The step's recompute tokens are a budget over the batch: the oldest admission takes
    what it lacks first; a waiting request that must recompute starts only when some of the
    budget is left, and a decode row always runs."""
    adm = DecodeAdmission("greedy", block_size=16, num_total_blocks=40, max_batch=8,
                          watermark=0, recompute_chunk=50)
    for rid in (1, 2, 3):
        adm.add(rid, 31, 32, 0, 500)  # 2 blocks each
    plan = adm.plan(40)
    adm.on_done(plan, set())
    from tetri_server.policy.decode import AdmitPlan, PreemptPlan

    adm.on_done(DecodeStepPlan(PreemptPlan((3, 2)), AdmitPlan(), run_ids=(1,)), ())
    plan = adm.plan(40)
    # 2 lacks 33 tokens, 3 lacks 33: 2 takes 33, 3 the 17 left
    assert plan.run_ids == (1, 2, 3) and plan.recompute == ((2, 33, 33), (3, 17, 33))
    adm.on_done(plan, set())
    plan = adm.plan(40)
    assert plan.run_ids == (1, 2, 3) and plan.recompute == ((3, 16, 16),)  # 2 decodes, 3 ends
    adm.on_done(plan, set())
    plan = adm.plan(40, recompute_room=0)  # a step's room lowers the chunk (at least 1)
    assert plan.recompute == ()
    small = DecodeAdmission("greedy", block_size=16, num_total_blocks=40, max_batch=8,
                            watermark=0, recompute_chunk=20)
    for rid in (1, 2):
        small.add(rid, 31, 32, 0, 500)
    small.on_done(small.plan(40), set())
    small.on_done(DecodeStepPlan(PreemptPlan((2, 1)), AdmitPlan(), run_ids=()), ())
    plan = small.plan(40)  # 1 takes the whole budget: 2 waits for a step with some left
    assert plan.admit.req_ids == (1,) and plan.recompute_tokens == [[1, 20]]
    small.on_done(plan, set())
    plan = small.plan(40, recompute_room=5)  # the room left by a step's cap: 5, not 20
    assert plan.run_ids == (1,) and plan.recompute_tokens == [[1, 5]]
    with pytest.raises(ValueError, match="recompute_chunk"):
        DecodeAdmission("greedy", block_size=16, num_total_blocks=4, recompute_chunk=-1)


def test_without_a_recompute_chunk_a_context_is_recomputed_in_one_step() -> None:
    adm = DecodeAdmission("greedy", block_size=16, num_total_blocks=40, watermark=0)
    adm.add(1, 31, 32, 0, 500)
    adm.on_done(adm.plan(40), set())
    from tetri_server.policy.decode import AdmitPlan, PreemptPlan

    adm.on_done(DecodeStepPlan(PreemptPlan((1,)), AdmitPlan(), run_ids=()), ())
    plan = adm.plan(40)
    assert plan.recompute == ((1, 33, 33),)
    adm.on_done(plan, set())
    assert adm.plan(40).recompute == ()


def test_a_request_part_way_through_its_recompute_is_preempted_last() -> None:
    """It would lose that work and gain no token: the newest admission whose KV is whole goes
    first (without this a re-admitted request, the newest, was the next victim at once)."""
    from tetri_server.policy.decode import AdmitPlan, PreemptPlan

    adm = DecodeAdmission("greedy", block_size=16, num_total_blocks=40, max_batch=8,
                          watermark=0, recompute_chunk=2)
    for rid in (1, 2, 3):
        adm.add(rid, 31, 32, 0, 500)  # 2 blocks each: 32 tokens fill them
    adm.on_done(adm.plan(40), set())  # 33 tokens: each took a third block
    adm.on_done(DecodeStepPlan(PreemptPlan((1,)), AdmitPlan(), run_ids=(2, 3)), ())
    plan = adm.plan(40 - 6)
    assert plan.admit.recompute_ids == (1,) and plan.recompute_tokens == [[1, 2]]
    adm.on_done(plan, set())  # 1 is part-way (2 of 33); 2 and 3 have 35 tokens in 3 blocks
    # no free block, and 2, 3 and 1 running: 1 is the newest admission, but 3 goes
    for _ in range(16):  # 2 and 3 reach 49 tokens: the step needs a fourth block each
        plan = adm.plan(0)
        if plan.preempt.req_ids:
            break
        assert plan.recompute_tokens == [[1, 2]]  # still part-way
        adm.on_done(plan, set())
    assert plan.preempt.req_ids == (3,) and plan.run_ids == (2, 1)


def test_an_evicted_waiting_request_readmitted_in_the_same_plan_recomputes_whole() -> None:
    """``_evict_waiting`` drops a waiting request's KV so the head fits; if the plan starts it
    too, its recompute counts its whole context, not the KV it held when planned."""
    adm = DecodeAdmission("greedy", block_size=16, num_total_blocks=8, max_batch=8,
                          watermark=0, recompute_chunk=16)
    adm.add(1, 111, 112, 0, 50)  # 7 blocks
    plan = adm.plan(num_free_blocks=1)
    adm.on_done(plan, set())  # 113 tokens: needs an 8th
    plan = adm.plan(num_free_blocks=0)
    assert plan.preempt.req_ids == (1,)
    adm.on_done(plan, set())
    adm.add(2, 15, 16, 0, 50)  # 1 block held, behind the preempted head
    plan = adm.plan(num_free_blocks=7)  # the head needs 8: 2's block too
    assert plan.preempt.req_ids == (2,) and plan.run_ids == (1,)
    assert plan.recompute == ((1, 16, 113),)  # 2 not started: the budget is spent
    adm.on_done(plan, set())
    assert adm.plan(num_free_blocks=0).recompute == ((1, 16, 97),)


def test_without_drops_a_recompute_row_from_the_plan() -> None:
    from tetri_server.policy.decode import AdmitPlan, PreemptPlan

    plan = DecodeStepPlan(PreemptPlan(), AdmitPlan((2,), (2,)), (1, 2),
                          recompute=((2, 16, 40),))
    left = plan.without([2])
    assert left.run_ids == (1,) and left.admit == AdmitPlan() and left.recompute == ()
    assert left.num_tokens == 1 and plan.num_tokens == 17


def test_the_kv_of_waiting_requests_goes_before_a_running_request_is_preempted() -> None:
    """Regression (session 49): a decode worker pulls a hand-off's KV on arrival and the
    request may wait for admission (reserve policies, max_batch) holding it. When the running
    batch then needed a block, a running request was preempted: it recomputes all it
    generated and its stream stalls. In the simulator on Mixed with reserve policies, 4-6 of
    6-7 such preemptions came while waiting requests held KV. Now the waiting ones' KV goes
    first (newest first); they keep their place and recompute their prompt when admitted."""
    adm = DecodeAdmission("reserve-static", block_size=16, num_total_blocks=20, max_batch=8,
                          granularity=50, watermark=0)
    adm.add(1, 111, 112, 1, 500)  # 7 blocks, predicted 50 more tokens: 10 in all
    plan = adm.plan(num_free_blocks=13)
    assert plan.run_ids == (1,)
    adm.on_done(plan, set())  # 113 tokens: the next step needs an 8th block
    adm.add(2, 79, 80, 1, 500)  # 5 blocks held; predicted 8 in all: no room beside 1's 10
    adm.add(3, 47, 48, 1, 500)  # 3 blocks held
    plan = adm.plan(num_free_blocks=20 - 7 - 5 - 3 - 5)  # 0 free (5 held elsewhere)
    assert plan.preempt.req_ids == (3,)  # the newest waiting one: 3 blocks, 1 needs 1
    assert plan.run_ids == (1,) and plan.admit.req_ids == ()
    adm.on_done(plan, set())
    assert adm.running_ids == (1,) and len(adm) == 3
    # counted as a waiting request's KV drop, not as a preemption: nothing running stopped
    assert adm.load().num_preemptions == 0 and adm.load().num_kv_drops == 1
    adm.remove(2)  # (aborted): 3 is the waiting head, and lost its KV
    assert adm.head_need() == 3  # its whole context, 48 tokens
    again = adm.plan(num_free_blocks=20 - 8)  # 1 holds 8
    assert again.admit.recompute_ids == (3,) and again.recompute == ((3, 48, 48),)


def test_the_kv_of_waiting_requests_goes_only_where_it_covers_the_shortfall() -> None:
    """Two running requests each need a block, none is free, and a waiting one holds one:
    dropping it would not save a preemption, so it keeps its KV and the newest running
    request is preempted alone (as before)."""
    adm = DecodeAdmission("greedy", block_size=16, num_total_blocks=20, max_batch=2,
                          watermark=0)
    adm.add(1, 31, 32, 0, 500)
    adm.add(2, 31, 32, 0, 500)
    adm.on_done(adm.plan(20), set())  # both at 33 tokens: 3 blocks each next step
    adm.add(3, 15, 16, 0, 500)  # 1 block held, waiting (max_batch 2)
    plan = adm.plan(num_free_blocks=0)
    assert plan.preempt.req_ids == (2,) and plan.run_ids == (1,)
    off = DecodeAdmission("greedy", block_size=16, num_total_blocks=20, max_batch=1,
                          watermark=0, waiting_kv_first=False)
    off.add(1, 31, 32, 0, 500)
    off.on_done(off.plan(20), set())
    off.add(3, 15, 16, 0, 500)
    assert off.plan(num_free_blocks=0).preempt.req_ids == (1,)  # off: the running one goes


def test_a_hand_off_does_not_take_the_blocks_the_batch_or_the_waiting_head_needs() -> None:
    """``has_room_for``: a decode worker pulled a hand-off into the blocks its running batch
    needed next step; the newcomer, the newest waiting request, then lost that KV at once (a
    wasted transfer, and its prompt recomputed on the decode worker)."""
    adm = DecodeAdmission("greedy", block_size=16, num_total_blocks=20, watermark=0)
    adm.add(1, 31, 32, 0, 500)
    adm.on_done(adm.plan(18), set())  # 33 tokens: the next step needs a third block
    assert not adm.has_room_for(2, num_free_blocks=2)
    assert adm.has_room_for(2, num_free_blocks=3)
    adm.add(2, 48, 49, 0, 500)  # waiting head with its KV, its step needs one more block
    assert adm.head_need() == 1 and not adm.has_room_for(2, num_free_blocks=3)


def test_free_after_and_head_need_count_the_waiting_kv_a_plan_drops() -> None:
    """The prompt room beside a plan that dropped waiting KV: its blocks come back
    (``free_after``), and a dropped head needs its whole context to start (``head_need``)."""
    adm = DecodeAdmission("greedy", block_size=16, num_total_blocks=20, max_batch=1,
                          watermark=0)
    adm.add(1, 31, 32, 0, 500)
    adm.on_done(adm.plan(20), set())  # 33 tokens: a third block next step
    adm.add(2, 47, 48, 0, 500)  # waiting (max_batch 1), 3 blocks held
    plan = adm.plan(num_free_blocks=0)
    assert plan.preempt.req_ids == (2,) and plan.run_ids == (1,)
    assert adm.free_after(plan, 0) == 3 - 1  # 2's blocks back, 1's third block taken
    assert adm.head_need(plan) == 3  # 2 starts again from its whole context
    assert adm.prompt_room(plan, 0) == 0

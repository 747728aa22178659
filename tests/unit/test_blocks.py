"""Block allocator: extents, in-place growth, refcounts, no leaks."""

from __future__ import annotations

import random

import pytest

from tetri_server.kv.blocks import BlockAllocator, OutOfBlocks, blocks_for


def test_allocate_returns_consecutive_extents_and_free_returns_everything():
    a = BlockAllocator(64)
    e1, e2 = a.allocate(10), a.allocate(7)
    assert e1 == list(range(e1[0], e1[0] + 10))
    assert e2 == list(range(e2[0], e2[0] + 7))
    assert not set(e1) & set(e2)
    assert a.num_free == 64 - 17
    a.free(e1)
    a.free(e2)
    assert a.num_free == 64 and a.largest_free_run() == 64


def test_new_extents_leave_room_to_grow_in_place():
    a = BlockAllocator(100)
    first = a.allocate(4)
    second = a.allocate(4)
    assert a.extend(first, 3) and a.extend(second, 3)
    assert first == list(range(first[0], first[0] + 7))


def test_extend_fails_without_changing_anything_when_neighbour_is_taken():
    a = BlockAllocator(8)
    e = a.allocate(8)
    assert not a.extend(e, 1)
    assert e == list(range(8)) and a.num_free == 0


def test_out_of_blocks_and_double_free_are_errors():
    a = BlockAllocator(4)
    e = a.allocate(4)
    with pytest.raises(OutOfBlocks):
        a.allocate(1)
    a.free(e)
    with pytest.raises(ValueError):
        a.free(e)


def test_random_workload_never_leaks_and_runs_stay_merged():
    rng = random.Random(0)
    a = BlockAllocator(500)
    live: list[list[int]] = []
    for _ in range(3000):
        if live and rng.random() < 0.45:
            a.free(live.pop(rng.randrange(len(live))))
        elif live and rng.random() < 0.3:
            a.extend(live[rng.randrange(len(live))], rng.randint(1, 4))
        else:
            try:
                live.append(a.allocate(rng.randint(1, 20)))
            except OutOfBlocks:
                pass
        used = sum(len(e) for e in live)
        assert a.num_free == 500 - used
    for e in live:
        a.free(e)
    assert a.num_free == 500 and a.largest_free_run() == 500


def test_blocks_for():
    assert [blocks_for(n, 16) for n in (0, 1, 16, 17)] == [0, 1, 1, 2]


def test_manager_compacts_when_free_space_is_fragmented():
    import torch

    from tetri_server.kv.manager import KVCacheManager

    class Seq:
        def __init__(self) -> None:
            self.blocks: list[int] = []
            self.num_computed = 0

    bs = 2
    kv = torch.zeros(1, 2, 1, 10 * bs, 1)
    m = KVCacheManager(BlockAllocator(10), kv, bs)
    seqs = [Seq() for _ in range(5)]
    for i, s in enumerate(seqs):  # five 2-block extents fill the pool
        assert m.reserve(s, 2 * bs)
        s.num_computed = 2 * bs
        start = s.blocks[0] * bs
        kv[:, :, :, start:start + 2 * bs] = float(i + 1)
    m.free(seqs[1])
    m.free(seqs[3])  # 4 free blocks, but in two runs of 2
    big = Seq()
    assert m.reserve(big, 4 * bs)
    assert m.num_compactions == 1
    for i in (0, 2, 4):  # the moved sequences kept their KV
        start = seqs[i].blocks[0] * bs
        assert torch.all(kv[:, :, :, start:start + 2 * bs] == float(i + 1))
    assert m.allocator.num_free == 0


def test_a_growing_sequence_gets_blocks_whenever_enough_are_free():
    """Growth needs only the new blocks free, not room for a copy of the whole sequence."""
    import torch

    from tetri_server.kv.manager import KVCacheManager

    class Seq:
        def __init__(self) -> None:
            self.blocks: list[int] = []
            self.num_computed = 0

    bs = 2
    kv = torch.zeros(1, 2, 1, 12 * bs, 1)
    m = KVCacheManager(BlockAllocator(12), kv, bs)
    a, b, c = Seq(), Seq(), Seq()
    for s, n in ((a, 6), (b, 2), (c, 2)):
        assert m.reserve(s, n * bs)
        s.num_computed = n * bs
    kv[:, :, :, a.blocks[0] * bs:(a.blocks[0] + 6) * bs] = 7.0
    m.free(b)  # 4 blocks free in total, in runs smaller than a's 6 + 1
    assert m.reserve(a, 7 * bs)
    assert len(a.blocks) == 7 and a.blocks == list(range(a.blocks[0], a.blocks[0] + 7))
    start = a.blocks[0] * bs
    assert torch.all(kv[:, :, :, start:start + 6 * bs] == 7.0)


class _Seq:
    def __init__(self) -> None:
        self.blocks: list[int] = []
        self.num_computed = 0


def _filled(m, kv, n_blocks: int, value: float):
    s = _Seq()
    assert m.reserve(s, n_blocks * m.block_size)
    s.num_computed = n_blocks * m.block_size
    start = s.blocks[0] * m.block_size
    kv[:, :, :, start:start + s.num_computed] = value
    return s


def _holds(kv, s, value: float, bs: int) -> bool:
    start = s.blocks[0] * bs
    return bool((kv[:, :, :, start:start + s.num_computed] == value).all())


def test_compaction_never_moves_a_pinned_extent():
    """Regression (wrong answers with HTTP 200): a prefill worker compacted its pool while a
    hand-off named block ids a decode worker was about to copy; the copy read another
    request's KV. Pinned extents must keep their ids and their contents."""
    import torch

    from tetri_server.kv.manager import KVCacheManager

    bs = 2
    kv = torch.zeros(1, 2, 1, 20 * bs, 1)
    m = KVCacheManager(BlockAllocator(20), kv, bs)
    seqs = [_filled(m, kv, 2, float(i + 1)) for i in range(8)]  # 16 of 20 blocks used
    for i in (1, 3, 5):
        m.free(seqs[i])
    pinned = [seqs[2], seqs[6]]
    for s in pinned:
        m.pin(s)
    before = {id(s): list(s.blocks) for s in pinned}
    big = _Seq()
    assert m.reserve(big, 6 * bs)  # 10 free blocks, no run of 6: compaction
    assert m.num_compactions == 1
    for s in pinned:
        assert s.blocks == before[id(s)]
    for i in (0, 2, 4, 6, 7):
        assert _holds(kv, seqs[i], float(i + 1), bs), i
    assert len(set(big.blocks)) == 6
    used = [b for s in (*[seqs[i] for i in (0, 2, 4, 6, 7)], big) for b in s.blocks]
    assert len(used) == len(set(used))  # no two sequences share a block


def test_a_reservation_that_only_fits_by_moving_pinned_extents_fails_cleanly():
    import torch

    from tetri_server.kv.manager import KVCacheManager

    bs = 2
    kv = torch.zeros(1, 2, 1, 10 * bs, 1)
    m = KVCacheManager(BlockAllocator(10), kv, bs)
    seqs = [_filled(m, kv, 2, float(i + 1)) for i in range(5)]  # the pool is full
    by_address = sorted(seqs, key=lambda s: s.blocks[0])
    m.free(by_address[2])
    m.free(by_address[4])  # two free runs of 2, with a pinned extent between them
    for s in (by_address[0], by_address[1], by_address[3]):
        m.pin(s)
    snapshot = [list(s.blocks) for s in seqs]
    big = _Seq()
    assert not m.reserve(big, 4 * bs)
    assert big.blocks == [] and [list(s.blocks) for s in seqs] == snapshot
    assert m.allocator.num_free == 4
    m.unpin(by_address[3])
    assert m.reserve(big, 4 * bs)  # now it may slide left and leave one run of 4
    for s in (by_address[0], by_address[1], by_address[3]):
        assert _holds(kv, s, float(seqs.index(s) + 1), bs)


def test_random_pins_and_compactions_keep_every_extent_intact():
    """Statistical: many sequences of varied length on a small pool, random pins, growth
    and frees; every live sequence always holds its own values."""
    import random

    import torch

    from tetri_server.kv.manager import KVCacheManager

    rng = random.Random(7)
    bs = 4
    nb = 64
    kv = torch.zeros(1, 2, 1, nb * bs, 1)
    m = KVCacheManager(BlockAllocator(nb), kv, bs)
    live: dict[int, _Seq] = {}
    for step in range(3000):
        op = rng.random()
        if op < 0.45:
            s = live.get(rng.randrange(40)) if live else None
            if s is None:
                s = _Seq()
                key = rng.randrange(40)
                if key in live:
                    continue
            else:
                key = next(k for k, v in live.items() if v is s)
            if m.is_pinned(s):
                continue
            want = s.num_computed + rng.randint(1, 3 * bs)
            if m.reserve(s, want):
                start = s.blocks[0] * bs
                kv[:, :, :, start + s.num_computed:start + want] = float(key + 1)
                s.num_computed = want
                live[key] = s
        elif op < 0.7 and live:
            key = rng.choice(list(live))
            m.free(live.pop(key))
        elif live:
            s = live[rng.choice(list(live))]
            (m.unpin if m.is_pinned(s) else m.pin)(s)
        for key, s in live.items():
            assert _holds(kv, s, float(key + 1), bs), (step, key)
        held = [b for s in live.values() for b in s.blocks]
        assert len(held) == len(set(held)) and m.allocator.num_used == len(held)
    assert m.num_compactions > 0


def test_a_prompt_refused_for_fragmented_blocks_stops_new_starts_not_started_prompts():
    """Regression: under srpt a new short prompt comes before a paused long one. When the new
    prompt's blocks did not fit in one run (free blocks split by extents pinned for hand-offs),
    the step stopped there, and the started prompt behind it, which needs no new blocks, waited
    too (the worker idled until an ack). Now only prompts that would start wait."""
    import torch

    from tetri_server.engine.sequence import Sequence
    from tetri_server.kv.manager import KVCacheManager
    from tetri_server.messages import SamplingParams
    from tetri_server.policy.prefill import ChunkSlice
    from tetri_server.workers.decoding import reserve_prompts

    bs = 2
    kv = torch.zeros(1, 2, 1, 12 * bs, 1)
    m = KVCacheManager(BlockAllocator(12), kv, bs)

    def seq(req_id: int, num_prompt: int) -> Sequence:
        return Sequence(req_id, list(range(num_prompt)), num_prompt, SamplingParams())

    paused = seq(1, 8)
    assert m.reserve(paused, paused.num_prompt)  # started: its 4 blocks are held
    paused.num_computed = 4
    others = [_filled(m, kv, 2, float(i)) for i in range(4)]  # the pool is full
    by_address = sorted(others, key=lambda s: s.blocks[0])
    m.free(by_address[0])
    m.free(by_address[2])  # 4 free blocks in two runs of 2, a pinned extent between them
    for s in (by_address[1], by_address[3]):
        m.pin(s)
    new, small = seq(2, 6), seq(3, 2)  # 3 blocks: no run fits; 1 block: would fit
    seqs = {1: paused, 2: new, 3: small}
    slices = (ChunkSlice(2, 0, 6, 6), ChunkSlice(1, 4, 4, 8), ChunkSlice(3, 0, 2, 2))
    items: list = []
    kept = reserve_prompts(slices, seqs.__getitem__, m, items)
    assert kept == (slices[1],)  # the paused prompt runs; the small one does not overtake
    assert [i.seq.req_id for i in items] == [1] and items[0].num_tokens == 4
    assert new.blocks == [] and small.blocks == [] and m.allocator.num_free == 4


def test_a_kept_request_whose_growth_is_split_by_pinned_extents_waits_a_step_not_a_crash():
    """Regression (a prefill worker crashed, restarting with every request on it): a request
    the prefill worker keeps decoding needs one more block; enough blocks are free, but pinned
    extents (un-acked hand-offs) split them, so no run holds its extent grown. The admission
    counts free blocks and plans it; ``carry_out`` raised "allocator and policy disagree". Now
    the row sits the step out, its KV and tokens intact, and runs once an ack unpins."""
    import torch

    from tetri_server.engine.sequence import Sequence
    from tetri_server.kv.manager import KVCacheManager
    from tetri_server.messages import SamplingParams
    from tetri_server.policy import DecodeAdmission
    from tetri_server.workers.decoding import carry_out

    bs = 2
    kv = torch.zeros(1, 2, 1, 12 * bs, 1)
    m = KVCacheManager(BlockAllocator(12), kv, bs)
    kept = Sequence(7, list(range(9)), 8, SamplingParams())  # 8 prompt tokens + 1 sampled
    assert m.reserve(kept, 8)
    kept.num_computed = 8
    kv[:, :, :, kept.blocks[0] * bs:kept.blocks[0] * bs + 8] = 7.0
    others = sorted((_filled(m, kv, 2, float(i)) for i in range(4)), key=lambda s: s.blocks[0])
    assert kept.blocks == [0, 1, 2, 3] and m.allocator.num_free == 0
    m.free(others[1])
    m.free(others[3])  # 4 blocks free, in two runs of 2
    m.pin(others[0])  # right after the kept request: it cannot grow in place
    m.pin(others[2])  # ... and the free runs cannot be joined
    admission = DecodeAdmission("greedy", block_size=bs, num_total_blocks=12)
    admission.add(7, 8, 9, 0, 100)
    plan = admission.plan(m.allocator.num_free)
    assert plan.run_ids == (7,)  # 1 more block of 4 free: the admission runs it
    items, dropped, carried = carry_out(plan, {7: kept}, m)
    assert items == [] and dropped == [] and carried.run_ids == () and carried.admit.req_ids == ()
    assert kept.blocks == [0, 1, 2, 3] and _holds(kv, kept, 7.0, bs)
    admission.on_done(carried, set())
    assert 7 in admission and kept.num_computed == 8
    m.unpin(others[0])  # the ack came: the extent after it may move
    plan = admission.plan(m.allocator.num_free)
    items, dropped, carried = carry_out(plan, {7: kept}, m)
    assert [(i.seq.req_id, i.num_tokens) for i in items] == [(7, 1)] and carried == plan
    assert len(kept.blocks) == 5 and _holds(kv, kept, 7.0, bs)


def test_with_nothing_pinned_a_planned_row_that_does_not_fit_is_still_an_error():
    """Decode and coupled workers never pin: there a row the admission planned but the pool
    cannot hold means the two disagree, and the step fails loudly."""
    import torch

    from tetri_server.engine.sequence import Sequence
    from tetri_server.kv.manager import KVCacheManager
    from tetri_server.messages import SamplingParams
    from tetri_server.policy.decode import AdmitPlan, DecodeStepPlan, PreemptPlan
    from tetri_server.workers.decoding import carry_out

    bs = 2
    m = KVCacheManager(BlockAllocator(4), torch.zeros(1, 2, 1, 4 * bs, 1), bs)
    big = Sequence(1, list(range(12)), 11, SamplingParams())  # 6 blocks: never fits 4
    plan = DecodeStepPlan(PreemptPlan(), AdmitPlan((1,), (1,)), (1,))
    with pytest.raises(RuntimeError, match="disagree"):
        carry_out(plan, {1: big}, m)


def test_a_reserved_tail_is_out_of_the_allocator_for_good():
    """The CUDA-graph scratch block: once reserved, an empty pool reads all free (a flip's
    drain check compares the two), and no extent, growth or move ever reaches it."""
    a = BlockAllocator(10)
    assert a.reserve_tail(1) == [9]
    assert a.num_blocks == a.num_free == 9
    ext = a.allocate(4)
    assert a.extend(ext, 5) and ext[-1] == 8
    assert not a.extend(ext, 1)
    with pytest.raises(OutOfBlocks):
        a.allocate(1)
    a.free(ext)
    assert a.num_free == a.num_blocks == 9 and a.largest_free_run() == 9

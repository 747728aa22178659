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


def test_refcounts_keep_shared_blocks_until_last_free():
    a = BlockAllocator(8)
    e = a.allocate(3)
    a.incref(e)
    a.free(e)
    assert a.num_free == 5
    a.free(e)
    assert a.num_free == 8


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

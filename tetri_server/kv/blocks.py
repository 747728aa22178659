"""Block allocator: pure Python, no torch. Blocks are the unit of allocation, admission
accounting and hand-off.

Sequences hold *extents*: runs of consecutive block ids, so that attention reads a sequence's
whole context as one zero-copy view of the pool (``engine/attention.py``). A sequence grows in
place when the block after its extent is free; otherwise the caller relocates it (one copy per pool,
amortised over ``block_size`` tokens). New extents go to the middle of the largest free run, so
neighbours leave each other room to grow.

Invariants: ``refcount[b] == 0`` iff ``b`` is in exactly one free run; free runs never touch
(adjacent runs are merged on free); ``num_free == sum of run lengths``.
"""

from __future__ import annotations


class OutOfBlocks(Exception):
    """No free run is long enough (there may still be enough free blocks in total)."""


def check_pool_holds(num_blocks: int, reserved: int, max_model_len: int,
                     block_size: int) -> None:
    """ValueError unless a pool of ``num_blocks``, ``reserved`` of them taken for good (the
    CUDA-graph scratch block), holds one sequence of ``max_model_len`` tokens."""
    if num_blocks - reserved < blocks_for(max_model_len, block_size):
        raise ValueError(f"KV pool of {num_blocks} blocks ({reserved} for CUDA graphs) cannot "
                         f"hold one sequence of max_model_len={max_model_len}; raise "
                         "kv.num_blocks")


class BlockAllocator:
    """Owns the block ids ``0 .. num_blocks-1`` of one KV pool."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        self.num_blocks = num_blocks
        self.refcount = [0] * num_blocks
        self._runs: dict[int, int] = {0: num_blocks}  # start -> length of each free run
        self._run_ends: dict[int, int] = {num_blocks: 0}  # end (exclusive) -> start
        self.num_free = num_blocks

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    def largest_free_run(self) -> int:
        return max(self._runs.values(), default=0)

    def allocate(self, num: int) -> list[int]:
        """A new extent of ``num`` consecutive blocks (refcount 1). Raises OutOfBlocks."""
        if num <= 0:
            return []
        best = max(self._runs.items(), key=lambda r: (r[1], -r[0]), default=None)
        if best is None or best[1] < num:
            raise OutOfBlocks(f"need {num} consecutive blocks, largest free run "
                              f"{self.largest_free_run()}")
        start, length = best
        # Middle of the largest run, but flush left at the pool start (nobody to the left).
        offset = 0 if start == 0 else (length - num) // 2
        self._take(start + offset, num)
        return list(range(start + offset, start + offset + num))

    def first_fit(self, num: int) -> int | None:
        """The lowest start of a free run of at least ``num`` blocks, or None."""
        fits = [s for s, n in self._runs.items() if n >= num]
        return min(fits) if fits else None

    def copy(self) -> BlockAllocator:
        """An independent copy (to plan moves on without touching this one)."""
        other = BlockAllocator.__new__(BlockAllocator)
        other.num_blocks, other.num_free = self.num_blocks, self.num_free
        other.refcount = list(self.refcount)
        other._runs, other._run_ends = dict(self._runs), dict(self._run_ends)
        return other

    def allocate_at(self, start: int, num: int) -> list[int]:
        """The extent [start, start+num), which must be free (used by compaction)."""
        if num <= 0:
            return []
        run = self._run_containing(start)
        if run + self._runs[run] < start + num:
            raise OutOfBlocks(f"blocks {start}..{start + num - 1} are not all free")
        self._take(start, num)
        return list(range(start, start + num))

    def reserve_tail(self, num: int) -> list[int]:
        """Take the last ``num`` blocks out of the allocator for good (a worker's CUDA-graph
        scratch block); they must be free. From then on it owns ``num_blocks - num`` blocks,
        so what counts its blocks (the drain check before a flip, admission, load reports)
        sees only those a request can have."""
        start = self.num_blocks - num
        taken = self.allocate_at(start, num)
        del self.refcount[start:]
        self.num_blocks = start
        return taken

    def extend(self, blocks: list[int], num: int) -> bool:
        """Grow the extent ``blocks`` in place by ``num`` blocks if the blocks after it are free.
        Appends to ``blocks`` and returns True, or changes nothing and returns False."""
        if num <= 0:
            return True
        end = blocks[-1] + 1 if blocks else None
        if end is None or self._runs.get(end, 0) < num:
            return False
        self._take(end, num)
        blocks.extend(range(end, end + num))
        return True

    def free(self, blocks: list[int]) -> None:
        """Drop one reference to each block; blocks that reach 0 return to the free runs."""
        for b in blocks:
            if self.refcount[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                self._give_back(b)

    # ------------------------------------------------------------------ internals

    def _take(self, start: int, num: int) -> None:
        """Remove [start, start+num) from the free run that contains it."""
        run_start = self._run_containing(start)
        run_len = self._runs.pop(run_start)
        del self._run_ends[run_start + run_len]
        if start > run_start:
            self._add_run(run_start, start - run_start)
        tail = run_start + run_len - (start + num)
        if tail > 0:
            self._add_run(start + num, tail)
        for b in range(start, start + num):
            self.refcount[b] = 1
        self.num_free -= num

    def _run_containing(self, block: int) -> int:
        for s, n in self._runs.items():
            if s <= block < s + n:
                return s
        raise AssertionError(f"block {block} is not free")

    def _add_run(self, start: int, length: int) -> None:
        self._runs[start] = length
        self._run_ends[start + length] = start

    def _give_back(self, b: int) -> None:
        start, length = b, 1
        left = self._run_ends.pop(b, None)  # a run ending exactly at b
        if left is not None:
            length += self._runs.pop(left)
            start = left
        right_len = self._runs.pop(b + 1, None)
        if right_len is not None:
            del self._run_ends[b + 1 + right_len]
            length += right_len
        self._add_run(start, length)
        self.num_free += 1


def blocks_for(num_tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``num_tokens`` tokens."""
    return -(-num_tokens // block_size)

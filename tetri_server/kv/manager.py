"""Keeps each sequence's blocks one extent of the pool, growing in place or relocating."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tetri_server.kv.blocks import BlockAllocator, OutOfBlocks, blocks_for

if TYPE_CHECKING:
    import torch


class HasBlocks(Protocol):
    blocks: list[int]
    num_computed: int


class KVCacheManager:
    """Allocation on top of a ``BlockAllocator`` for one pool tensor
    ``kv: [layers, 2, kv_heads, num_blocks * block_size, head_dim]``.

    ``reserve(seq, n)`` makes ``seq.blocks`` hold at least ``n`` tokens: in place when the next
    blocks are free, else by moving the computed KV to a new extent (one strided copy), else by
    compacting the pool.

    Hazard: a prefill worker's extents are read by a decode worker's copy while a hand-off is
    un-acknowledged. ``pin`` such sequences: no relocation or compaction ever moves a pinned
    extent (a wrong answer otherwise: the copy would read another request's KV)."""

    def __init__(self, allocator: BlockAllocator, kv: torch.Tensor, block_size: int) -> None:
        self.allocator = allocator
        self.kv = kv
        self.block_size = block_size
        self.num_relocations = 0
        self.num_compactions = 0
        self._holders: dict[int, HasBlocks] = {}  # id(seq) -> seq, for every seq with blocks
        # id(seq) of sequences whose blocks a peer may be reading (an un-acked hand-off):
        # their extents stay where they are until freed or unpinned.
        self._pinned: set[int] = set()

    def reserve(self, seq: HasBlocks, num_tokens: int) -> bool:
        """Grow ``seq.blocks`` to hold ``num_tokens`` tokens. False (nothing changed) if the pool
        has no room."""
        need = blocks_for(num_tokens, self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        if id(seq) in self._pinned:
            raise ValueError("a pinned sequence cannot grow (its blocks are being read)")
        if not self._grow(seq, need):
            # Enough blocks in total, but no run long enough: compact, with this sequence
            # last so that it grows in place into a free run.
            if not self.compact(last=seq, room=need) or not self._grow(seq, need):
                return False
        self._holders[id(seq)] = seq
        return True

    def free(self, seq: HasBlocks) -> None:
        if seq.blocks:
            self.allocator.free(seq.blocks)
            seq.blocks = []
        self._holders.pop(id(seq), None)
        self._pinned.discard(id(seq))

    def pin(self, seq: HasBlocks) -> None:
        """Another process may read ``seq.blocks`` from now on (a hand-off named them): they
        must not move until ``unpin`` or ``free``. Compaction works around pinned extents."""
        self._pinned.add(id(seq))

    def unpin(self, seq: HasBlocks) -> None:
        self._pinned.discard(id(seq))

    def is_pinned(self, seq: HasBlocks) -> bool:
        return id(seq) in self._pinned

    @property
    def num_pinned(self) -> int:
        """Extents pinned now: while any is, a reservation can fail with enough blocks free."""
        return len(self._pinned)

    def compact(self, last: HasBlocks | None = None, room: int = 0) -> bool:
        """Slide every movable extent to the lowest free run that holds it, in address order
        (``last`` moved after all others, where ``room`` more blocks are free after it), so
        that free space gathers at the end of the pool. Pinned extents never move: the others
        fill the gaps around them. Returns False, changing nothing, if ``last`` (or a new
        extent of ``room`` blocks, when ``last`` has none) would not find its room."""
        movable = sorted((s for s in self._holders.values()
                          if id(s) not in self._pinned and s.blocks and s is not last),
                         key=lambda s: s.blocks[0])
        moving_last = last is not None and bool(last.blocks) and id(last) not in self._pinned
        moved_last = last if moving_last else None
        order: list[HasBlocks] = movable + ([moved_last] if moved_last is not None else [])
        targets = self._plan_compaction(order, moved_last, room)
        if targets is None:
            return False
        saved = None
        if moved_last is not None:  # others may slide over it: keep a copy
            saved = self._tokens(moved_last.blocks[0], moved_last.num_computed).clone()
        for seq in order:
            self.allocator.free(seq.blocks)
        for seq, start in zip(order, targets, strict=True):
            n, old = len(seq.blocks), seq.blocks[0]
            seq.blocks = self.allocator.allocate_at(start, n)
            if seq is last and saved is not None:
                self._tokens(start, seq.num_computed).copy_(saved)
            elif old != start:  # leftwards only, so earlier moves never overwrite it
                self._move(old, start, seq.num_computed, overlap=old - start < n)
        self.num_compactions += 1
        return True

    def _plan_compaction(self, order: list[HasBlocks], last: HasBlocks | None,
                         room: int) -> list[int] | None:
        """Target start block of each extent in ``order``, on a scratch allocator: first fit
        in address order. Each target is at or left of the extent's old start (its old place
        is free when its turn comes), which makes the in-place moves safe. ``last`` (the final
        entry of ``order``, or None) needs ``room`` free blocks after it; with no ``last``, a
        free run of ``room`` blocks must remain."""
        scratch = self.allocator.copy()
        for seq in order:
            scratch.free(seq.blocks)
        targets = []
        for seq in order:
            extra = room if seq is last else 0
            start = scratch.first_fit(len(seq.blocks) + extra)
            if start is None:
                return None
            scratch.allocate_at(start, len(seq.blocks))
            targets.append(start)
        if last is None and room and scratch.first_fit(room) is None:
            return None
        return targets

    def _tokens(self, block: int, num_tokens: int) -> torch.Tensor:
        bs = self.block_size
        return self.kv[:, :, :, block * bs:block * bs + num_tokens]

    def _grow(self, seq: HasBlocks, need: int) -> bool:
        if not seq.blocks:
            try:
                seq.blocks = self.allocator.allocate(need)
            except OutOfBlocks:
                return False
            return True
        if self.allocator.extend(seq.blocks, need):
            return True
        try:
            new = self.allocator.allocate(len(seq.blocks) + need)
        except OutOfBlocks:
            return False
        self._move(seq.blocks[0], new[0], seq.num_computed)
        self.allocator.free(seq.blocks)
        seq.blocks = new
        self.num_relocations += 1
        return True

    def _move(self, old_block: int, new_block: int, num_tokens: int,
              overlap: bool = False) -> None:
        if num_tokens == 0:
            return
        src = self._tokens(old_block, num_tokens)
        if overlap:
            src = src.clone()
        self._tokens(new_block, num_tokens).copy_(src)

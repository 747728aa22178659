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
    blocks are free, else by moving the computed KV to a new extent (one strided copy)."""

    def __init__(self, allocator: BlockAllocator, kv: torch.Tensor, block_size: int) -> None:
        self.allocator = allocator
        self.kv = kv
        self.block_size = block_size
        self.num_relocations = 0
        self.num_compactions = 0
        self._holders: dict[int, HasBlocks] = {}  # id(seq) -> seq, for every seq with blocks

    def reserve(self, seq: HasBlocks, num_tokens: int) -> bool:
        """Grow ``seq.blocks`` to hold ``num_tokens`` tokens. False (nothing changed) if the pool
        has no room."""
        need = blocks_for(num_tokens, self.block_size) - len(seq.blocks)
        if need <= 0:
            return True
        if need > self.allocator.num_free:
            return False
        if not self._grow(seq, need):
            # Enough blocks in total, but no run long enough: compact, with this sequence
            # last so that it grows in place into the single free run.
            self.compact(last=seq)
            if not self._grow(seq, need):
                return False
        self._holders[id(seq)] = seq
        return True

    def free(self, seq: HasBlocks) -> None:
        if seq.blocks:
            self.allocator.free(seq.blocks)
            seq.blocks = []
        self._holders.pop(id(seq), None)

    def compact(self, last: HasBlocks | None = None) -> None:
        """Slide every extent to the left, in address order (``last`` moved to the end), so
        that free space is one run at the end of the pool."""
        holders = sorted(self._holders.values(), key=lambda s: (s is last, s.blocks[0]))
        saved = None
        if last is not None and last.blocks:  # others may slide over it: keep a copy
            saved = self._tokens(last.blocks[0], last.num_computed).clone()
        for seq in holders:
            self.allocator.free(seq.blocks)
        cursor = 0
        for seq in holders:
            n, old = len(seq.blocks), seq.blocks[0]
            seq.blocks = self.allocator.allocate_at(cursor, n)
            if seq is last and saved is not None:
                self._tokens(cursor, seq.num_computed).copy_(saved)
            elif old != cursor:  # leftwards only, so earlier moves never overwrite it
                self._move(old, cursor, seq.num_computed, overlap=old - cursor < n)
            cursor += n
        self.num_compactions += 1

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

"""CPU KV transport: the pool is one POSIX shared-memory segment, mapped once by each peer."""

from __future__ import annotations

import mmap
import os

import torch

from tetri_server.channel import reserve_shm, unlink_segment
from tetri_server.kv.transport import DTYPE_NAMES, PoolGeometry, copy_extent_runs
from tetri_server.messages import PoolHandle

SHM_DIR = "/dev/shm"


def _map(name: str, num_bytes: int, create: bool) -> torch.Tensor:
    """A uint8 tensor over the segment ``name``. Plain mmap rather than ``SharedMemory``: the
    mapping must live exactly as long as tensors view it (no resource tracker, no close())."""
    path = os.path.join(SHM_DIR, name)
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, num_bytes)
            reserve_shm(fd, num_bytes, f"KV pool {name}")
        # A peer's pool is populated at map time, so the first hand-offs out of it do not
        # pay page faults inside the decode loop; our own pool is pre-touched by zero_().
        flags = mmap.MAP_SHARED | (0 if create else mmap.MAP_POPULATE)
        mm = mmap.mmap(fd, num_bytes, flags=flags)
    finally:
        os.close(fd)
    return torch.frombuffer(mm, dtype=torch.uint8, count=num_bytes)


class ShmTransport:
    def __init__(self, worker_id: int, geometry: PoolGeometry, segment_name: str) -> None:
        self.worker_id = worker_id
        self.geometry = geometry
        self.name = segment_name
        self.kv = geometry.view(_map(segment_name, geometry.num_bytes, create=True))
        self.kv.zero_()  # pre-touch: first-touch page faults cost ~6 us per 4 KiB page here
        self._peers: dict[int, tuple[PoolHandle, torch.Tensor]] = {}

    def export(self) -> PoolHandle:
        g = self.geometry
        return PoolHandle(self.worker_id, "shm", self.name, g.num_layers, g.num_blocks,
                          g.block_size, g.num_kv_heads, g.head_dim, DTYPE_NAMES[g.dtype],
                          layout=g.layout)

    def open(self, handle: PoolHandle) -> None:
        old = self._peers.get(handle.worker_id)
        if old is not None and old[0] == handle:
            return
        if handle.transport != "shm":
            raise ValueError(f"peer {handle.worker_id} exports {handle.transport}, not shm")
        self.drop(handle.worker_id)
        g = PoolGeometry.of(handle)
        self._peers[handle.worker_id] = (handle, g.view(_map(handle.name, g.num_bytes, False)))

    def retain(self, worker_ids: set[int]) -> None:
        for wid in [w for w in self._peers if w not in worker_ids]:
            self.drop(wid)

    def drop(self, worker_id: int) -> None:
        self._peers.pop(worker_id, None)  # unmapped with the last tensor that views it

    def copy_blocks(self, src_worker: int, src_ids: list[int], dst_ids: list[int],
                    num_tokens: int) -> None:
        _, src = self._peers[src_worker]
        copy_extent_runs(src, self.kv, src_ids, dst_ids, num_tokens, self.geometry.block_size)

    def close(self) -> None:
        self._peers.clear()
        unlink_segment(self.name)  # may already be gone: the control process unlinks it too

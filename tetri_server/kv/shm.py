"""CPU KV transport: the pool is one POSIX shared-memory segment, mapped once by each peer."""

from __future__ import annotations

from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

import torch

from tetri_server.kv.transport import DTYPE_NAMES, PoolGeometry, copy_extent_runs
from tetri_server.messages import PoolHandle


def _untrack(shm: SharedMemory) -> None:
    # The control process owns segment lifetimes (it unlinks pools of dead workers and stale
    # runs); Python's resource tracker would otherwise unlink or warn on a worker's exit.
    resource_tracker.unregister(shm._name, "shared_memory")  # type: ignore[attr-defined]


def _view(shm: SharedMemory, geometry: PoolGeometry) -> torch.Tensor:
    flat = torch.frombuffer(shm.buf, dtype=torch.uint8, count=geometry.num_bytes)
    return flat.view(geometry.dtype).view(geometry.shape)


class ShmTransport:
    def __init__(self, worker_id: int, geometry: PoolGeometry, segment_name: str) -> None:
        self.worker_id = worker_id
        self.geometry = geometry
        self._shm = SharedMemory(name=segment_name, create=True, size=geometry.num_bytes)
        _untrack(self._shm)
        self.kv = _view(self._shm, geometry)
        self.kv.zero_()  # pre-touch: first-touch page faults cost ~6 us per 4 KiB page here
        self._peers: dict[int, tuple[PoolHandle, SharedMemory, torch.Tensor]] = {}

    def export(self) -> PoolHandle:
        g = self.geometry
        return PoolHandle(self.worker_id, "shm", self._shm.name, g.num_layers, g.num_blocks,
                          g.block_size, g.num_kv_heads, g.head_dim, DTYPE_NAMES[g.dtype])

    def open(self, handle: PoolHandle) -> None:
        old = self._peers.get(handle.worker_id)
        if old is not None and old[0] == handle:
            return
        if handle.transport != "shm":
            raise ValueError(f"peer {handle.worker_id} exports {handle.transport}, not shm")
        self.drop(handle.worker_id)
        shm = SharedMemory(name=handle.name, create=False)
        _untrack(shm)
        self._peers[handle.worker_id] = (handle, shm, _view(shm, PoolGeometry.of(handle)))

    def drop(self, worker_id: int) -> None:
        peer = self._peers.pop(worker_id, None)
        if peer is not None:
            del peer  # the tensor view must go before the mapping closes
            # SharedMemory.close() fails while views exist; let GC unmap it with the tensor.

    def copy_blocks(self, src_worker: int, src_ids: list[int], dst_ids: list[int],
                    num_tokens: int) -> None:
        _, _, src = self._peers[src_worker]
        copy_extent_runs(src, self.kv, src_ids, dst_ids, num_tokens, self.geometry.block_size)

    def close(self) -> None:
        self._peers.clear()
        name = self._shm.name
        try:
            SharedMemory(name=name, create=False).unlink()
        except FileNotFoundError:
            pass  # already unlinked by the control process

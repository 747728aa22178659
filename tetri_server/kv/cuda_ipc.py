"""GPU KV transport: the pool is a cudaMalloc'd buffer shared through cudaIpcMemHandle (cupy).

cupy is imported only here, only when ``kv.transport = cuda_ipc``. The buffer is allocated with
cupy (not torch's caching allocator) so that its IPC handle points at the allocation base.
"""

from __future__ import annotations

from typing import Any

import torch

from tetri_server.kv.transport import DTYPE_NAMES, PoolGeometry, copy_extent_runs
from tetri_server.messages import PoolHandle


def _cupy() -> Any:
    try:
        import cupy
    except ImportError as e:
        raise RuntimeError("kv.transport = cuda_ipc needs cupy: pip install 'tetri-server[gpu]'"
                           ) from e
    if not cupy.cuda.is_available():
        raise RuntimeError("kv.transport = cuda_ipc: cupy sees no usable CUDA device")
    return cupy


def _as_tensor(cp: Any, ptr: int, geometry: PoolGeometry, device: torch.device,
               owner: Any) -> torch.Tensor:
    mem = cp.cuda.UnownedMemory(ptr, geometry.num_bytes, owner, device.index or 0)
    arr = cp.ndarray((geometry.num_bytes,), dtype=cp.uint8, memptr=cp.cuda.MemoryPointer(mem, 0))
    flat = torch.as_tensor(arr, device=device)
    return geometry.view(flat)


class CudaIpcTransport:
    def __init__(self, worker_id: int, geometry: PoolGeometry, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError("kv.transport = cuda_ipc needs cluster.device = cuda")
        self.cp = _cupy()
        self.worker_id, self.geometry, self.device = worker_id, geometry, device
        with self.cp.cuda.Device(device.index or 0):
            self._mem = self.cp.cuda.alloc(geometry.num_bytes)  # keeps the buffer alive
        self._ptr = int(self._mem.ptr)
        self.kv = _as_tensor(self.cp, self._ptr, geometry, device, self._mem)
        self.kv.zero_()
        self._peers: dict[int, tuple[PoolHandle, int, torch.Tensor]] = {}

    def export(self) -> PoolHandle:
        g = self.geometry
        handle = bytes(self.cp.cuda.runtime.ipcGetMemHandle(self._ptr))
        return PoolHandle(self.worker_id, "cuda_ipc", f"cuda:{self.device.index or 0}",
                          g.num_layers, g.num_blocks, g.block_size, g.num_kv_heads, g.head_dim,
                          DTYPE_NAMES[g.dtype], ipc_handle=handle, device=self.device.index or 0,
                          layout=g.layout)

    def open(self, handle: PoolHandle) -> None:
        old = self._peers.get(handle.worker_id)
        if old is not None and old[0] == handle:
            return
        if handle.transport != "cuda_ipc":
            raise ValueError(f"peer {handle.worker_id} exports {handle.transport}, not cuda_ipc")
        self.drop(handle.worker_id)
        with self.cp.cuda.Device(self.device.index or 0):
            ptr = self.cp.cuda.runtime.ipcOpenMemHandle(
                handle.ipc_handle, self.cp.cuda.runtime.cudaIpcMemLazyEnablePeerAccess)
        tensor = _as_tensor(self.cp, ptr, PoolGeometry.of(handle), self.device, self)
        self._peers[handle.worker_id] = (handle, ptr, tensor)

    def retain(self, worker_ids: set[int]) -> None:
        for wid in [w for w in self._peers if w not in worker_ids]:
            self.drop(wid)

    def drop(self, worker_id: int) -> None:
        peer = self._peers.pop(worker_id, None)
        if peer is not None:
            torch.cuda.synchronize(self.device)
            self.cp.cuda.runtime.ipcCloseMemHandle(peer[1])

    def copy_blocks(self, src_worker: int, src_ids: list[int], dst_ids: list[int],
                    num_tokens: int) -> None:
        _, _, src = self._peers[src_worker]
        copy_extent_runs(src, self.kv, src_ids, dst_ids, num_tokens, self.geometry.block_size)
        torch.cuda.synchronize(self.device)  # the owner may free the blocks after our ack

    def close(self) -> None:
        for wid in list(self._peers):
            self.drop(wid)

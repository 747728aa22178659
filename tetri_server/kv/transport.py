"""KV hand-off between workers: one small interface, two implementations.

Every worker owns one pool tensor ``[layers, 2, kv_heads, num_blocks * block_size, head_dim]``
(``PoolGeometry.view``: a view of one buffer, token-major where ``pool_layout`` picks it, so that
a sequence's KV of a layer is one run of memory), made and pre-touched once at start-up and
exported as a ``PoolHandle``. A decode worker maps the
pools of its prefill peers once (``open``) and pulls a request's blocks with ``copy_blocks``:
one strided copy per run of consecutive blocks (a request's blocks are one extent, so one copy).

    shm       (CPU)  the pool lives in a POSIX shared-memory segment; peers mmap it.
    cuda_ipc  (GPU)  the pool is a cudaMalloc'd buffer; peers open its cudaIpcMemHandle (cupy).

The owner frees its blocks only after the puller acknowledges (``KVPulled``); a peer's mapping
stays valid even if the owner dies, until ``drop``.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from tetri_server.messages import PoolHandle

DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}
NAME_DTYPES = {v: k for k, v in DTYPE_NAMES.items()}
log = logging.getLogger("tetri.kv")


LAYOUTS = ("token-major", "head-major")
# auto picks token-major on cpu for float32 pools whose token holds at least this many bytes of K
TOKEN_MAJOR_MIN_RECORD = 1024


def pool_layout(layout: str, device: torch.device, dtype: torch.dtype, num_kv_heads: int,
                head_dim: int) -> str:
    """``kv.layout`` resolved for one pool. ``auto``: token-major where the CPU decode attention
    walks it in address order (float32) and reads it faster: on a Zen 4 VM, session 56, decode
    steps at batch 32 took 0.874x (context 128) and 0.905x (1024) as long as on a head-major
    pool with the bench Llama (8 kv heads of 64: 2 KiB a token), 0.957-0.983x with 1 KiB tokens,
    but 1.019x and 1.274x with 512-byte ones (2 kv heads of 64, 4 query heads each;
    docs/benchmarks.md). Elsewhere head-major: CUDA (not measured) and CPU half types, which
    the kernel walks head by head."""
    if layout != "auto":
        return layout
    if device.type == "cpu" and dtype == torch.float32 \
            and num_kv_heads * head_dim * 4 >= TOKEN_MAJOR_MIN_RECORD:
        return "token-major"
    return "head-major"


@dataclass(frozen=True)
class PoolGeometry:
    """A pool's sizes and layout. Code indexes the pool as ``shape``, ``[layers, 2, kv_heads,
    tokens, head_dim]``, whatever the layout: token-major stores it as ``[layers, 2, tokens,
    kv_heads, head_dim]`` (a token's kv heads side by side) and ``view`` transposes; head-major
    stores ``shape`` itself. Kernels read the strides."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    layout: str = "head-major"  # serving passes pool_layout's choice

    def __post_init__(self) -> None:
        if self.layout not in LAYOUTS:
            raise ValueError(f"KV pool layout must be one of {LAYOUTS}, got {self.layout!r}")

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.num_layers, 2, self.num_kv_heads, self.num_blocks * self.block_size,
                self.head_dim)

    @property
    def storage_shape(self) -> tuple[int, int, int, int, int]:
        """The buffer's shape in memory order."""
        n, _, h, t, d = self.shape
        return (n, 2, t, h, d) if self.layout == "token-major" else (n, 2, h, t, d)

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """The pool (indexed as ``shape``) over a flat byte buffer of ``num_bytes``."""
        kv = flat.view(self.dtype).view(self.storage_shape)
        return kv.transpose(2, 3) if self.layout == "token-major" else kv

    def zeros(self, device: torch.device) -> torch.Tensor:
        """A zeroed pool of this geometry on ``device`` (the in-process engine's)."""
        return self.view(torch.zeros(self.num_bytes, dtype=torch.uint8, device=device))

    @property
    def num_bytes(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n * torch.empty((), dtype=self.dtype).element_size()

    @staticmethod
    def of(handle: PoolHandle) -> PoolGeometry:
        return PoolGeometry(handle.num_layers, handle.num_blocks, handle.block_size,
                            handle.num_kv_heads, handle.head_dim, NAME_DTYPES[handle.dtype],
                            handle.layout)


class KVTransport(Protocol):
    """Owned by one worker. ``kv`` is its own pool; peers are keyed by worker id."""

    kv: torch.Tensor

    def export(self) -> PoolHandle:
        """How peers map this worker's pool (sent once, in ``Ready``)."""
        ...

    def open(self, handle: PoolHandle) -> None:
        """Map a peer's pool (idempotent for the same handle; a new handle replaces the old)."""
        ...

    def drop(self, worker_id: int) -> None:
        """Forget a peer's mapping (the peer died or was replaced)."""
        ...

    def retain(self, worker_ids: set[int]) -> None:
        """Drop the mappings of every peer not in ``worker_ids``."""
        ...

    def copy_blocks(self, src_worker: int, src_ids: list[int], dst_ids: list[int],
                    num_tokens: int) -> None:
        """Copy the first ``num_tokens`` tokens held in the peer's blocks ``src_ids`` into this
        worker's blocks ``dst_ids`` (same order). Raises KeyError for an unmapped peer."""
        ...

    def close(self) -> None:
        """Unmap peers and release (and, for shm, unlink) this worker's own pool."""
        ...


def copy_extent_runs(src: torch.Tensor, dst: torch.Tensor, src_ids: list[int],
                     dst_ids: list[int], num_tokens: int, block_size: int) -> None:
    """Copy token ranges between two pools, one strided copy per run of blocks that are
    consecutive on both sides."""
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"block lists differ in length: {len(src_ids)} vs {len(dst_ids)}")
    if num_tokens > len(src_ids) * block_size:
        raise ValueError(f"{num_tokens} tokens do not fit in {len(src_ids)} blocks")
    i = 0
    while i < len(src_ids) and i * block_size < num_tokens:
        j = i + 1
        while (j < len(src_ids) and src_ids[j] == src_ids[j - 1] + 1
               and dst_ids[j] == dst_ids[j - 1] + 1):
            j += 1
        n = min(num_tokens, j * block_size) - i * block_size
        s, d = src_ids[i] * block_size, dst_ids[i] * block_size
        dst[:, :, :, d:d + n].copy_(src[:, :, :, s:s + n])
        i = j


def open_peers(transport: KVTransport, pools: Iterable[PoolHandle]) -> list[int]:
    """Map each peer's pool and drop the mappings of peers not listed. A pool that cannot be
    mapped is skipped, not fatal, and its worker id returned: a peer that exited unlinks its
    own pool before control sees it die, so a ``PeerPools`` may still list it (a ``Handoff``
    from it then finds no mapping and is rejected, and the request re-dispatched)."""
    pools = list(pools)
    transport.retain({p.worker_id for p in pools})
    gone = []
    for p in pools:
        try:
            transport.open(p)
        except (OSError, RuntimeError) as e:  # shm: the segment is gone; CUDA: a dead handle
            log.warning("cannot map worker %d's KV pool (%s); skipped", p.worker_id, e)
            transport.drop(p.worker_id)
            gone.append(p.worker_id)
    return gone


def make_transport(kind: str, worker_id: int, geometry: PoolGeometry, device: torch.device,
                   segment_name: str) -> KVTransport:
    """``kind`` is ``shm`` or ``cuda_ipc`` (``auto`` is resolved by the config). Fails loudly
    when the choice cannot work on this device."""
    if kind == "shm":
        if device.type != "cpu":
            raise ValueError("kv.transport = shm needs cluster.device = cpu")
        from tetri_server.kv.shm import ShmTransport

        return ShmTransport(worker_id, geometry, segment_name)
    if kind == "cuda_ipc":
        from tetri_server.kv.cuda_ipc import CudaIpcTransport

        return CudaIpcTransport(worker_id, geometry, device)
    raise ValueError(f"kv.transport must be shm or cuda_ipc, got {kind!r}")

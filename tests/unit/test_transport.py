"""KV transport contract, run over both implementations: a pool exported by another process is
mapped once and a request's blocks are copied into ours, exactly. (cuda_ipc: marked gpu.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch

from tetri_server.kv.transport import PoolGeometry, copy_extent_runs, make_transport
from tetri_server.messages import PoolHandle

PRODUCER = textwrap.dedent("""
    import sys, msgspec, torch
    from tetri_server.kv.transport import PoolGeometry, make_transport
    kind, device, name = sys.argv[1:4]
    g = PoolGeometry(2, 32, 4, 2, 8, torch.float32)
    t = make_transport(kind, 7, g, torch.device(device), name)
    t.kv.copy_(torch.arange(t.kv.numel(), dtype=torch.float32).view(g.shape))
    if device != "cpu":
        torch.cuda.synchronize()
    print(msgspec.json.encode(t.export()).decode(), flush=True)
    sys.stdin.readline()  # stay alive (owning the pool) until the consumer is done
    t.close()
""")

CASES = [
    pytest.param("shm", "cpu", id="shm"),
    pytest.param("cuda_ipc", "cuda:0", id="cuda_ipc", marks=pytest.mark.gpu),
]


@pytest.mark.parametrize(("kind", "device"), CASES)
def test_blocks_cross_processes_exactly(kind, device, tmp_path):
    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    name = f"tetri-test-{tmp_path.name}-kv"
    child = subprocess.Popen([sys.executable, "-c", PRODUCER, kind, device, name],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        handle = msgspec.json.decode(child.stdout.readline(), type=PoolHandle)
        assert handle.transport == kind and handle.worker_id == 7
        g = PoolGeometry.of(handle)
        mine = make_transport(kind, 8, g, torch.device(device), name + "-mine")
        mine.open(handle)
        mine.open(handle)  # idempotent
        src, dst, num_tokens = [5, 6, 7], [20, 21, 22], 10  # 3 blocks of 4, last one partial
        mine.copy_blocks(7, src, dst, num_tokens)
        expected = torch.arange(handle.num_layers * 2 * handle.num_kv_heads * 32 * 4 * 8,
                                dtype=torch.float32).view(g.shape)
        got = mine.kv[:, :, :, 80:80 + num_tokens].cpu()
        assert torch.equal(got, expected[:, :, :, 20:20 + num_tokens])
        assert mine.kv[:, :, :, 80 + num_tokens:].abs().sum() == 0  # nothing beyond
        mine.drop(7)
        with pytest.raises(KeyError):
            mine.copy_blocks(7, src, dst, num_tokens)
        mine.close()
    finally:
        child.stdin.write("done\n")
        child.stdin.flush()
        child.wait(30)
    assert child.returncode == 0


def test_copy_runs_split_at_gaps():
    src = torch.arange(2 * 2 * 1 * 40 * 1, dtype=torch.float32).view(2, 2, 1, 40, 1)
    dst = torch.zeros_like(src)
    copy_extent_runs(src, dst, [0, 1, 5], [2, 3, 4], 12, 4)
    assert torch.equal(dst[:, :, :, 8:16], src[:, :, :, 0:8])
    assert torch.equal(dst[:, :, :, 16:20], src[:, :, :, 20:24])


def test_transport_choice_fails_loudly():
    g = PoolGeometry(1, 4, 4, 1, 4, torch.float32)
    with pytest.raises(ValueError, match="cpu"):
        make_transport("shm", 0, g, torch.device("cuda"), "x")
    with pytest.raises(ValueError, match="shm or cuda_ipc"):
        make_transport("nccl", 0, g, torch.device("cpu"), "x")
    if not torch.cuda.is_available():
        with pytest.raises((ValueError, RuntimeError)):
            make_transport("cuda_ipc", 0, g, torch.device("cpu"), "x")


def test_a_peer_pool_already_unlinked_is_skipped_not_fatal(tmp_path):
    """A worker that exits unlinks its own pool before control sees it die, so a PeerPools
    can still list it: mapping the others must go on (it crashed the new worker), and a
    hand-off from the gone peer finds no mapping (a KeyError, which rejects the hand-off)."""
    from tetri_server.kv.transport import open_peers

    g = PoolGeometry(2, 8, 4, 2, 8, torch.float32)
    cpu = torch.device("cpu")
    alive = make_transport("shm", 1, g, cpu, f"tetri-test-alive-{tmp_path.name}")
    dead = make_transport("shm", 2, g, cpu, f"tetri-test-dead-{tmp_path.name}")
    me = make_transport("shm", 3, g, cpu, f"tetri-test-me-{tmp_path.name}")
    try:
        alive.kv.fill_(1.0)
        handles = [dead.export(), alive.export()]
        dead.close()  # unlinked, as a worker's exit does
        assert open_peers(me, handles) == [2]
        me.copy_blocks(1, [0], [0], 4)
        assert bool((me.kv[:, :, :, :4] == 1.0).all())
        with pytest.raises(KeyError):
            me.copy_blocks(2, [0], [0], 4)
    finally:
        for t in (alive, me):
            t.close()

"""KV transport contract, run over both implementations: a pool exported by another process is
mapped once and a request's blocks are copied into ours, exactly. (cuda_ipc: marked gpu.)"""

from __future__ import annotations

import dataclasses
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
    kind, device, name, layout = sys.argv[1:5]
    g = PoolGeometry(2, 32, 4, 2, 8, torch.float32, layout)
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


# (the peer's pool layout, ours): a pool is indexed alike in either, so a copy between two
# layouts is exact too
LAYOUTS = [("token-major", "token-major"), ("head-major", "head-major"),
           ("head-major", "token-major"), ("token-major", "head-major")]


@pytest.mark.parametrize(("theirs", "ours"), LAYOUTS)
@pytest.mark.parametrize(("kind", "device"), CASES)
def test_blocks_cross_processes_exactly(kind, device, theirs, ours, tmp_path):
    if device != "cpu" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    name = f"tetri-test-{tmp_path.name}-kv"
    child = subprocess.Popen([sys.executable, "-c", PRODUCER, kind, device, name, theirs],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        handle = msgspec.json.decode(child.stdout.readline(), type=PoolHandle)
        assert handle.transport == kind and handle.worker_id == 7 and handle.layout == theirs
        g = PoolGeometry.of(handle)
        assert g.layout == theirs
        mine = make_transport(kind, 8, dataclasses.replace(g, layout=ours), torch.device(device),
                              name + "-mine")
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


def test_a_token_major_pool_keeps_a_sequences_layer_in_one_run_of_memory():
    """Indexed alike in both layouts; token-major: a token's kv heads side by side, so the K of
    tokens [s, s + n) of a layer is one run of n * kv_heads * head_dim elements."""
    g = PoolGeometry(3, 8, 4, 2, 8, torch.float32, "token-major")
    kv = g.zeros(torch.device("cpu"))
    assert kv.shape == g.shape == (3, 2, 2, 32, 8) and g.storage_shape == (3, 2, 32, 2, 8)
    assert kv.stride()[2:] == (8, 16, 1)
    kv[1, 0, :, 5:9] = 1.0
    flat = kv.untyped_storage()
    ones = torch.tensor([], dtype=torch.float32).set_(flat).nonzero().flatten()
    assert ones.numel() == 4 * 2 * 8 and int(ones[-1] - ones[0]) + 1 == ones.numel()
    head = PoolGeometry(3, 8, 4, 2, 8, torch.float32, "head-major").zeros(torch.device("cpu"))
    assert head.is_contiguous() and head.shape == kv.shape
    with pytest.raises(ValueError, match="layout"):
        PoolGeometry(1, 1, 1, 1, 1, torch.float32, "auto")


@pytest.mark.parametrize(("device", "dtype", "kv_heads", "head_dim", "expected"), [
    ("cpu", torch.float32, 8, 64, "token-major"),  # the bench Llama: 2 KiB a token
    ("cpu", torch.float32, 4, 64, "token-major"),  # 1 KiB
    ("cpu", torch.float32, 2, 64, "head-major"),  # 512 bytes: slower token-major (session 56)
    ("cpu", torch.bfloat16, 8, 128, "head-major"),  # half types walk it head by head
    ("cuda", torch.float32, 8, 128, "head-major"),  # not measured on a GPU
])
def test_auto_layout(device, dtype, kv_heads, head_dim, expected):
    from tetri_server.kv.transport import pool_layout

    assert pool_layout("auto", torch.device(device), dtype, kv_heads, head_dim) == expected
    for fixed in ("token-major", "head-major"):
        assert pool_layout(fixed, torch.device(device), dtype, kv_heads, head_dim) == fixed

"""A real multi-process cluster on a tiny model (real processes, shm rings, KV pools)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tetri_server.config import load_config
from tetri_server.control.cluster import Cluster

BASE = ["predictor.kind=none", "decode.policy=greedy", "prefill.chunk_size=64",
        "kv.num_blocks=400", "cluster.workers=2", "server.request_timeout_s=60",
        "cluster.worker_start_timeout_s=120", "server.drain_timeout_s=5"]


def make_cluster(model: Path, mode: str, *extra: str) -> Cluster:
    cfg = load_config(None, [f"cluster.mode={mode}", f"model.path={model}", *BASE, *extra])
    return Cluster(cfg.resolve(cpu_count=os.cpu_count() or 1))


def segments(run_id: str) -> list[str]:
    return [n for n in os.listdir("/dev/shm") if n.startswith(run_id)]


@pytest.fixture
def tiny_llama(model_dir):
    return model_dir("llama")

"""The structured-output suite (real `openai` client) against the real multi-process cluster,
coupled and disaggregated (1 prefill + 1 decode worker): there the prefill worker samples the
first token under the grammar and the decode worker rebuilds the matcher from the hand-off and
samples the rest, so a reply that matches its schema crossed the hand-off intact."""

from __future__ import annotations

import pytest

from tests.integration.conftest import api_cluster_factory
from tests.unit.test_api_structured import *  # noqa: F403 - the same tests, another backend
from tests.unit.test_api_support import ApiHarness

pytest_plugins = ["tests.unit.test_api_support"]


def factory(mode: str):  # noqa: ANN201
    return api_cluster_factory(
        f"cluster.mode={mode}", "predictor.kind=none", "decode.policy=greedy",
        "prefill.chunk_size=64", "kv.num_blocks=400", "cluster.prefill_workers=1",
        "cluster.decode_workers=1", "cluster.workers=2", "server.request_timeout_s=120",
        "cluster.worker_start_timeout_s=120", "server.drain_timeout_s=5",
        "model.served_name=tiny-test", "model.max_model_len=256")


@pytest.fixture(scope="module", params=["coupled", "disaggregated"])
def api(request, model_dir):
    harness = ApiHarness(factory(request.param), model_dir("llama", "tiny"))
    yield harness
    harness.close()

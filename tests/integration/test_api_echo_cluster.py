"""Echo + logprobs and prompt_logprobs (what lm-eval's loglikelihood tasks send) against the
real multi-process cluster: the prefill worker computes the prompt's logprobs in its chunks."""

from __future__ import annotations

import pytest

from tests.integration.test_api_cluster import cluster_factory
from tests.unit.test_api_echo_logprobs import *  # noqa: F403 - the same tests, another backend
from tests.unit.test_api_support import ApiHarness

pytest_plugins = ["tests.unit.test_api_support"]


@pytest.fixture(scope="module")
def api(model_dir):
    harness = ApiHarness(cluster_factory, model_dir("llama", "tiny"))
    yield harness
    harness.close()

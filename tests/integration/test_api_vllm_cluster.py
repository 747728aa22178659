"""The vLLM-compatibility suite (real `openai` client) against the real multi-process cluster:
penalties, logit bias, n, stops and metrics must hold where the prefill worker samples the first
token and the decode worker the rest."""

from __future__ import annotations

import pytest

from tests.integration.test_api_cluster import cluster_factory
from tests.unit.test_api_support import ApiHarness
from tests.unit.test_api_vllm import *  # noqa: F403 - the same tests, another backend
from tests.unit.test_api_vllm import test_generation_config_supplies_defaults

pytest_plugins = ["tests.unit.test_api_support"]
del test_generation_config_supplies_defaults  # builds its own in-process backend


@pytest.fixture(scope="module")
def api(model_dir):
    harness = ApiHarness(cluster_factory, model_dir("llama", "tiny"))
    yield harness
    harness.close()

"""The real client tools against a live `tetri-server serve` (docs/clients.md): lm-eval's
local-completions on a loglikelihood and a generation task, `vllm bench serve --backend
openai-chat --model PATH` without a tokenizer flag, guidellm. Each lives in its own venv (they
would replace .venv's pinned torch); a test skips itself when its tool is not installed: set
LM_EVAL / VLLM / GUIDELLM to the executables, or install them where docs/clients.md says."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.integration.conftest import start_server

ROOT = Path(__file__).resolve().parents[2]
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1"}


def tool(env_name: str, default: str) -> str:
    path = os.environ.get(env_name) or default
    if not (shutil.which(path) or os.access(path, os.X_OK)):
        pytest.skip(f"{path} is not installed (docs/clients.md)")
    return path


@pytest.fixture(scope="module")
def server(tmp_path_factory, model_dir):
    """(base URL, model folder): the tiny model served by its absolute path."""
    folder = str(model_dir("llama", "tiny"))
    proc, url = start_server(tmp_path_factory.mktemp("serve"), argv=(folder,))
    yield url, folder
    proc.terminate()
    proc.wait(60)


def run(args: list[str], cwd: Path, timeout_s: float = 300) -> str:
    out = subprocess.run(args, cwd=cwd, env={**os.environ, **OFFLINE}, capture_output=True,
                         text=True, timeout=timeout_s)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out.stdout + out.stderr


def test_lm_eval_loglikelihood_and_generation_tasks(server, tmp_path) -> None:
    lm_eval = tool("LM_EVAL", "/tmp/lmeval-venv/bin/lm_eval")
    url, folder = server
    args = (f"model={folder},base_url={url}/v1/completions,tokenizer={folder},"
            "tokenizer_backend=huggingface,num_concurrent=2,max_retries=1")
    run([lm_eval, "run", "--model", "local-completions", "--model_args", args,
         "--batch_size", "4", "--include_path", "tools/lmeval_tasks",
         "--tasks", "tetri_mc", "tetri_gen", "--limit", "4", "--output_path", str(tmp_path)],
        ROOT)
    results = json.loads(next(tmp_path.rglob("results_*.json")).read_text())["results"]
    assert 0 <= results["tetri_mc"]["acc,none"] <= 1
    assert 0 <= results["tetri_gen"]["exact_match,none"] <= 1


def test_vllm_bench_serve_openai_chat_with_the_model_path(server, tmp_path) -> None:
    vllm = tool("VLLM", "/tmp/vllm-peer/bin/vllm")
    url, folder = server
    run([vllm, "bench", "serve", "--backend", "openai-chat", "--base-url", url,
         "--endpoint", "/v1/chat/completions", "--model", folder, "--dataset-name", "random",
         "--random-input-len", "32", "--random-output-len", "8", "--num-prompts", "8",
         "--request-rate", "4", "--seed", "0", "--ignore-eos", "--save-result",
         "--result-dir", str(tmp_path), "--result-filename", "r.json"], tmp_path)
    result = json.loads((tmp_path / "r.json").read_text())
    assert result["completed"] == 8 and result.get("failed", 0) == 0
    assert result["total_output_tokens"] == 8 * 8


def test_guidellm_constant_rate(server, tmp_path) -> None:
    guidellm = tool("GUIDELLM", "/tmp/guidellm-venv/bin/guidellm")
    url, folder = server
    out = tmp_path / "g.json"
    run([guidellm, "run", "--backend", f"kind=openai_http,target={url},model={folder}",
         "--profile", "kind=constant,rate=2", "--constraint", "kind=max_requests,count=6",
         "--data", "kind=synthetic_text,prompt_tokens=32,output_tokens=8",
         "--seed", "kind=static,value=0", "--output", f"kind=json,path={out}",
         "--disable-progress"], tmp_path)
    requests = json.loads(out.read_text())["benchmarks"][0]["requests"]
    assert len(requests["successful"]) == 6
    assert requests["errored"] == [] and requests["incomplete"] == []

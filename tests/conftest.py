"""Shared fixtures: tiny random-weight checkpoints made locally (no download) and HF references."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import uvloop


def pytest_asyncio_loop_factories(config, item):  # noqa: ARG001 - pytest-asyncio hook
    return {"uvloop": uvloop.new_event_loop}


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    """model_dir(family, **overrides) -> folder of a tiny checkpoint (made once per session)."""
    from tetri_server.modelmaker import make_model

    root = tmp_path_factory.mktemp("models")
    made: dict[str, Path] = {}

    def get(family: str = "llama", size: str = "tiny", **overrides) -> Path:
        key = f"{family}-{size}-" + "-".join(f"{k}={overrides[k]}" for k in sorted(overrides))
        if key not in made:
            made[key] = make_model(root / str(len(made)), family, size, seed=0, **overrides)
        return made[key]

    return get


def random_prompts(n: int, vocab: int, lengths: tuple[int, int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers generate(), greedy, EOS ignored: the reference our engine must equal."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    out = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 eos_token_id=None, pad_token_id=0)
            out.append(gen[0, len(p):].tolist())
    return out

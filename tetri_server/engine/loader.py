"""Load a local Hugging Face checkpoint folder (config.json + safetensors) into our model code.
Never downloads: the path must be a folder on disk."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from tetri_server.engine.llama import LlamaModel
from tetri_server.engine.opt import OPTModel
from tetri_server.engine.spec import LLAMA_FAMILY, ModelSpec, spec_from_hf_config
from tetri_server.modelinfo import resolve_model_path

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
CausalLM = LlamaModel | OPTModel


def load_hf_config(path: Path) -> object:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path), local_files_only=True)


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = [f.name for f in sorted(path.glob("*.safetensors"))]
    if files:
        weights: dict[str, torch.Tensor] = {}
        for f in files:
            weights.update(load_file(str(path / f)))
        return weights
    bins = sorted(path.glob("pytorch_model*.bin"))
    if not bins:
        raise FileNotFoundError(f"no *.safetensors or pytorch_model*.bin in {path}")
    weights = {}
    for f in bins:
        weights.update(torch.load(f, map_location="cpu", weights_only=True))
    return weights


def load_model(path: str | Path, dtype: str = "float32",
               device: str | torch.device = "cpu") -> tuple[CausalLM, ModelSpec]:
    folder = resolve_model_path(str(path))
    hf = load_hf_config(folder)
    spec = spec_from_hf_config(hf)
    if dtype not in DTYPES:
        raise ValueError(f"model.dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    dev = torch.device(device)
    cls = LlamaModel if spec.family in LLAMA_FAMILY else OPTModel
    model = cls(spec, hf, DTYPES[dtype], dev)
    model.load_weights(read_weights(folder))
    model.eval()
    return model, spec

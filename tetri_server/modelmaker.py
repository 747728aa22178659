"""Make small random-weight Hugging Face checkpoints, since no model can be downloaded.

`make_model(out_dir, family, size, seed)` writes config.json, model.safetensors,
generation_config.json and the shipped byte-level BPE tokenizer (assets/tokenizer, trained on
the Arena texts by tools/train_tokenizer.py). `builtin_model_path("tiny")` is what the server
resolves `builtin:tiny` to: a cached folder made on first use.

Weights are a pure function of (family, size, seed, config): every parameter is drawn in sorted
name order from one seeded generator, so the same arguments give byte-identical files. The
scale is large for a random model on purpose: greedy decoding then has clear top-1/top-2 logit
margins, so a reimplemented forward that is numerically close picks the same tokens. Biases and
norm gains are random too (not 0 and 1), so a runner that forgets one of them is caught.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import tempfile
import uuid
from pathlib import Path
from typing import Any

FAMILIES = ("llama", "qwen2", "mistral", "opt")
SIZES = ("tiny", "bench")
TOKENIZER_DIR = Path(__file__).resolve().parent / "assets" / "tokenizer"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
STAMP_FILE = "tetri_model.json"
# Bump when the weights or config a given (family, size, seed) produces change: cached builtin
# models with another version are remade.
MAKER_VERSION = 1
NORM_GAIN_STD = 0.1  # norm weights are 1 + N(0, NORM_GAIN_STD)

# Llama, Qwen2 and Mistral share one shape. tiny ties embeddings and uses GQA; bench does
# neither, so both lm_head paths and both attention layouts are exercised.
_LLAMA_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        initializer_range=0.15,
        tie_word_embeddings=True,
    ),
    "bench": dict(
        hidden_size=512,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        intermediate_size=1408,
        initializer_range=0.05,
        tie_word_embeddings=False,
    ),
}
_OPT_SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, ffn_dim=128, init_std=0.15
    ),
    "bench": dict(
        hidden_size=512, num_hidden_layers=8, num_attention_heads=8, ffn_dim=2048, init_std=0.05
    ),
}


def _check(family: str, size: str) -> None:
    if family not in FAMILIES:
        raise ValueError(f"unknown model family {family!r}; expected one of {FAMILIES}")
    if size not in SIZES:
        raise ValueError(f"unknown model size {size!r}; expected one of {SIZES}")


def _tokenizer_ids() -> dict[str, int]:
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(TOKENIZER_DIR / "tokenizer.json"))
    ids = {"vocab": tok.get_vocab_size(with_added_tokens=True)}
    for name, token in (("bos", "<s>"), ("eos", "</s>"), ("pad", "<pad>")):
        token_id = tok.token_to_id(token)
        if token_id is None:
            raise ValueError(f"shipped tokenizer lacks {token}")
        ids[name] = token_id
    return ids


def build_config(family: str = "llama", size: str = "tiny", **overrides: Any) -> Any:
    """The transformers config for (family, size); overrides win (e.g. rope_scaling)."""
    from transformers import LlamaConfig, MistralConfig, OPTConfig, Qwen2Config

    _check(family, size)
    ids = _tokenizer_ids()
    common: dict[str, Any] = dict(
        vocab_size=ids["vocab"],
        max_position_embeddings=2048,
        bos_token_id=ids["bos"],
        eos_token_id=ids["eos"],
        pad_token_id=ids["pad"],
    )
    if family == "opt":
        kwargs = {**common, **_OPT_SHAPES[size], "dropout": 0.0, "tie_word_embeddings": True}
        return OPTConfig(**{**kwargs, **overrides})
    classes = {"llama": LlamaConfig, "qwen2": Qwen2Config, "mistral": MistralConfig}
    kwargs = {**common, **_LLAMA_SHAPES[size], "rms_norm_eps": 1e-6}
    return classes[family](**{**kwargs, **overrides})


def _init_std(config: Any) -> float:
    return float(config.init_std if config.model_type == "opt" else config.initializer_range)


def _randomize(model: Any, std: float, seed: int) -> None:
    """Matrices and biases ~ N(0, std); 1-D weights (norm gains) ~ 1 + N(0, NORM_GAIN_STD)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):  # tied weights appear once
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if param.ndim >= 2 or name.endswith("bias"):
                param.copy_(noise * std)
            else:
                param.copy_(1.0 + noise * NORM_GAIN_STD)


def make_model(
    out_dir: str | os.PathLike[str],
    family: str = "llama",
    size: str = "tiny",
    seed: int = 0,
    **config_overrides: Any,
) -> Path:
    """Write a random-weight HF checkpoint folder (fp32 safetensors + tokenizer) to out_dir."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    config = build_config(family, size, **config_overrides)
    with torch.random.fork_rng(devices=[]):  # the caller's global RNG is left untouched
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
    _randomize(model, _init_std(config), seed)
    model.eval()
    model.generation_config = GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    for name in TOKENIZER_FILES:
        shutil.copyfile(TOKENIZER_DIR / name, out / name)
    return out


def count_parameters(model_dir: str | os.PathLike[str]) -> int:
    """Stored parameters (tied weights once), read from the safetensors header only."""
    with open(Path(model_dir) / "model.safetensors", "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(header_len))
    total = 0
    for name, info in header.items():
        if name != "__metadata__":
            numel = 1
            for dim in info["shape"]:
                numel *= dim
            total += numel
    return total


def parse_builtin(name: str) -> tuple[str, str]:
    """'tiny', 'builtin:tiny', 'opt-bench', 'builtin:qwen2-tiny' -> (family, size)."""
    spec = name.removeprefix("builtin:")
    family, _, size = spec.rpartition("-")
    family = family or "llama"
    _check(family, size)
    return family, size


def _stamp(family: str, size: str) -> dict[str, Any]:
    import hashlib

    digest = hashlib.sha256()
    for file in TOKENIZER_FILES:
        digest.update((TOKENIZER_DIR / file).read_bytes())
    return dict(
        maker_version=MAKER_VERSION,
        family=family,
        size=size,
        seed=0,
        tokenizer_sha256=digest.hexdigest(),
    )


def _read_stamp(folder: Path) -> dict[str, Any] | None:
    try:
        return json.loads((folder / STAMP_FILE).read_text())
    except (OSError, ValueError):
        return None


def default_cache_dir() -> Path:
    env = os.environ.get("TETRI_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "tetri_server" / "models"


def builtin_model_path(name: str = "tiny", cache_dir: str | os.PathLike[str] | None = None) -> Path:
    """Folder of the builtin model `name`, made on first use.

    Safe under concurrent callers: each makes its model in a private temp folder and renames it
    into place; a loser of the rename race uses the winner's (identical) folder. A folder with a
    stale stamp (older maker or tokenizer) is moved aside and replaced.
    """
    family, size = parse_builtin(name)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    final = root / f"{family}-{size}-seed0"
    stamp = _stamp(family, size)
    if _read_stamp(final) == stamp:
        return final
    root.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=root))
    try:
        make_model(tmp, family, size, seed=0)
        (tmp / STAMP_FILE).write_text(json.dumps(stamp, indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any other
        for _ in range(3):
            try:
                os.rename(tmp, final)  # atomic; fails if final exists and is not empty
                return final
            except OSError:
                if _read_stamp(final) == stamp:
                    return final  # another process won the race
                stale = root / f".{final.name}.stale-{uuid.uuid4().hex[:8]}"
                try:
                    os.rename(final, stale)
                except FileNotFoundError:
                    continue
                shutil.rmtree(stale, ignore_errors=True)
        raise RuntimeError(f"could not install builtin model at {final}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

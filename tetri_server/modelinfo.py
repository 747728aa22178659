"""What the control process needs to know about a checkpoint, read without torch (the control
process never imports it): where the folder is, its limits and its tokenizer."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("tetri.model")


def resolve_model_path(path: str) -> Path:
    """``builtin:<size>`` -> the cached made-on-first-use model; otherwise a local folder."""
    if path.startswith("builtin:"):
        from tetri_server.modelmaker import builtin_model_path

        return builtin_model_path(path.removeprefix("builtin:"))
    p = Path(path).expanduser()
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model.path {path!r} is not a checkpoint folder "
                                "(no config.json); models are never downloaded")
    return p


def rope_context(max_position_embeddings: int, rope: Mapping[str, Any] | None) -> int:
    """The model's context length: its positions, times the factor of a static RoPE scaling
    (``linear``; ``yarn`` over its ``original_max_position_embeddings``), as vLLM derives it
    (``llama3`` and the others keep the positions). A checkpoint extended by linear scaling
    (4,096 positions x 4) serves 16,384 tokens."""
    rope = rope or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    factor = rope.get("factor")
    if kind not in ("linear", "yarn") or not isinstance(factor, int | float) or factor <= 1:
        return max_position_embeddings
    base = max_position_embeddings
    if kind == "yarn":
        base = int(rope.get("original_max_position_embeddings") or base)
    return max(max_position_embeddings, int(base * factor))


def serving_max_model_len(configured: int, max_position_embeddings: int) -> int:
    """The context length served: ``configured`` (0 = the model's), never above the model's
    positions: more is refused (``ConfigError``), as vLLM refuses it, rather than lowered
    behind the user's back. The one rule for the control process, the workers and the engine;
    a sliding window does not shorten it (attention applies the window)."""
    if configured > max_position_embeddings:
        from tetri_server.config import ConfigError

        raise ConfigError(f"model.max_model_len = {configured} is more than the model's "
                          f"context ({max_position_embeddings} positions, RoPE scaling "
                          "included); leave it 0 for the model's, or set at most that")
    return configured or max_position_embeddings


# What transformers' config classes default to when config.json leaves a field out (the
# workers read the checkpoint through them): (max_position_embeddings, vocab_size, eos_token_id)
CONFIG_DEFAULTS: dict[str, tuple[int, int, int | None]] = {
    "llama": (2048, 32000, 2), "mistral": (131072, 32000, 2), "qwen2": (32768, 151936, None),
    "opt": (2048, 50272, 2),
}


@dataclass(frozen=True)
class ModelLimits:
    max_position_embeddings: int
    vocab_size: int  # rows of the embedding: larger token ids are refused
    eos_token_ids: tuple[int, ...]

    def max_model_len(self, configured: int = 0) -> int:
        return serving_max_model_len(configured, self.max_position_embeddings)


def read_limits(folder: Path) -> ModelLimits:
    """From ``config.json`` (the same fields ``engine.spec`` reads, without transformers)."""
    cfg: dict[str, Any] = json.loads((folder / "config.json").read_text())
    cfg = {**cfg.get("text_config", {}), **cfg}
    positions_default, vocab_default, eos_default = CONFIG_DEFAULTS.get(
        cfg.get("model_type", ""), (0, 0, None))
    eos = cfg.get("eos_token_id", eos_default)
    eos_ids = () if eos is None else tuple(eos) if isinstance(eos, list) else (int(eos),)
    # as transformers standardises it for the workers: rope_scaling first, and yarn's base
    # context from that dict alone (a top-level original_max_position_embeddings is not read)
    rope = dict(cfg.get("rope_scaling") or cfg.get("rope_parameters") or {})
    from tetri_server.config import ConfigError  # a one-line error at start-up

    try:
        positions = int(cfg.get("max_position_embeddings") or positions_default or 0)
        vocab = int(cfg.get("vocab_size") or vocab_default or 0)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{folder / 'config.json'}: {exc}") from None
    if not positions or not vocab:
        missing = "max_position_embeddings" if not positions else "vocab_size"
        raise ConfigError(f"{folder / 'config.json'} has no {missing}, and model_type "
                          f"{cfg.get('model_type')!r} has no default for it")
    return ModelLimits(rope_context(positions, rope), vocab, eos_ids)


def checkpoint_dtype(folder: Path) -> str | None:
    """The dtype ``config.json`` says the weights are (``torch_dtype``; transformers 5:
    ``dtype``), or None."""
    try:
        cfg: dict[str, Any] = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    cfg = {**cfg.get("text_config", {}), **cfg}
    value = cfg.get("torch_dtype") or cfg.get("dtype")
    return value if isinstance(value, str) else None


def load_tokenizer(folder: Path) -> Any:
    """The checkpoint's tokenizer. A fast tokenizer (``tokenizer.json``) loads without torch;
    only a checkpoint with a slow tokenizer alone needs ``AutoTokenizer`` (which imports it)."""
    if (folder / "tokenizer.json").is_file():
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(folder), local_files_only=True)
    log.warning("%s has no tokenizer.json: loading a slow tokenizer (imports torch)", folder)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)

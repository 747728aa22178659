"""The served model as clients see it: its names, its folder, its default sampling.

``/v1/models`` lists ``names`` (``served_name`` first, then ``served_aliases``) with ``root`` =
the model folder, as vLLM does (``vllm bench serve`` loads its tokenizer from ``root``).
Requests may also name the model by the path it was given as (relative or absolute) or by
that path's folder name.

``generation_config.json`` in the folder supplies the default sampling a request omits
(vLLM's ``--generation-config auto``): temperature, top_p, top_k, min_p, repetition_penalty,
``max_new_tokens`` as a cap on the default ``max_tokens``, and ``eos_token_id`` (one or a list)
as stop token ids of every request that does not set ``ignore_eos``.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any

from tetri_server.api.errors import APIError
from tetri_server.api.fields import Fields, is_int
from tetri_server.config import BUILTIN_PREFIX, ConfigError, ModelConfig


@dataclass(frozen=True)
class GenerationDefaults:
    """Sampling defaults from generation_config.json; None = the OpenAI default."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None  # from max_new_tokens: caps the default max_tokens
    eos_token_ids: tuple[int, ...] = ()  # eos_token_id (int or list): stop ids unless ignore_eos

    # generation_config key -> (field, low, high); bounds as the API checks requests
    KEYS = {
        "temperature": ("temperature", 0.0, math.inf),
        "top_p": ("top_p", 1e-9, 1.0),
        "top_k": ("top_k", -1, 1 << 31),
        "min_p": ("min_p", 0.0, 1.0),
        "repetition_penalty": ("repetition_penalty", 1e-9, math.inf),
        "max_new_tokens": ("max_tokens", 1, 1 << 31),
    }

    @classmethod
    def read(cls, folder: str | Path) -> GenerationDefaults:
        """The defaults in ``folder/generation_config.json`` (none: all None). A value of the
        wrong type or range is a ``ConfigError`` naming the file and key."""
        path = Path(folder) / "generation_config.json"
        if not path.is_file():
            return cls()
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise ConfigError(f"{path}: cannot read it: {e}") from None
        if not isinstance(data, dict):
            raise ConfigError(f"{path}: expected a JSON object")
        values: dict[str, Any] = {}
        for key, (name, low, high) in cls.KEYS.items():
            value = data.get(key)
            if value is None:
                continue
            integral = name in ("top_k", "max_tokens")
            ok = is_int(value) if integral else (
                isinstance(value, int | float) and not isinstance(value, bool))
            if not ok or not low <= value <= high:
                raise ConfigError(f"{path}: {key} = {value!r} is invalid")
            values[name] = int(value) if integral else float(value)
        eos = data.get("eos_token_id")
        eos_list = [eos] if is_int(eos) else eos if isinstance(eos, list) else []
        if eos is not None and (not eos_list or not all(is_int(i) and i >= 0 for i in eos_list)):
            raise ConfigError(f"{path}: eos_token_id = {eos!r} is invalid")
        return cls(**values, eos_token_ids=tuple(eos_list))


def _folder_name(path: str) -> str:
    if path.startswith(BUILTIN_PREFIX):
        return path.removeprefix(BUILTIN_PREFIX)
    return PurePath(path.rstrip("/\\")).name or path


@dataclass(frozen=True)
class ServedModel:
    """What the API says about the model and which names it accepts. Built once at start-up."""

    names: tuple[str, ...]  # /v1/models ids; names[0] is the backend's model_name
    root: str  # the model folder (absolute)
    defaults: GenerationDefaults = field(default_factory=GenerationDefaults)
    accepted: frozenset[str] = frozenset()  # names plus the path given and folder names
    tool_call_parser: str = "none"  # model.tool_call_parser

    @classmethod
    def from_config(
        cls, model: ModelConfig, served_name: str, *, root: str, given_path: str | None = None
    ) -> ServedModel:
        """``served_name``: the backend's model_name; ``root``: the folder it loaded; reads
        generation_config.json there: its sampling defaults unless
        ``model.use_generation_config`` is false, its eos ids always (as vLLM's
        ``--generation-config vllm``: they end the model's text, they are no default)."""
        names = tuple(dict.fromkeys((served_name, *model.served_aliases)))
        given = given_path or model.path
        if os.path.isdir(root):  # a client started in another folder loads its tokenizer here
            root = os.path.abspath(root)
        others = {given, _folder_name(given), model.path, _folder_name(model.path), root,
                  _folder_name(root)}
        # the folder as an absolute path too (a client started elsewhere, e.g. guidellm's
        # model=/abs/models/x for a server started as `serve models/x`); no file access
        others |= {os.path.abspath(p) for p in (given, model.path, root)
                   if p and not p.startswith(BUILTIN_PREFIX)}
        defaults = GenerationDefaults.read(root)
        if not model.use_generation_config:
            defaults = GenerationDefaults(eos_token_ids=defaults.eos_token_ids)
        return cls(names, root, defaults,
                   frozenset(names) | {n for n in others if n}, model.tool_call_parser)

    def check(self, f: Fields) -> str:
        """The model a request names, as the response names it: the name it sent (any of the
        served names, aliases or the folder; vLLM echoes it), or, missing or empty, the first
        served name."""
        model = f.string("model", None)
        if model and model not in self.accepted:
            raise APIError(
                f"the model '{model}' does not exist; this server serves '{self.names[0]}'",
                status=404,
                param="model",
                code="model_not_found",
            )
        return model or self.names[0]

    def card(self, name: str, created: int, max_model_len: int) -> dict[str, object]:
        return {
            "id": name,
            "object": "model",
            "created": created,
            "owned_by": "tetri_server",
            "root": self.root,
            "parent": None,
            "max_model_len": max_model_len,
        }

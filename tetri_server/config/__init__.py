"""config.toml -> frozen, validated dataclasses, resolved once at start-up.

Each ``[section]`` of ``config.toml`` maps one-to-one onto a frozen dataclass below and each key
onto one field with the same name. ``__post_init__`` only validates (single fields in the
section classes, cross-field rules in ``Config.__post_init__``); nothing here does I/O except
``load_config`` reading the file it is given and the secrets in the environment.

``Config.resolve(cpu_count=...)`` returns a new ``Config`` with every ``auto``/0 value that can
be decided from the config alone made concrete:

    model.dtype = auto              -> float32 on cpu, bfloat16 on cuda (float16 weights: float16)
    model.served_name = ""          -> folder name of model.path (``builtin:NAME`` -> NAME)
    kv.transport = auto             -> shm on cpu, cuda_ipc on cuda
    cluster.elastic = auto          -> on on cpu, off on cuda; off -> prefill.local_decode_batch
                                       = decode.local_prefill_tokens = 0 (the strict split)
    cluster.threads_per_worker = 0  -> max(1, cpu_count // number of workers)

Values that need the model or the device stay as they are for the runtime to resolve:
``model.max_model_len = 0`` (from the checkpoint's config.json, by the control process),
``prefill.chunk_size = 0`` (calibrated by each prefill worker at start-up) and
``kv.num_blocks = 0`` (sized by each worker from ``kv.memory_gb`` / ``kv.memory_fraction``).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePath
from typing import Any, Literal, get_args, get_origin

from tetri_server.config.scheduling import (  # noqa: F401 - re-exported
    DecodeConfig,
    DecodePolicyName,
    PrefillConfig,
    PrefillPolicyName,
)
from tetri_server.config.sections import (  # noqa: F401 - re-exported
    BUILTIN_PREFIX,
    ClusterConfig,
    ConfigError,
    Device,
    DispatchConfig,
    DispatchPolicyName,
    DType,
    Elastic,
    FlipConfig,
    KVConfig,
    LogLevel,
    Mode,
    ModelConfig,
    MonitorConfig,
    PredictorConfig,
    PredictorKind,
    ServerConfig,
    ToolCallParser,
    Transport,
    _Section,
)


@dataclass(frozen=True, kw_only=True)
class Config:
    """The whole server configuration; one field per ``config.toml`` section."""

    server: ServerConfig = field(default_factory=ServerConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    kv: KVConfig = field(default_factory=KVConfig)
    prefill: PrefillConfig = field(default_factory=PrefillConfig)
    decode: DecodeConfig = field(default_factory=DecodeConfig)
    predictor: PredictorConfig = field(default_factory=PredictorConfig)
    dispatch: DispatchConfig = field(default_factory=DispatchConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    flip: FlipConfig = field(default_factory=FlipConfig)

    def __post_init__(self) -> None:
        """Cross-field rules, all in one place."""
        c, kv = self.cluster, self.kv
        if c.mode == "disaggregated" and (c.prefill_workers < 1 or c.decode_workers < 1):
            raise ConfigError(
                "cluster.mode = disaggregated needs cluster.prefill_workers >= 1 and "
                f"cluster.decode_workers >= 1 (got {c.prefill_workers} and {c.decode_workers})"
            )
        if kv.transport == "cuda_ipc" and c.device != "cuda":
            raise ConfigError("kv.transport = cuda_ipc requires cluster.device = cuda")
        if kv.transport == "shm" and c.device != "cpu":
            raise ConfigError("kv.transport = shm requires cluster.device = cpu")
        if c.mode == "disaggregated" and self.elastic_on and self.prefill.chunk_size == 0:
            from tetri_server.policy.elastic import calibration_rows
            from tetri_server.policy.knee import CALIBRATION_SIZES

            p = self.prefill
            rows = calibration_rows(p.local_decode_batch, p.local_decode_chunk,
                                    p.local_decode_full_chunk_backlog,
                                    p.local_decode_full_chunk_share)
            if rows >= CALIBRATION_SIZES[-1]:
                raise ConfigError(
                    f"prefill.chunk_size = 0 calibrates the chunk over passes of up to "
                    f"{CALIBRATION_SIZES[-1]} tokens with prefill.local_decode_batch = {rows} "
                    "decode rows riding in each: none has room for prompt tokens; set "
                    "prefill.chunk_size, or a smaller local_decode_batch"
                )
        if self.flip.enabled:
            if c.mode != "disaggregated":
                raise ConfigError("flip.enabled = true requires cluster.mode = disaggregated")
            if c.num_workers < 3:
                raise ConfigError(
                    "flip.enabled = true needs at least 3 workers (prefill_workers + "
                    "decode_workers), since one prefill and one decode worker always remain"
                )
        if self.model.batch_invariant and (c.device != "cpu"
                                           or self.model.dtype not in ("auto", "float32")):
            raise ConfigError("model.batch_invariant = true needs cluster.device = cpu and "
                              f"model.dtype = float32 (got {c.device} and {self.model.dtype})")
        if (c.mode == "disaggregated" and self.decode.policy != "greedy"
                and self.predictor.kind == "none"):  # coupled workers admit greedily
            raise ConfigError(
                f"decode.policy = {self.decode.policy} needs a length prediction; set "
                "predictor.kind to classifier or oracle, or decode.policy to greedy"
            )

    def resolve(self, *, cpu_count: int, checkpoint_dtype: str | None = None) -> Config:
        """Return a copy with every auto/0 value decidable without I/O made concrete.

        ``cpu_count`` is the number of usable cores (pass ``len(os.sched_getaffinity(0))``).
        ``checkpoint_dtype``: the model's ``torch_dtype`` (``modelinfo.checkpoint_dtype``):
        ``model.dtype = auto`` on cuda keeps a float16 checkpoint in float16, as vLLM does
        (bfloat16 otherwise; float32 on cpu). Idempotent. See the module docstring for what
        stays for the runtime.
        """
        c = self.cluster
        dtype = self.model.dtype
        if dtype == "auto":
            if c.device != "cuda":
                dtype = "float32"
            else:
                dtype = "float16" if checkpoint_dtype == "float16" else "bfloat16"
        served_name = self.model.served_name or _default_served_name(self.model.path)
        transport = self.kv.transport
        if transport == "auto":
            transport = "cuda_ipc" if c.device == "cuda" else "shm"
        threads = c.threads_per_worker or max(1, cpu_count // c.num_workers)
        prefill, decode = self.prefill, self.decode
        if not self.elastic_on:
            prefill = dataclasses.replace(prefill, local_decode_batch=0)
            decode = dataclasses.replace(decode, local_prefill_tokens=0)
        return dataclasses.replace(
            self,
            model=dataclasses.replace(self.model, dtype=dtype, served_name=served_name),
            kv=dataclasses.replace(self.kv, transport=transport),
            cluster=dataclasses.replace(c, threads_per_worker=threads,
                                        elastic="on" if self.elastic_on else "off"),
            prefill=prefill,
            decode=decode,
        )

    def split_overrides(self) -> list[str]:
        """The prefill / decode keys that ``resolve`` changes because ``cluster.elastic``
        decides the strict split (off, or auto on cuda), where this config gives them a value
        other than their default: for a warning at start-up, since the user may have meant
        them. Read off ``resolve`` itself, so the split's keys are named in one place."""
        if self.elastic_on or self.cluster.mode != "disaggregated":
            return []
        mine, split, default = (c.to_dict() for c in (self, self.resolve(cpu_count=1), Config()))
        return [f"{sec}.{key} = {value}" for sec in ("prefill", "decode")
                for key, value in mine[sec].items()
                if value != split[sec][key] and value != default[sec][key]]

    @property
    def elastic_on(self) -> bool:
        """``cluster.elastic`` decided: auto is on on cpu, off (the strict split) on cuda."""
        e = self.cluster.elastic
        return e == "on" or (e == "auto" and self.cluster.device != "cuda")

    def to_dict(self, *, redact: bool = True) -> dict[str, dict[str, Any]]:
        """``{section: {key: value}}``, the shape of config.toml; JSON- and TOML-safe.

        ``redact`` replaces each set secret (``ServerConfig.SECRETS``: the api keys) with
        ``"<redacted>"`` (for result files).
        """
        data = dataclasses.asdict(self)
        for key in ServerConfig.SECRETS if redact else ():
            if data["server"][key]:
                data["server"][key] = "<redacted>"
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any], *, source: str = "config") -> Config:
        """Build from ``{section: {key: value}}``; missing keys take their defaults.

        Unknown sections or keys and values of the wrong type raise ``ConfigError``
        naming ``source`` and the key.
        """
        sections: dict[str, Any] = {}
        for name, values in data.items():
            section_cls = _section_class(name, source)
            if not isinstance(values, dict):
                raise ConfigError(f"{source}: [{name}] must be a table of keys")
            hints = typing.get_type_hints(section_cls)
            for key, value in values.items():
                _check_key(section_cls, name, key, source)
                _check_type(f"{name}.{key}", value, hints[key], source)
            kwargs = {k: _coerce(v, hints[k]) for k, v in values.items()}
            try:
                sections[name] = section_cls(**kwargs)
            except ConfigError as e:
                raise ConfigError(f"{source}: {e}") from None
        try:
            return cls(**sections)
        except ConfigError as e:
            raise ConfigError(f"{source}: {e}") from None


def load_config(
    path: str | Path | None,
    overrides: list[str] | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    flags: Mapping[str, Mapping[str, Any]] | None = None,
) -> Config:
    """Read ``path`` (None = built-in defaults, equal to the shipped config.toml), apply the
    secrets set in ``environ`` (None = ``os.environ``; ``ServerConfig.ENV_KEYS``), then
    ``flags`` (``{section: {key: value}}``: the CLI's named options such as ``--port``), then
    the ``--set section.key=value`` overrides in order, validate, and return the (unresolved)
    Config. Precedence, lowest first: file < environment < flags < ``--set``.

    An override's value is parsed as a TOML literal when it parses (``8001``, ``true``,
    ``0.5``, ``"x"``), else taken as a string; string and choice keys take the text as is
    (a quoted TOML string is unquoted).
    """
    data: dict[str, Any] = {}
    source = "config" if path is None else str(path)
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError(f"config file not found: {path}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
    env = os.environ if environ is None else environ
    # where server.api_key came from last: "file", a variable, "flags" or "--set"
    # (the shipped file's ``api_key = ""`` sets no key)
    key_source = "file" if (data.get("server") or {}).get("api_key") else None
    for var, key in ServerConfig.ENV_KEYS.items():
        if env.get(var):
            _table(data, "server", source)[key] = env[var]
            if key == "api_key":
                key_source = var if key_source != "file" else "file"
    for section, values in (flags or {}).items():
        _section_class(section, "flags")
        _table(data, section, source).update(values)
        if section == "server" and "api_key" in values:
            key_source = "flags"
    deferred: list[tuple[str, ConfigError]] = []  # --set refused alone: fine beside others?
    for item in overrides or []:
        section, key, value, error = _parse_override(item)
        _table(data, section, source)[key] = value
        if (section, key) == ("server", "api_key"):
            key_source = "--set"
        if error is not None:
            deferred.append((key, error))
    server = data.get("server")
    if key_source == "VLLM_API_KEY" and isinstance(server, dict) and server.get("api_key_file"):
        # vLLM's variable alone, left in a shared environment, beside our own key file: the
        # file is the more specific choice (a client with the other key is refused, not let
        # in). A key the file, TETRI_API_KEY, --api-key or --set gave is still a conflict.
        del server["api_key"]
        logging.getLogger("tetri.config").warning(
            "VLLM_API_KEY is ignored: server.api_key_file sets the API key")
    try:
        return Config.from_dict(data, source=source)
    except ConfigError as e:
        for key, error in deferred:  # name the --set the error is about, not the file
            if key in str(e):
                raise error from None
        raise


def _table(data: dict[str, Any], section: str, source: str) -> dict[str, Any]:
    table = data.setdefault(section, {})
    if not isinstance(table, dict):
        raise ConfigError(f"{source}: [{section}] must be a table of keys")
    return table


def _parse_override(item: str) -> tuple[str, str, Any, ConfigError | None]:
    """(section, key, value, the error of the key's section built with it alone or None). A
    wrong name or type raises here; a rule error is returned, since a rule may tie two keys
    that other overrides set (``monitor.max_step_s`` and ``stall_timeout_s``)."""
    source = f"--set {item!r}"
    name, sep, text = item.partition("=")
    parts = name.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"{source}: expected section.key=value")
    section, key = parts
    section_cls = _section_class(section, source)
    _check_key(section_cls, section, key, source)
    hint = typing.get_type_hints(section_cls)[key]
    text = text.strip()
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        value = text
    if (hint is str or get_origin(hint) is Literal) and not isinstance(value, str):
        value = text
    _check_type(f"{section}.{key}", value, hint, source)
    try:  # per-field rules now, so the error names the --set; all rules run at the end
        section_cls(**{key: _coerce(value, hint)})
    except ConfigError as e:
        return section, key, value, ConfigError(f"{source}: {e}")
    return section, key, value, None


def _sections() -> dict[str, type[_Section]]:
    return typing.get_type_hints(Config)


def _section_class(name: str, source: str) -> type[_Section]:
    sections = _sections()
    if name not in sections:
        raise ConfigError(
            f"{source}: unknown section [{name}]; valid sections: " + ", ".join(sections)
        )
    return sections[name]


def _keys(section_cls: type[_Section]) -> list[str]:
    return [f.name for f in dataclasses.fields(section_cls)]  # type: ignore[arg-type]


def _check_key(section_cls: type[_Section], section: str, key: str, source: str) -> None:
    keys = _keys(section_cls)
    if key not in keys:
        raise ConfigError(
            f"{source}: unknown key {section}.{key}; valid keys in [{section}]: " + ", ".join(keys)
        )


def _check_type(key: str, value: Any, hint: Any, source: str) -> None:
    if get_origin(hint) is Literal:
        expected = "one of: " + ", ".join(get_args(hint))
        ok = isinstance(value, str)  # membership is checked by the section's __post_init__
    elif hint is float:
        expected = "a finite number"  # nan passes every comparison check, inf breaks sizing
        ok = (isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value))
    elif hint is int:
        expected = "an integer"
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif hint == tuple[str, ...]:
        expected = "a list of strings"
        ok = isinstance(value, list | tuple) and all(isinstance(v, str) for v in value)
    else:
        expected = {str: "a string", bool: "true or false"}[hint]
        ok = isinstance(value, hint)
    if not ok:
        raise ConfigError(
            f"{source}: {key} = {value!r} ({type(value).__name__}) is invalid; expected {expected}"
        )


def _coerce(value: Any, hint: Any) -> Any:
    """A checked TOML value as the field stores it (an int for a float key, a list as tuple)."""
    if hint is float:
        return float(value)
    if hint == tuple[str, ...]:
        return tuple(value)
    return value


def _default_served_name(path: str) -> str:
    if path.startswith(BUILTIN_PREFIX):
        return path[len(BUILTIN_PREFIX) :]
    return PurePath(path.rstrip("/\\")).name or path

"""The sections of ``config.toml``: one frozen, validated dataclass per ``[section]``, one
field per key (its docstring is the key's documentation). ``__post_init__`` only validates."""

from __future__ import annotations

import ipaddress
import socket
import typing
from dataclasses import dataclass
from typing import ClassVar, Literal, get_args, get_origin

Mode = Literal["disaggregated", "coupled", "coupled-chunked"]
Device = Literal["cpu", "cuda"]
Elastic = Literal["auto", "on", "off"]
DType = Literal["auto", "float32", "bfloat16", "float16"]
Transport = Literal["auto", "shm", "cuda_ipc"]
KVLayout = Literal["auto", "token-major", "head-major"]
LogLevel = Literal["debug", "info", "warning", "error"]
PredictorKind = Literal["classifier", "oracle", "none"]
DispatchPolicyName = Literal["power-of-two", "round-robin"]
ToolCallParser = Literal["none", "hermes", "llama3_json", "mistral"]

BUILTIN_PREFIX = "builtin:"


class ConfigError(ValueError):
    """A config file, override or value is invalid; the message names the key."""


class _Section:
    """Validation shared by the section dataclasses; ``SECTION`` names keys in errors."""

    SECTION: ClassVar[str] = ""

    def __post_init__(self) -> None:
        for key, hint in typing.get_type_hints(type(self)).items():
            if get_origin(hint) is Literal and getattr(self, key) not in get_args(hint):
                raise ConfigError(
                    f"{self.SECTION}.{key} = {getattr(self, key)!r} is not allowed; "
                    "choose one of: " + ", ".join(get_args(hint))
                )
        self._validate()

    def _validate(self) -> None:
        """Range checks of single fields; cross-field rules live in ``Config.__post_init__``."""

    def _at_least(self, key: str, low: float) -> None:
        if getattr(self, key) < low:
            raise ConfigError(f"{self.SECTION}.{key} = {getattr(self, key)!r} must be >= {low}")

    def _positive(self, key: str) -> None:
        if getattr(self, key) <= 0:
            raise ConfigError(f"{self.SECTION}.{key} = {getattr(self, key)!r} must be > 0")


@dataclass(frozen=True, kw_only=True)
class ServerConfig(_Section):
    """``[server]``: the HTTP front end in the control process."""

    SECTION: ClassVar[str] = "server"

    host: str = "127.0.0.1"
    """Address to bind; loopback by default."""
    port: int = 8000
    """TCP port to bind; 0 picks a free port."""
    api_key: str = ""
    """Bearer token required on /v1/* and /admin/* routes; "" = no auth. Env TETRI_API_KEY
    overrides the config file (``--set`` overrides both); prefer it or api_key_file to argv."""
    api_key_file: str = ""
    """File holding the api key (read at start-up, whitespace stripped); "" = none. Keep it
    mode 600: a group- or world-readable file is warned about. Exclusive with api_key."""
    admin_api_key: str = ""
    """Bearer token for /admin/* instead of api_key; "" = /admin/* takes api_key. Env
    TETRI_ADMIN_API_KEY overrides the config file."""
    allowed_hosts: tuple[str, ...] = ()
    """Host header names accepted (any port). On a loopback bind the loopback names are always
    accepted and others refused (DNS rebinding); elsewhere, empty = any Host."""
    allowed_origins: tuple[str, ...] = ()
    """Browser origins (scheme://host[:port], or "*") accepted in an Origin header. On a loopback
    bind localhost origins are always accepted and others refused; elsewhere, empty = any.
    Non-empty also turns on CORS for these origins (vLLM's --allowed-origins)."""
    max_body_bytes: int = 4 * 1024 * 1024
    """Largest accepted request body in bytes; larger bodies get 413."""
    max_queued_requests: int = 1024
    """Requests admitted but not yet finished, at most; beyond this new requests get 429."""
    request_timeout_s: float = 600.0
    """Server-side bound on one request, arrival to last token; then it fails with an error."""
    drain_timeout_s: float = 30.0
    """On SIGTERM, wait at most this long for in-flight requests before exiting."""
    body_timeout_s: float = 30.0
    """A request body must arrive within this many seconds, else 408."""
    keepalive_timeout_s: float = 15.0
    """Close a connection that is idle, or still sending its request head, this long."""
    max_connections: int = 2048
    """Open client connections at most; more are answered 503 + Retry-After and closed."""
    log_level: LogLevel = "info"
    """Log verbosity."""
    vllm_metric_names: bool = False
    """Also export the vLLM-shaped metrics as vllm:NAME (tools that hard-code vLLM's names)."""

    SECRETS: ClassVar[tuple[str, ...]] = ("api_key", "admin_api_key")
    # environment variable -> key; applied by load_config between the file and --set, in this
    # order (vLLM's variable first: TETRI_API_KEY wins where both are set)
    ENV_KEYS: ClassVar[dict[str, str]] = {
        "VLLM_API_KEY": "api_key",
        "TETRI_API_KEY": "api_key",
        "TETRI_ADMIN_API_KEY": "admin_api_key",
    }

    @property
    def is_loopback(self) -> bool:
        """Bound to a loopback address only: Host and Origin are then checked by default."""
        if self.host.lower() in ("localhost", "localhost."):
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:
            pass
        # another spelling (127.1) or a name (/etc/hosts' ip6-localhost): what the socket
        # binds is what it resolves to
        try:
            infos = socket.getaddrinfo(self.host, None, type=socket.SOCK_STREAM)
        except (OSError, UnicodeError):
            return False
        addresses = {str(info[4][0]).split("%")[0] for info in infos}
        return bool(addresses) and all(ipaddress.ip_address(a).is_loopback for a in addresses)

    def _validate(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ConfigError(f"server.port = {self.port} must be in 0..65535")
        self._positive("max_body_bytes")
        self._positive("max_queued_requests")
        self._positive("request_timeout_s")
        self._positive("drain_timeout_s")
        self._positive("body_timeout_s")
        self._positive("keepalive_timeout_s")
        self._positive("max_connections")
        if self.api_key and self.api_key_file:
            raise ConfigError(
                "server.api_key (or TETRI_API_KEY, --api-key) and server.api_key_file are both "
                "set; keep one"
            )
        if not all(self.allowed_hosts):
            raise ConfigError("server.allowed_hosts must not hold empty names")
        for origin in self.allowed_origins:
            if origin != "*" and not origin.startswith(("http://", "https://")):
                raise ConfigError(
                    f'server.allowed_origins: {origin!r} must be scheme://host[:port] or "*"'
                )


@dataclass(frozen=True, kw_only=True)
class ModelConfig(_Section):
    """``[model]``: which checkpoint every worker loads."""

    SECTION: ClassVar[str] = "model"

    path: str = "builtin:tiny"
    """Local Hugging Face checkpoint folder, or builtin:tiny (made locally on first use)."""
    dtype: DType = "auto"
    """Weight and KV dtype; auto = float32 on cpu; on cuda float16 for a float16 checkpoint,
    else bfloat16."""
    max_model_len: int = 0
    """Longest prompt + output in tokens; 0 = from the model's config.json."""
    served_name: str = ""
    """Model name clients send and /v1/models lists; "" = folder name of model.path."""
    served_aliases: tuple[str, ...] = ()
    """More names clients may send, listed in /v1/models after served_name. The path given
    and its folder name are accepted too, unlisted."""
    use_generation_config: bool = True
    """Take default sampling (temperature, top_p, top_k, min_p, repetition_penalty) from the
    model's generation_config.json when a request omits them; false = OpenAI's defaults. Its
    ``eos_token_id``s stop requests either way (as vLLM's ``--generation-config vllm``)."""

    cuda_graphs: bool = True
    """On cuda workers, capture the decode forward as CUDA graphs at start-up (one per batch
    bucket up to decode.max_batch; the time is logged) and replay them for decode steps;
    false = every step eager. No effect on cpu."""

    batch_invariant: bool = False
    """A greedy (or seeded) request's tokens and logprobs bit for bit the same whatever else
    is in its batch, whatever the chunks its prompt is cut into, in every mode: every attention
    row runs the one-row kernel (a row's result depends only on its query, its position and
    the keys), beside the packed linears, which compute each row alone (an unseeded sampled
    request draws from the process's generator, which its neighbours share). Costs 1-7% of
    prefill time on the bench model (256-1024-token prompts, one thread, AVX2; 6-25% before
    the row kernel took prompt rows in tiles, session 51; docs/benchmarks.md), decode
    unchanged. cpu and float32 only, with the C++ ops
    built (a worker that cannot give it refuses to start); vLLM's VLLM_BATCH_INVARIANT,
    SGLang's --enable-deterministic-inference."""

    tool_call_parser: ToolCallParser = "none"
    """How replies are parsed for tool calls under tool_choice=auto (vLLM's --tool-call-parser):
    hermes (Hermes, Qwen2.5, Qwen3: <tool_call>{json}</tool_call>), llama3_json (Llama 3.1-3.3:
    a JSON call as the reply), mistral ([TOOL_CALLS][...]); none = tools only with
    tool_choice=none."""

    MAX_ALIASES: ClassVar[int] = 16

    def _validate(self) -> None:
        if not self.path:
            raise ConfigError("model.path must not be empty")
        self._at_least("max_model_len", 0)
        if len(self.served_aliases) > self.MAX_ALIASES:
            raise ConfigError(f"model.served_aliases: at most {self.MAX_ALIASES} names")
        if not all(self.served_aliases):
            raise ConfigError("model.served_aliases must not hold empty names")


@dataclass(frozen=True, kw_only=True)
class ClusterConfig(_Section):
    """``[cluster]``: the worker processes and their roles."""

    SECTION: ClassVar[str] = "cluster"

    mode: Mode = "disaggregated"
    """disaggregated (TetriInfer), coupled (vLLM-like) or coupled-chunked (Sarathi-like)."""
    prefill_workers: int = 1
    """Prefill-only workers in disaggregated mode."""
    decode_workers: int = 1
    """Decode-only workers in disaggregated mode."""
    workers: int = 2
    """Workers that both prefill and decode in the coupled modes."""
    device: Device = "cpu"
    """cpu (workers pinned to cores) or cuda (worker i on cuda:(i mod the GPU count))."""
    elastic: Elastic = "auto"
    """Disaggregated mode: on = elastic P/D as its keys say (a prefill worker decodes up to
    ``prefill.local_decode_batch`` requests it kept; a decode worker prefills prompts of up to
    ``decode.local_prefill_tokens``); off = the paper's strict split (both keys resolved to 0);
    auto = on on cpu, off on cuda. Measured: on 2 CPU cores elastic is the better of the two
    (docs/benchmarks.md, "Elastic P/D at equal hardware"); on an H200 (a 0.79 B Llama, bf16,
    Mixed at 12 req/s) the split's JCT was 0.50x coupled's against 2.04x with elastic on, whose
    128-token prompt slices cost a whole launch-bound step each ("On a GPU: the first run")."""
    threads_per_worker: int = 0
    """Torch threads and pinned cores per worker; 0 = cpu cores // number of workers."""
    worker_start_timeout_s: float = 300.0
    """Bound on a worker loading its model and reporting ready."""
    restart_workers: bool = True
    """Restart a worker that dies (its requests are re-run elsewhere either way)."""
    restart_backoff_s: float = 1.0
    """Delay before restarting a worker that died; doubles with each death in a row."""
    restart_backoff_max_s: float = 30.0
    """Largest delay between restarts of one worker."""
    max_restarts: int = 5
    """Deaths in a row of one worker (each within restart_reset_s of its start) after which the
    server exits non-zero, so that systemd (or the operator) acts."""
    restart_reset_s: float = 60.0
    """A worker that stays up this long after becoming ready starts a fresh count of deaths."""
    worker_wait_s: float = 30.0
    """A request whose role has no live worker (all restarting) waits this long for one, then
    fails with 503 and Retry-After."""

    @property
    def num_workers(self) -> int:
        """Worker processes this mode starts."""
        if self.mode == "disaggregated":
            return self.prefill_workers + self.decode_workers
        return self.workers

    def _validate(self) -> None:
        self._at_least("prefill_workers", 0)
        self._at_least("decode_workers", 0)
        self._at_least("workers", 1)
        self._at_least("threads_per_worker", 0)
        self._positive("worker_start_timeout_s")
        self._at_least("restart_backoff_s", 0)
        self._at_least("restart_backoff_max_s", 0)
        self._at_least("max_restarts", 0)
        self._positive("restart_reset_s")
        self._positive("worker_wait_s")


@dataclass(frozen=True, kw_only=True)
class KVConfig(_Section):
    """``[kv]``: each worker's paged KV pool and how KV moves between workers."""

    SECTION: ClassVar[str] = "kv"

    transport: Transport = "auto"
    """KV hand-off: shm (cpu), cuda_ipc (cuda), auto = the one matching cluster.device."""
    block_size: int = 16
    """Tokens per KV block."""
    layout: KVLayout = "auto"
    """How a layer's K and V sit in the pool: token-major (a token's kv heads side by side, so a
    sequence's context is one run of memory), head-major (each kv head's
    tokens side by side: the layout before session 56), or auto: token-major on cpu for float32
    models whose token holds at least 1 KiB of K (kv_heads x head_dim x 4 bytes), where the decode
    attention reads it faster, else head-major (kv/transport.py, ``pool_layout``)."""
    num_blocks: int = 0
    """Blocks per worker; 0 = sized at start-up from memory_gb or memory_fraction."""
    memory_gb: float = 0.0
    """KV pool size per worker in GiB when num_blocks = 0; 0 = use memory_fraction."""
    memory_fraction: float = 0.5
    """When num_blocks = 0 and memory_gb = 0: share of the memory left after weights (free
    device memory on cuda, available RAM split across workers on cpu) given to the KV pool."""

    def _validate(self) -> None:
        self._at_least("block_size", 1)
        self._at_least("num_blocks", 0)
        self._at_least("memory_gb", 0)
        if not 0 < self.memory_fraction <= 1:
            raise ConfigError(f"kv.memory_fraction = {self.memory_fraction} must be in (0, 1]")


@dataclass(frozen=True, kw_only=True)
class PredictorConfig(_Section):
    """``[predictor]``: decode-length prediction on prefill workers."""

    SECTION: ClassVar[str] = "predictor"

    kind: PredictorKind = "classifier"
    """classifier (trained model), oracle (true length from the benchmark) or none."""
    artifact: str = ""
    """Classifier artifact: shipped name, NAME.json/.npz path or folder; "" = shipped g200."""
    heavy_decode_tokens: int = 128
    """A decode predicted to generate more tokens than this is heavy."""

    def _validate(self) -> None:
        self._at_least("heavy_decode_tokens", 0)


@dataclass(frozen=True, kw_only=True)
class DispatchConfig(_Section):
    """``[dispatch]``: how a prefill worker picks the decode worker for a request."""

    SECTION: ClassVar[str] = "dispatch"

    policy: DispatchPolicyName = "power-of-two"
    """power-of-two (two random fitting workers, lower heavy:light ratio) or round-robin."""
    seed: int = 0
    """Seed of the dispatcher's random choices (worker i uses seed + i)."""


@dataclass(frozen=True, kw_only=True)
class MonitorConfig(_Section):
    """``[monitor]``: the cluster monitor in the control process."""

    SECTION: ClassVar[str] = "monitor"

    interval_ms: int = 100
    """Period of worker load reports and of the decode-view broadcast to prefill workers."""
    decision_log: str = ""
    """Path prefix of per-worker decision logs (``<prefix>.w<id>.jsonl``: chunks, dispatches,
    admissions, preemptions, one JSON line each); "" = off."""
    stall_timeout_s: float = 5.0
    """A ready worker that sends nothing and stamps no heartbeat for this long is stalled
    (stopped, frozen): it gets no new work, is killed and restarted, and its requests are re-run
    elsewhere. A worker stamps its heartbeat while it works (a step may take longer than this:
    a long prompt on a CPU), up to ``max_step_s``."""
    max_step_s: float = 120.0
    """A worker busy in one loop turn (a step, a message) longer than this (or than
    ``stall_timeout_s``, if that is larger) stops stamping its heartbeat: a stuck kernel or an
    endless loop is a stall after that + ``stall_timeout_s``. Raise it for a model whose
    prefill chunk takes longer here."""

    def _validate(self) -> None:
        self._at_least("interval_ms", 1)
        self._positive("stall_timeout_s")
        self._positive("max_step_s")
        if self.stall_timeout_s * 1000 < 3 * self.interval_ms:
            raise ConfigError(f"monitor.stall_timeout_s = {self.stall_timeout_s} must cover at "
                              f"least 3 load reports (interval_ms = {self.interval_ms})")


FLIP_HIGH_UTIL = 0.70  # policy.flip.HIGH_UTIL (config imports no policy code); a test ties them


@dataclass(frozen=True, kw_only=True)
class FlipConfig(_Section):
    """``[flip]``: automatic prefill <-> decode role changes (disaggregated mode)."""

    SECTION: ClassVar[str] = "flip"

    enabled: bool = False
    """Let the flip policy change worker roles (POST /admin/flip works either way)."""
    idle_s: float = 60.0
    """Flip a worker that has been completely idle this long."""
    low_load: float = 0.1
    """Or flip one whose load stayed under this fraction over window_s."""
    window_s: float = 60.0
    """Window over which low_load is measured."""
    min_interval_s: float = 120.0
    """Hysteresis: no flip, of any worker, within this long of the last one."""

    def _validate(self) -> None:
        self._positive("idle_s")
        if not 0 <= self.low_load < FLIP_HIGH_UTIL:  # the flip rule needs low < high
            raise ConfigError(f"flip.low_load = {self.low_load} must be in [0, "
                              f"{FLIP_HIGH_UTIL}): a role at {FLIP_HIGH_UTIL} of its capacity "
                              "asks for a worker, so a donor must be below it")
        self._positive("window_s")
        self._at_least("min_interval_s", 0)

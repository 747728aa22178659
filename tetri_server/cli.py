"""``tetri-server serve | bench`` (also ``python -m tetri_server``)."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
import os
import re
import signal
import socket
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from tetri_server.config import BUILTIN_PREFIX, Config, ConfigError, ModelConfig, load_config
from tetri_server.hostinfo import listen_addresses

log = logging.getLogger("tetri")


# --flag -> (section, key): vLLM-style aliases of config keys. Precedence, lowest first:
# config file < environment (TETRI_API_KEY) < these flags < --set.
FLAG_KEYS = {
    "host": ("server", "host"),
    "port": ("server", "port"),
    "api_key": ("server", "api_key"),
    "max_model_len": ("model", "max_model_len"),
    "dtype": ("model", "dtype"),
    "prefill_workers": ("cluster", "prefill_workers"),
    "decode_workers": ("cluster", "decode_workers"),
    "mode": ("cluster", "mode"),
    "tool_call_parser": ("model", "tool_call_parser"),
}


def _serve_args(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    p.add_argument("model", nargs="?", metavar="MODEL",
                   help="model.path: a checkpoint folder, builtin:NAME, or a Hugging Face id "
                        "in the local HF cache; served as MODEL unless --served-model-name")
    p.add_argument("--config", help="config.toml to read (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one config key (repeatable; "
                                                     "wins over every other source)")
    p.add_argument("--host", help="server.host")
    p.add_argument("--port", type=int, help="server.port")
    p.add_argument("--api-key", help="server.api_key (prefer TETRI_API_KEY: argv is public)")
    p.add_argument("--served-model-name", nargs="+", metavar="NAME",
                   help="model.served_name, then model.served_aliases")
    p.add_argument("--max-model-len", type=int, help="model.max_model_len")
    p.add_argument("--dtype", help="model.dtype")
    p.add_argument("--prefill-workers", type=int, help="cluster.prefill_workers")
    p.add_argument("--decode-workers", type=int, help="cluster.decode_workers")
    p.add_argument("--mode", help="cluster.mode")
    p.add_argument("--tool-call-parser",
                   help="model.tool_call_parser: hermes, llama3_json or mistral")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted for vLLM's command lines; auto is on with a parser")
    p.add_argument("--allowed-origins", nargs="+", metavar="ORIGIN",
                   help="server.allowed_origins (turns on CORS for them)")
    p.add_argument("--generation-config", choices=("auto", "vllm"),
                   help="auto: sampling defaults from generation_config.json; vllm: OpenAI's "
                        "(model.use_generation_config); its eos ids stop requests either way")


DTYPE_ALIASES = {"half": "float16", "float": "float32", "bf16": "bfloat16"}


def flag_values(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """The named serve options that were given, as ``{section: {key: value}}``."""
    flags: dict[str, dict[str, Any]] = {}
    for attr, (section, key) in FLAG_KEYS.items():
        value = getattr(args, attr)
        if value is not None:
            flags.setdefault(section, {})[key] = value
    if args.dtype is not None:  # vLLM's aliases: half = float16, float = float32
        flags["model"]["dtype"] = DTYPE_ALIASES.get(args.dtype, args.dtype)
    if args.model is not None:
        flags.setdefault("model", {})["path"] = args.model
    if args.allowed_origins:
        flags.setdefault("server", {})["allowed_origins"] = args.allowed_origins
    if args.generation_config is not None:
        flags.setdefault("model", {})["use_generation_config"] = args.generation_config == "auto"
    if args.served_model_name:
        first, *rest = args.served_model_name
        flags.setdefault("model", {}).update(served_name=first, served_aliases=rest)
    return flags


def build_config(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None
) -> tuple[Config, str]:
    """``serve`` arguments -> (Config, unresolved; model.path as the user gave it). MODEL is
    the default served name; a Hugging Face id is replaced by its folder in the local cache.
    Raises ``ConfigError``."""
    env = os.environ if environ is None else environ
    cfg = load_config(args.config, args.overrides, environ=env, flags=flag_values(args))
    if args.enable_auto_tool_choice and cfg.model.tool_call_parser == "none":
        raise ConfigError("--enable-auto-tool-choice needs a tool call parser "
                          "(--tool-call-parser or model.tool_call_parser: hermes, llama3_json "
                          "or mistral), as with vLLM")
    names = args.served_model_name or []
    if (args.model is None and len(names) > 1 and _looks_like_model(names[-1])
            and cfg.model.path == ModelConfig.path):
        # nargs="+": a MODEL after the names went with them (and none came from a config
        # file, --set or the environment: the built-in model would be served)
        raise ConfigError(
            f"--served-model-name took {names[-1]!r} as a name and no MODEL was given (the "
            f"configured or built-in model would be served under these names): put MODEL "
            f"before the option, `serve {names[-1]} --served-model-name ...`")
    model = cfg.model
    if args.model is not None and model.path == args.model and not model.served_name:
        model = dataclasses.replace(model, served_name=args.model)  # vLLM: served as given
    return dataclasses.replace(cfg, model=resolve_hub_model(model, env)), model.path


_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")


def _looks_like_model(name: str) -> bool:
    """A MODEL argument rather than a name: builtin:NAME, a folder, or an org/name hub id."""
    return (name.startswith(BUILTIN_PREFIX) or Path(name).expanduser().is_dir()
            or ("/" in name and _HUB_ID.fullmatch(name) is not None))


def hub_cache_dir(environ: Mapping[str, str]) -> Path:
    """The Hugging Face hub cache, by huggingface_hub's rules, read from ``environ`` now."""
    def expand(value: str) -> str:  # $VAR and ${VAR}, as os.path.expandvars, from environ
        return re.sub(r"\$(\w+|\{[^}]*\})",
                      lambda m: environ.get(m.group(1).strip("{}"), m.group(0)), value)

    cache = environ.get("HF_HUB_CACHE") or environ.get("HUGGINGFACE_HUB_CACHE")  # (legacy)
    if cache:
        return Path(expand(cache)).expanduser()
    home = environ.get("HF_HOME") or str(
        Path(environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "huggingface")
    return Path(expand(home)).expanduser() / "hub"


def resolve_hub_model(model: ModelConfig, environ: Mapping[str, str]) -> ModelConfig:
    """``model.path`` a Hugging Face id (not a folder here) -> its snapshot folder in the local
    cache, served under the id unless a served name is set. Never downloads (offline always,
    so HF_HUB_OFFLINE holds); a missing model is a ``ConfigError`` saying how to get it."""
    path = model.path
    if path.startswith(BUILTIN_PREFIX):
        from tetri_server.modelmaker import parse_builtin

        try:
            parse_builtin(path)
        except ValueError as e:  # a typo: one line, not a traceback at start
            raise ConfigError(f"model.path {path!r}: {e}") from None
        return model
    if Path(path).expanduser().is_dir():
        return model
    if not _HUB_ID.fullmatch(path) or ".." in path:
        raise ConfigError(f"model.path {path!r} is not a folder, builtin:NAME or a Hugging "
                          "Face id")
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    cache = hub_cache_dir(environ)
    try:
        folder = snapshot_download(path, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, HfHubHTTPError, ValueError) as e:
        raise ConfigError(
            f"model.path {path!r} is not a folder and not in the local Hugging Face cache "
            f"({cache}; set HF_HOME or HF_HUB_CACHE to another); models are never downloaded "
            f"here: fetch it with `hf download {path}` ({type(e).__name__})") from None
    return dataclasses.replace(model, path=folder, served_name=model.served_name or path)


def port_error(host: str, port: int) -> str | None:
    """Why the server could not listen on ``host:port`` (None: it can), checked by binding
    as the server will (address reuse on), before the workers load."""
    if port == 0:
        return None
    try:
        addrs = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as e:
        return f"server.host {host!r} does not resolve: {e}"
    usable = listen_addresses(host, port)  # the server leaves the others out (IPv6 off)
    for family, kind, proto, _, addr in [a for a in addrs if a[4][0] in usable] or addrs:
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as e:
            return f"cannot listen on {host}:{port}: {e.strerror}"
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(addr)
            except OSError as e:
                return (f"cannot listen on {host}:{port}: {e.strerror} (is another server "
                        "there? choose another with --port)")
    return None


async def serve(cfg: Config, given_path: str | None = None) -> int:
    """Run the server until SIGTERM/SIGINT (drain, exit 0) or a fatal worker failure (1).
    ``given_path``: model.path as the user wrote it (accepted as a model name)."""
    from tetri_server.api.app import build_app
    from tetri_server.api.models import ServedModel
    from tetri_server.api.server import drain, start_site
    from tetri_server.control.cluster import Cluster
    from tetri_server.metrics import Metrics
    from tetri_server.predictor import PredictorError
    from tetri_server.sdnotify import Notifier

    notifier = Notifier.from_env()  # before any worker is spawned: they must not inherit it
    from tetri_server.modelinfo import checkpoint_dtype, resolve_model_path

    try:
        weights = checkpoint_dtype(resolve_model_path(cfg.model.path))
    except FileNotFoundError:
        weights = None  # Cluster says why, below
    resolved = cfg.resolve(cpu_count=len(os.sched_getaffinity(0)), checkpoint_dtype=weights)
    if overridden := cfg.split_overrides():
        log.warning("cluster.elastic = %s runs the strict split on %s: %s set to 0 (set "
                    "cluster.elastic = on to keep)", cfg.cluster.elastic, cfg.cluster.device,
                    ", ".join(overridden))
    metrics = Metrics(model_name=resolved.model.served_name,
                      vllm_aliases=cfg.server.vllm_metric_names)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        cluster = Cluster(resolved, metrics)  # reads the model's config: limits refused here
        served = ServedModel.from_config(cfg.model, cluster.model_name,
                                         root=cluster.cfg.model.path, given_path=given_path)
        app = build_app(cluster, cluster.cfg.server, metrics, served)  # reads api_key_file
    except (ConfigError, PredictorError, FileNotFoundError) as e:  # a predictor.artifact or
        # a model folder (config.json) that is not there
        print(f"tetri-server: {e}", file=sys.stderr)
        return 2
    if (error := port_error(cfg.server.host, cfg.server.port)) is not None:
        print(f"tetri-server: {error}", file=sys.stderr)  # before minutes of model loading
        return 2
    log.info("starting %d workers (%s) of %s", len(cluster.roles()), cfg.cluster.mode,
             cluster.model_name)
    starting = asyncio.ensure_future(cluster.start())
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([starting, stopping], return_when=asyncio.FIRST_COMPLETED)
    if not starting.done():  # SIGTERM/SIGINT while the workers load: stop now, not after
        log.warning("stopped while starting")
        starting.cancel()  # Cluster.start stops the workers it spawned
        await asyncio.gather(starting, return_exceptions=True)
        return 0
    stopping.cancel()
    if (failed := starting.exception()) is not None:
        print(f"tetri-server: the workers did not start: {type(failed).__name__}: {failed}",
              file=sys.stderr)
        return 1
    try:
        runner, port = await start_site(app, cfg.server.host, cfg.server.port)
    except OSError as e:
        print(f"tetri-server: cannot listen on {cfg.server.host}:{cfg.server.port}: {e}",
              file=sys.stderr)
        await cluster.stop(drain_timeout_s=0)
        return 2
    url = f"http://{cfg.server.host}:{port}"
    print(f"tetri-server: serving {cluster.model_name!r} ({cfg.cluster.mode}) at {url}/v1\n"
          f"  try: curl {url}/v1/completions -H 'Content-Type: application/json' "
          f"-d '{{\"model\": \"{cluster.model_name}\", \"prompt\": \"Hello\", "
          f"\"max_tokens\": 16}}'", flush=True)
    notifier.ready(f"serving {cluster.model_name} at {url}")  # workers ready, socket bound
    watchdog = notifier.start_watchdog()  # fed through the drain too, until the workers are gone
    assert cluster.fatal is not None
    stopping = asyncio.ensure_future(stop.wait())
    await asyncio.wait([stopping, cluster.fatal], return_when=asyncio.FIRST_COMPLETED)
    stopping.cancel()
    code = 0
    if cluster.fatal.done():  # a worker keeps dying: exit non-zero so that systemd acts
        log.critical("%s; shutting down", cluster.fatal.result())
        code = 1
    log.info("shutting down: draining for up to %.0f s", cfg.server.drain_timeout_s)
    notifier.stopping("draining")
    await drain(app, cfg.server.drain_timeout_s)
    await runner.cleanup()
    await cluster.stop(drain_timeout_s=0)
    if watchdog is not None:
        watchdog.cancel()
    return code


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "bench":
        from tetri_server.bench.cli import main as bench_main

        return int(bench_main(argv[1:]) or 0)
    if argv and argv[0] == "predictor":
        from tetri_server.predictor.command import main as predictor_main

        return int(predictor_main(argv[1:]) or 0)
    if argv and argv[0] == "sim":
        from tetri_server.sim.cli import main as sim_main

        return int(sim_main(argv[1:]) or 0)
    parser = argparse.ArgumentParser(prog="tetri-server")
    sub = parser.add_subparsers(dest="command")
    _serve_args(sub)
    sub.add_parser("bench", help="benchmark a server (see: tetri-server bench --help)")
    sub.add_parser("predictor", help="evaluate or time the length predictor "
                   "(see: tetri-server predictor --help)")
    sub.add_parser("sim", help="simulate a cluster on the server's own policies "
                   "(see: tetri-server sim --help)")
    args = parser.parse_args(argv or ["serve"])
    try:
        cfg, given_path = build_config(args)
    except ConfigError as e:
        print(f"tetri-server: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.server.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvloop

    return uvloop.run(serve(cfg, given_path))


if __name__ == "__main__":
    sys.exit(main())

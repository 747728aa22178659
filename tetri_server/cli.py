"""``tetri-server serve | bench`` (also ``python -m tetri_server``)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import sys

log = logging.getLogger("tetri")


def _serve_args(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("serve", help="serve the OpenAI-compatible API")
    p.add_argument("--config", help="config.toml to read (default: built-in defaults)")
    p.add_argument("--set", dest="overrides", action="append", default=[],
                   metavar="SECTION.KEY=VALUE", help="override one config key (repeatable)")


async def serve(cfg) -> int:  # noqa: ANN001 - Config
    from tetri_server.api.app import build_app
    from tetri_server.api.server import drain, start_site
    from tetri_server.config import ConfigError
    from tetri_server.control.cluster import Cluster
    from tetri_server.metrics import Metrics
    from tetri_server.sdnotify import Notifier

    notifier = Notifier.from_env()  # before any worker is spawned: they must not inherit it
    metrics = Metrics()
    cluster = Cluster(cfg.resolve(cpu_count=len(os.sched_getaffinity(0))), metrics)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        app = build_app(cluster, cluster.cfg.server, metrics)  # reads server.api_key_file
    except ConfigError as e:
        print(f"tetri-server: {e}", file=sys.stderr)
        return 2
    await cluster.start()
    runner, port = await start_site(app, cfg.server.host, cfg.server.port)
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
    parser = argparse.ArgumentParser(prog="tetri-server")
    sub = parser.add_subparsers(dest="command")
    _serve_args(sub)
    sub.add_parser("bench", help="benchmark a server (see: tetri-server bench --help)")
    sub.add_parser("predictor", help="evaluate or time the length predictor "
                   "(see: tetri-server predictor --help)")
    args = parser.parse_args(argv or ["serve"])
    from tetri_server.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, args.overrides)
    except ConfigError as e:
        print(f"tetri-server: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.server.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    import uvloop

    return uvloop.run(serve(cfg))


if __name__ == "__main__":
    sys.exit(main())

"""Worker process entry point: ``python -m tetri_server.workers.main '<WorkerSpec JSON>'``.

Started by the control process with ``subprocess.Popen(pass_fds=...)``; exits 0 after Shutdown,
non-zero on any error (the supervisor notices through the process's pidfd)."""

from __future__ import annotations

import logging
import signal
import sys

import msgspec

from tetri_server.messages import WorkerSpec


def main(argv: list[str]) -> int:
    # before the heavy imports (torch: seconds): a Ctrl-C in the terminal while a worker is
    # being (re)started must not kill it; control drains and stops it (``_die_with_parent``)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    spec = msgspec.json.decode(argv[1].encode(), type=WorkerSpec)
    level = str(spec.config.get("server", {}).get("log_level", "info")).upper()
    logging.basicConfig(level=level, stream=sys.stderr,
                        format=f"%(asctime)s worker{spec.worker_id} %(levelname)s %(message)s")
    from tetri_server.workers.base import Worker

    Worker(spec).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

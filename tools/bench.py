"""Thin wrapper: ``python tools/bench.py run|compare ...`` = ``python -m tetri_server.bench``."""

from __future__ import annotations

from tetri_server.bench.cli import main

if __name__ == "__main__":
    raise SystemExit(main())

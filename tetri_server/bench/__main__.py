"""``python -m tetri_server.bench``: see ``cli.py``."""

from __future__ import annotations

from tetri_server.bench.cli import main

raise SystemExit(main())

"""``python -m tetri_server.predictor eval ...`` (same as ``tetri-server predictor eval``)."""

from __future__ import annotations

import sys

from tetri_server.predictor.command import main

sys.exit(main())

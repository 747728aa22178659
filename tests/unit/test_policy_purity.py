"""The policies must stay importable without the runtime's heavy or async dependencies."""

from __future__ import annotations

import json
import subprocess
import sys

FORBIDDEN = ("torch", "asyncio", "aiohttp", "cupy", "uvloop")


def test_policy_package_imports_no_runtime_modules() -> None:
    code = (
        "import json, sys\n"
        "import tetri_server.policy\n"
        f"print(json.dumps([m for m in {FORBIDDEN!r} if m in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []

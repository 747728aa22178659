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


def test_the_control_process_never_imports_torch(model_dir) -> None:
    """Regression: the control process imported torch (a second copy of its memory and start-up
    time beside every worker) to read config.json and the tokenizer. The whole control side —
    CLI, API, cluster (constructed on a real checkpoint), supervisor — stays torch-free."""
    path = model_dir("llama")
    code = (
        "import sys\n"
        "import tetri_server.cli, tetri_server.api.app\n"
        "from tetri_server.config import load_config\n"
        "from tetri_server.control.cluster import Cluster\n"
        f"c = Cluster(load_config(None, ['model.path={path}']).resolve(cpu_count=2))\n"
        "c.tokenizer('hello world')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip().splitlines()[-1] == "False"

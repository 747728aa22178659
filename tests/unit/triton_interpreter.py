"""Run a script under Triton's CPU interpreter (``TRITON_INTERPRET=1``), to test the CUDA
kernels' indexing and masks on a machine without a GPU. A fresh process each time: the
interpreter is chosen when a kernel is defined.

The interpreter is not the GPU: it converts fp32 to bf16 by truncation (the GPU rounds to
nearest even), so bf16 results are compared on a GPU only (tests/gpu)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

PRELUDE = """
import triton.runtime.interpreter as ti
if hasattr(ti, "_patch_lang_tensor"):  # the interpreter's int() of its 1-element "scalars"
    _patch = ti._patch_lang_tensor     # fails on numpy >= 2.4; index them instead
    def _patched(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
    ti._patch_lang_tensor = _patched
"""


def run_interpreted(script: str, *args: str,
                    timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``script`` run by Python with TRITON_INTERPRET=1 in the repository root, ``args`` its
    ``sys.argv[1:]`` (skips the test where Triton is not installed)."""
    probe = subprocess.run([sys.executable, "-c", "import triton"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("Triton is not installed (the CUDA path's logic is tested where it is)")
    env = dict(os.environ, TRITON_INTERPRET="1")
    return subprocess.run([sys.executable, "-c", PRELUDE + script, *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)

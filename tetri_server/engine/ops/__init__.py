"""Compiled kernels of the engine, built at first use for this machine.

``ragged_attention_op(device_type)`` gives one attention call per layer over the KV pool:
``torch.ops.tetri.ragged_attention`` on CPU (source in ``ragged_attention.cpp``), the Triton
kernel with the same arguments on CUDA (``triton_attention.py``), or None; a None is logged once
as a WARNING, naming the slower path the caller takes instead. ``triton_layer_ops()`` gives the
small per-layer ops and the KV write as Triton kernels on CUDA (``triton_layer.py``), or None,
logged the same way. The same C++ library holds
``tetri::write_kv`` (the new tokens' K/V into the pool), the fused per-layer ops of
``layer_ops.cpp`` (RMSNorm, add + RMSNorm, RoPE, SiLU-and-mul; their references and the
dispatch are in ``layer.py``) and the packed fp32 linear of ``linear_ops.cpp`` (``linear.py``),
with its GLU variant (the gate|up linear with SiLU-and-mul applied in the tile).

The C++ sources are compiled with ninja and the host compiler through
``torch.utils.cpp_extension.load``, once per CPU capability that ATen reports
(``torch.backends.cpu.get_cpu_capability()``) with that capability's flags, never
``-march=native``: a cache shared by an AVX2 and an AVX-512 machine holds one build for each.
Builds live in ``$TETRI_CACHE_DIR/ops`` (default ``~/.cache/tetri_server/ops``), one folder per
(capability, torch version, source and flags hash); a finished one in the default cache is used
from any TETRI_CACHE_DIR. A file lock serialises the build between processes; the others wait
and then load the finished library, which a build writes in a folder of its own and renames in
whole.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch

log = logging.getLogger("tetri.ops")
SOURCE = Path(__file__).with_name("ragged_attention.cpp")
SOURCES = (SOURCE, Path(__file__).with_name("prefill_attention.cpp"),
           Path(__file__).with_name("layer_ops.cpp"),
           Path(__file__).with_name("linear_ops.cpp"))  # one library: tetri::*
# ATen's Vectorized<float> width follows CPU_CAPABILITY_*; the -m flags are inductor's for the
# same capability (torch/_inductor/cpu_vec_isa.py).
ISA_FLAGS = {
    "AVX512": ["-DCPU_CAPABILITY=AVX512", "-DCPU_CAPABILITY_AVX512", "-mavx512f", "-mavx512dq",
               "-mavx512vl", "-mavx512bw", "-mfma"],
    "AVX2": ["-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2", "-mavx2", "-mfma", "-mf16c"],
}
BASE_FLAGS = ["-O3", "-fopenmp"]


DEFAULT_CACHE = Path.home() / ".cache" / "tetri_server"


def cache_root() -> Path:
    env = os.environ.get("TETRI_CACHE_DIR")
    return (Path(env) if env else DEFAULT_CACHE) / "ops"


def build_folder(folder: Path, name: str) -> Path:
    """``folder``, or the same build already finished in the default cache (folders are named by
    everything that goes into the library, so it is the same build): a fresh TETRI_CACHE_DIR,
    as tests give each server, then does not compile again."""
    if not (folder / f"{name}.so").exists():
        default = DEFAULT_CACHE / "ops" / folder.name
        if (default / f"{name}.so").exists():
            return default
    return folder


def build_spec() -> tuple[str, list[str], Path]:
    """(module name, compiler flags, build folder) for this process's CPU capability."""
    isa = torch.backends.cpu.get_cpu_capability()
    flags = BASE_FLAGS + ISA_FLAGS.get(isa, ["-DCPU_CAPABILITY=DEFAULT"])
    name = "tetri_ops_" + "".join(c if c.isalnum() else "_" for c in isa.lower())
    code = b"".join(src.read_bytes() for src in SOURCES)
    digest = hashlib.sha256(code + " ".join(flags).encode()).hexdigest()[:12]
    return name, flags, cache_root() / f"{name}-torch{torch.__version__}-{digest}"


def _ensure_ninja_on_path() -> None:
    """The ``ninja`` wheel (a runtime dependency) puts its binary in the venv's bin, which is
    not on PATH when the venv's python is run directly."""
    if shutil.which("ninja"):
        return
    try:
        import ninja  # type: ignore[import-not-found]
    except ImportError:
        return
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _registered() -> bool:
    try:
        torch.ops.tetri.ragged_attention  # noqa: B018 - raises if not registered
    except AttributeError:
        return False
    return True


def _build_into(folder: Path, name: str, build: Callable[[Path], object]) -> None:
    """Run ``build`` (it writes ``NAME.so`` into the folder it is given, and loads it) in a
    folder of its own, then rename the finished library into ``folder``: a build killed part
    way (SIGKILL mid-link, a worker killed at its start timeout while its ninja runs on)
    leaves no half-written library there for a later start to load (a SIGBUS). Called with
    the build lock held, so other build folders are dead builds'."""
    for stale in folder.parent.glob(f"{folder.name}.build-*"):
        shutil.rmtree(stale, ignore_errors=True)
    tmp = folder.parent / f"{folder.name}.build-{os.getpid()}"
    tmp.mkdir()
    try:
        build(tmp)
        os.replace(tmp / f"{name}.so", folder / f"{name}.so")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


@functools.cache
def load_cpu_ops() -> bool:
    """Build (if needed) and load the CPU library once per process. False, with one WARNING,
    when it cannot be built here (no compiler, no ninja, a compile error)."""
    if _registered():  # a second load of the library would register the namespace twice
        return True
    name, flags, folder = build_spec()
    folder = build_folder(folder, name)
    try:
        from torch.utils.cpp_extension import load

        _ensure_ninja_on_path()
        folder.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with open(folder.parent / f"{folder.name}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # released if the holder dies, unlike the baton
            library = folder / f"{name}.so"
            built = library.exists()
            if built:  # whole (a build renames it in) and current (the folder's name covers
                torch.ops.load_library(str(library))  # source, flags and torch)
            else:
                _build_into(folder, name, lambda tmp: load(
                    name, [str(src) for src in SOURCES], extra_cflags=flags,
                    extra_ldflags=["-fopenmp"], build_directory=str(tmp),
                    is_python_module=False, verbose=False))
        if not built:
            log.info("built the tetri:: ops for %s in %.1f s (%s)",
                     torch.backends.cpu.get_cpu_capability(), time.monotonic() - t0, folder)
        return True
    except Exception as e:  # noqa: BLE001 - any build failure means: warn and take the loop
        msg = str(e).strip().splitlines()
        log.warning("could not build the C++ attention op (%s): %s. Attention runs today's "
                    "per-sequence SDPA loop instead, which is slower (about 40 us per sequence "
                    "and layer). Install g++ and ninja to get the fast path.",
                    folder, " | ".join(msg[-3:]) if msg else type(e).__name__)
        return False


@functools.cache
def triton_missing() -> str:
    """'' where the Triton kernels can run (on CUDA), else why not."""
    if torch.cuda.is_available() and torch.cuda.get_device_capability() < (8, 0):
        return "Triton does not support this GPU (sm < 80, e.g. V100)"
    try:
        import triton  # noqa: F401
    except ImportError as e:
        return f"Triton is not installed ({e})"
    return ""


@functools.cache
def triton_layer_ops() -> ModuleType | None:
    """``triton_layer.py`` (RMSNorm, add + RMSNorm, RoPE, SiLU-and-mul and the KV write as one
    kernel each on CUDA), or None, logged once."""
    why = triton_missing()
    if not why:
        from tetri_server.engine.ops import triton_layer
        return triton_layer
    log.warning("the small layer ops on cuda: %s; RMSNorm, RoPE, SiLU-and-mul and the KV write "
                "run as eager PyTorch instead (several kernel launches each)", why)
    return None


def set_batch_invariant(on: bool, device_type: str, dtype: torch.dtype) -> None:
    """``model.batch_invariant``: every attention row through the one-row kernel, so a row's
    result depends on nothing else in its step (the packed linears already compute each row
    alone). Set in every process that loads a model, on or off (one engine after another in
    a process); ValueError where it cannot hold."""
    if not on:
        if _registered():
            torch.ops.tetri.set_attention_rows_only(False)
        return
    from tetri_server.engine.ops.linear import tetri_linear_supported

    why = ""
    if device_type != "cpu":
        why = f"no batch-invariant kernels on {device_type}"
    elif dtype != torch.float32:
        why = f"{dtype} linears are not computed row by row (float32 only)"
    elif not load_cpu_ops():
        why = "the C++ ops could not be built here (see the warning above)"
    elif not tetri_linear_supported():
        why = "no packed-linear kernel for this CPU (AVX2 or AVX-512 needed)"
    if why:
        raise ValueError(f"model.batch_invariant = true: {why}")
    torch.ops.tetri.set_attention_rows_only(True)


@functools.cache
def ragged_attention_op(device_type: str) -> Callable[..., None] | None:
    """The ragged attention op for ``device_type`` (``torch.ops.tetri.ragged_attention`` on
    CPU, the Triton kernel with the same arguments on CUDA), or None, logged once per device
    type."""
    if device_type == "cpu":
        return torch.ops.tetri.ragged_attention.default if load_cpu_ops() else None
    why = f"no {device_type} kernel"
    if device_type == "cuda":
        why = triton_missing()
        if not why:
            from tetri_server.engine.ops.triton_attention import ragged_attention_triton
            return ragged_attention_triton
    log.warning("ragged attention on %s: %s; attention runs one SDPA call per sequence and "
                "layer instead (slow path)", device_type, why)
    return None

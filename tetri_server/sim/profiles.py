"""Hardware and model profiles as data: what the cost model needs to know about a device and
a model. Built-in hardware profiles are the dicts below (datasheet numbers, one device per
instance); ``this-cpu`` and any user profile are JSON files with the same keys.

Hardware keys: ``peak_flops`` (dense fp16/bf16 matmul FLOP/s; fp32 for the CPU),
``mem_bw_Bps`` (bytes/s), ``memory_bytes`` (per instance), ``memory_utilization`` (share of
memory for weights + KV, vLLM's gpu_memory_utilization), ``compute_eff`` / ``mem_eff``
(the best fraction of peak / bandwidth reached), ``half_tokens`` (tokens per forward pass at
which compute efficiency is half its best: the knee sits near 19x this), ``step_overhead_s``
(per forward pass: launches, sampling, Python), ``pads_compute`` (padding slots of a chunk cost
compute: GPUs run the padded shape, the CPU runner skips them), ``overlap`` (optional, default
1: how much of the shorter of compute and memory time hides under the longer; see
``sim/cost.py``), ``links`` (name ->
``bandwidth_Bps``, ``latency_s``) and ``default_link``.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, dataclass, fields
from pathlib import Path
from typing import Any

PROFILE_DIR = Path(__file__).resolve().parent / "profiles"
GiB = 1 << 30

HARDWARE: dict[str, dict[str, Any]] = {
    "V100-32GB": dict(
        peak_flops=125e12, mem_bw_Bps=900e9, memory_bytes=32 * GiB, memory_utilization=0.9,
        compute_eff=0.55, mem_eff=0.8, half_tokens=24, step_overhead_s=0.002,
        pads_compute=True, default_link="ts-roce",
        # the paper's two emulated links (TS-RoCE 200 Gb/s, TS-NVLink 300 GB/s)
        links={"ts-roce": dict(bandwidth_Bps=200e9 / 8, latency_s=10e-6),
               "ts-nvlink": dict(bandwidth_Bps=300e9, latency_s=5e-6)}),
    "A100-80GB": dict(
        peak_flops=312e12, mem_bw_Bps=2.039e12, memory_bytes=80 * GiB, memory_utilization=0.9,
        compute_eff=0.6, mem_eff=0.8, half_tokens=48, step_overhead_s=0.0015,
        pads_compute=True, default_link="nvlink",
        links={"nvlink": dict(bandwidth_Bps=600e9, latency_s=5e-6),
               "rdma-200g": dict(bandwidth_Bps=200e9 / 8, latency_s=10e-6)}),
    "H100": dict(
        peak_flops=989e12, mem_bw_Bps=3.35e12, memory_bytes=80 * GiB, memory_utilization=0.9,
        compute_eff=0.6, mem_eff=0.8, half_tokens=96, step_overhead_s=0.001,
        pads_compute=True, default_link="nvlink",
        links={"nvlink": dict(bandwidth_Bps=900e9, latency_s=5e-6),
               "rdma-400g": dict(bandwidth_Bps=400e9 / 8, latency_s=10e-6)}),
    "H200": dict(
        # "141 GB": the card reports 143,771 MiB (140 GiB), as the 80 GB cards report ~80 GiB
        peak_flops=989e12, mem_bw_Bps=4.8e12, memory_bytes=140 * GiB, memory_utilization=0.9,
        compute_eff=0.6, mem_eff=0.8, half_tokens=80, step_overhead_s=0.001,
        pads_compute=True, default_link="nvlink",
        links={"nvlink": dict(bandwidth_Bps=900e9, latency_s=5e-6),
               "rdma-400g": dict(bandwidth_Bps=400e9 / 8, latency_s=10e-6)}),
}

# Model shapes. family "llama": gated MLP (3 matrices), GQA; "opt": 2 matrices, MHA.
MODELS: dict[str, dict[str, Any]] = {
    "OPT-13B": dict(family="opt", num_layers=40, hidden=5120, num_heads=40, num_kv_heads=40,
                    head_dim=128, ffn=20480, vocab=50272, dtype_bytes=2, max_model_len=2048),
    "OPT-125M": dict(family="opt", num_layers=12, hidden=768, num_heads=12, num_kv_heads=12,
                     head_dim=64, ffn=3072, vocab=50272, dtype_bytes=2, max_model_len=2048),
    "Llama-2-7B": dict(family="llama", num_layers=32, hidden=4096, num_heads=32,
                       num_kv_heads=32, head_dim=128, ffn=11008, vocab=32000, dtype_bytes=2,
                       max_model_len=4096),
    "Llama-3-8B": dict(family="llama", num_layers=32, hidden=4096, num_heads=32,
                       num_kv_heads=8, head_dim=128, ffn=14336, vocab=128256, dtype_bytes=2,
                       max_model_len=8192),
    # the local random-weight models (tetri_server/modelmaker.py), fp32 on the CPU
    "bench": dict(family="llama", num_layers=8, hidden=512, num_heads=8, num_kv_heads=8,
                  head_dim=64, ffn=1408, vocab=8192, dtype_bytes=4, max_model_len=2048),
    "tiny": dict(family="llama", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2,
                 head_dim=16, ffn=128, vocab=8192, dtype_bytes=4, max_model_len=2048),
}


@dataclass(frozen=True)
class Link:
    name: str
    bandwidth_Bps: float
    latency_s: float


@dataclass(frozen=True)
class Hardware:
    """One instance's device (see the module doc for the fields)."""

    name: str
    peak_flops: float
    mem_bw_Bps: float
    memory_bytes: float
    memory_utilization: float
    compute_eff: float
    mem_eff: float
    half_tokens: float
    step_overhead_s: float
    pads_compute: bool
    default_link: str
    links: dict[str, dict[str, float]]
    overlap: float = 1.0  # share of min(compute, memory) hidden under the other (1 = roofline)

    def __post_init__(self) -> None:
        if min(self.peak_flops, self.mem_bw_Bps, self.memory_bytes) <= 0:
            raise ValueError(f"{self.name}: peak_flops, mem_bw_Bps, memory_bytes must be > 0")
        if not (0 < self.compute_eff <= 1 and 0 < self.mem_eff <= 1):
            raise ValueError(f"{self.name}: efficiencies must be in (0, 1]")
        if not 0 <= self.overlap <= 1:
            raise ValueError(f"{self.name}: overlap must be in [0, 1]")
        if self.default_link not in self.links:
            raise ValueError(f"{self.name}: default_link {self.default_link!r} not in links")

    def link(self, name: str | None = None) -> Link:
        key = name or self.default_link
        if key not in self.links:
            raise ValueError(f"{self.name} has no link {key!r}; links: {sorted(self.links)}")
        spec = self.links[key]
        return Link(key, float(spec["bandwidth_Bps"]), float(spec["latency_s"]))


@dataclass(frozen=True)
class ModelShape:
    name: str
    family: str
    num_layers: int
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    dtype_bytes: int
    max_model_len: int

    @property
    def params_per_layer(self) -> int:
        """Matmul weights of one layer: q|k|v, then the o-projection and MLP."""
        qkv_dim = (self.num_heads + 2 * self.num_kv_heads) * self.head_dim
        return self.hidden * qkv_dim + self.params_after_qkv

    @property
    def params_after_qkv(self) -> int:
        """Matmul weights of one layer past q|k|v (o-projection and MLP): the last layer runs
        them on the sampled rows only (``BatchMetadata.sampled_only``)."""
        num_mlp = 3 if self.family == "llama" else 2
        return self.hidden * (self.num_heads * self.head_dim + num_mlp * self.ffn)

    @property
    def num_matmul_params(self) -> int:
        """Layer matmuls, without the LM head (which only sampled rows pay)."""
        return self.num_layers * self.params_per_layer

    @property
    def weight_bytes(self) -> int:
        """Bytes read by every forward pass: layer weights and the LM head."""
        return (self.num_matmul_params + self.vocab * self.hidden) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


def _from_dict(cls: type, name: str, spec: dict[str, Any]) -> Any:
    names = {f.name for f in fields(cls)} - {"name"}
    required = {f.name for f in fields(cls) if f.default is MISSING} - {"name"}
    missing, extra = required - set(spec), set(spec) - names - {"name", "notes", "fit"}
    if missing or extra:
        raise ValueError(f"profile {name!r}: missing keys {sorted(missing)}, "
                         f"unknown keys {sorted(extra)}")
    return cls(name=spec.get("name", name), **{k: spec[k] for k in names if k in spec})


def load_hardware(name_or_path: str) -> Hardware:
    """A built-in name, ``this-cpu`` (sim/profiles/this-cpu.json), or a JSON file's path."""
    if name_or_path in HARDWARE:
        return _from_dict(Hardware, name_or_path, HARDWARE[name_or_path])
    path = Path(name_or_path)
    if not path.suffix and (PROFILE_DIR / f"{name_or_path}.json").is_file():
        path = PROFILE_DIR / f"{name_or_path}.json"
    if not path.is_file():
        known = [*HARDWARE, *(p.stem for p in PROFILE_DIR.glob("*.json"))]
        raise ValueError(f"hardware {name_or_path!r}: not a profile file nor one of {known}")
    return _from_dict(Hardware, path.stem, json.loads(path.read_text()))


def load_model(name_or_path: str) -> ModelShape:
    """A built-in model name (case-insensitive) or a JSON file with the ModelShape keys."""
    for key, spec in MODELS.items():
        if key.lower() == name_or_path.lower():
            return _from_dict(ModelShape, key, spec)
    path = Path(name_or_path)
    if not path.is_file():
        raise ValueError(f"model {name_or_path!r}: not a shape file nor one of {list(MODELS)}")
    return _from_dict(ModelShape, path.stem, json.loads(path.read_text()))

"""In-process engine: add requests, step, get tokens. It runs the coupled worker's
``CoupledLoop`` (the same policies) over a plain tensor pool, without processes or channels."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from tetri_server.engine.loader import load_model
from tetri_server.engine.runner import ModelRunner
from tetri_server.kv.blocks import BlockAllocator, blocks_for
from tetri_server.kv.manager import KVCacheManager
from tetri_server.messages import SamplingParams, TokenDelta


@dataclass(frozen=True)
class EngineConfig:
    model_path: str
    dtype: str = "float32"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int = 0  # 0 = from kv_memory_gb
    kv_memory_gb: float = 1.0
    mode: str = "coupled"  # coupled | chunked
    chunk_size: int = 512
    max_batch: int = 32
    max_model_len: int = 0  # 0 = the model's max_position_embeddings
    pad_chunks: bool = False


class LLMEngine:
    """Single-process engine. ``step()`` = schedule -> execute -> update."""

    def __init__(self, cfg: EngineConfig) -> None:
        self.cfg = cfg
        self.device = torch.device(cfg.device)
        self.model, self.spec = load_model(cfg.model_path, cfg.dtype, self.device)
        dtype = next(self.model.parameters()).dtype
        s = self.spec
        self.max_model_len = s.max_model_len(cfg.max_model_len)
        num_blocks = cfg.num_blocks or s.blocks_in_budget(
            cfg.kv_memory_gb * 2**30, dtype.itemsize, cfg.block_size)
        if num_blocks < blocks_for(self.max_model_len, cfg.block_size):
            raise ValueError(f"KV pool of {num_blocks} blocks cannot hold one sequence of "
                             f"max_model_len={self.max_model_len}")
        self.kv = torch.zeros(s.num_layers, 2, s.num_kv_heads, num_blocks * cfg.block_size,
                              s.head_dim, dtype=dtype, device=self.device)
        self.allocator = BlockAllocator(num_blocks)
        self.kv_manager = KVCacheManager(self.allocator, self.kv, cfg.block_size)
        self.runner = ModelRunner(self.model, s, self.kv, cfg.block_size, self.device)
        from tetri_server.workers.coupled import CoupledLoop

        self.loop = CoupledLoop(self.runner, self.kv_manager, s.eos_token_ids, self.max_model_len,
                                self.device, chunked=cfg.mode == "chunked",
                                token_budget=cfg.chunk_size, max_batch=cfg.max_batch,
                                max_prefill_tokens=max(self.max_model_len, cfg.chunk_size),
                                pad_chunks=cfg.pad_chunks)
        self.seqs = self.loop.seqs

    def add_request(self, req_id: int, prompt_ids: list[int],
                    params: SamplingParams | None = None) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len is "
                             f"{self.max_model_len}")
        if req_id in self.seqs:
            raise ValueError(f"duplicate request id {req_id}")
        self.loop.add(req_id, prompt_ids, params or SamplingParams(), time.monotonic())

    def abort(self, req_id: int) -> None:
        self.loop.abort(req_id)

    def has_unfinished(self) -> bool:
        return self.loop.has_work()

    def step(self) -> list[TokenDelta]:
        deltas = self.loop.step()
        if self.loop.failed:
            failed, self.loop.failed = self.loop.failed, []
            raise RuntimeError("; ".join(f"request {f.req_id}: {f.error}" for f in failed))
        if not self.loop.last_step_ran and self.loop.has_work():
            raise RuntimeError("no request fits in the KV pool")
        return deltas

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        """Run prompts to completion; returns the output token ids of each."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        base = max(self.seqs, default=-1) + 1
        for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
            self.add_request(base + i, p, sp)
        out: dict[int, list[int]] = {base + i: [] for i in range(len(prompts))}
        while self.has_unfinished():
            for d in self.step():
                out[d.req_id].extend(d.token_ids)
        return [out[base + i] for i in range(len(prompts))]

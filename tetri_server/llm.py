"""In-process engine: add requests, step, get tokens. It runs the coupled worker's
``CoupledLoop`` (the same policies) over a plain tensor pool, without processes or channels."""

from __future__ import annotations

import time

import torch

from tetri_server.config import Config
from tetri_server.engine.cuda_graphs import decode_graphs, scratch_blocks
from tetri_server.engine.grammar import Grammars
from tetri_server.engine.loader import load_model
from tetri_server.engine.ops import set_batch_invariant
from tetri_server.engine.runner import ModelRunner
from tetri_server.kv.blocks import BlockAllocator, check_pool_holds
from tetri_server.kv.manager import KVCacheManager
from tetri_server.kv.transport import PoolGeometry, pool_layout
from tetri_server.messages import SamplingParams, TokenDelta
from tetri_server.modelinfo import resolve_model_path

DEFAULT_KV_GB = 1.0  # pool size in-process when kv.num_blocks and kv.memory_gb are 0


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """What the HTTP API refuses with a 400 (``api/params.py``), for the in-process API: a
    ``ValueError``, as vLLM's ``SamplingParams`` raises."""
    if params.max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {params.max_tokens}")
    if not 0 <= params.min_tokens <= params.max_tokens:
        raise ValueError(f"min_tokens must be in [0, max_tokens={params.max_tokens}], got "
                         f"{params.min_tokens}")
    for field, ids in (("stop_token_ids", params.stop_token_ids),
                       ("logit_bias", list(params.logit_bias))):
        if bad := [t for t in ids if not 0 <= t < vocab_size]:
            raise ValueError(f"{field}: token ids {bad[:5]} are outside the vocabulary (0.."
                             f"{vocab_size - 1})")


def make_engine(model_path: str, *overrides: str, pad_chunks: bool = False) -> LLMEngine:
    """An engine for ``model_path`` with ``--set``-style overrides, e.g.
    ``make_engine(path, "cluster.mode=coupled-chunked", "prefill.token_budget=64")``."""
    from tetri_server.config import load_config

    return LLMEngine(load_config(None, [f"model.path={model_path}", "cluster.mode=coupled",
                                        *overrides]), pad_chunks=pad_chunks)


class LLMEngine:
    """Single-process engine over the coupled worker's loop, built from the same ``Config`` as
    the server: ``cluster.mode`` coupled | coupled-chunked, ``prefill.token_budget``,
    ``decode.max_batch``, ``kv.block_size`` / ``kv.num_blocks`` / ``kv.memory_gb``,
    ``model.*``, ``cluster.device``. ``pad_chunks``: prefill-only steps padded to exactly the
    token budget (TetriInfer's fixed-size chunks, for experiments)."""

    def __init__(self, cfg: Config, *, pad_chunks: bool = False) -> None:
        if cfg.cluster.mode not in ("coupled", "coupled-chunked"):
            raise ValueError(f"the in-process engine runs coupled or coupled-chunked, not "
                             f"{cfg.cluster.mode!r}")
        from tetri_server.modelinfo import checkpoint_dtype

        self.cfg = cfg = cfg.resolve(  # dtype auto as the server resolves it
            cpu_count=1, checkpoint_dtype=checkpoint_dtype(resolve_model_path(cfg.model.path)))
        self.device = torch.device("cuda" if cfg.cluster.device == "cuda" else "cpu")
        path = str(resolve_model_path(cfg.model.path))
        self.model, self.spec = load_model(path, cfg.model.dtype, self.device)
        dtype = next(self.model.parameters()).dtype
        set_batch_invariant(cfg.model.batch_invariant, self.device.type, dtype)
        s, bs = self.spec, cfg.kv.block_size
        self.max_model_len = s.max_model_len(cfg.model.max_model_len)
        num_blocks = cfg.kv.num_blocks or s.blocks_in_budget(
            (cfg.kv.memory_gb or DEFAULT_KV_GB) * 2**30, dtype.itemsize, bs)
        check_pool_holds(num_blocks, scratch_blocks(self.device, cfg.model.cuda_graphs),
                         self.max_model_len, bs)
        layout = pool_layout(cfg.kv.layout, self.device, dtype, s.num_kv_heads, s.head_dim)
        self.kv = PoolGeometry(s.num_layers, num_blocks, bs, s.num_kv_heads, s.head_dim, dtype,
                               layout).zeros(self.device)
        self.allocator = BlockAllocator(num_blocks)
        self.kv_manager = KVCacheManager(self.allocator, self.kv, bs)
        # the EOS ids it stops on: config.json's, and generation_config.json's (Llama 3's
        # <|eot_id|>), as transformers' generate() and vLLM do (the server: stop ids)
        from tetri_server.api.models import GenerationDefaults

        eos = s.eos_token_ids + tuple(i for i in GenerationDefaults.read(path).eos_token_ids
                                      if i < s.vocab_size and i not in s.eos_token_ids)
        self.grammars = Grammars(path, s.vocab_size, s.eos_token_ids)  # as the workers'
        self.runner = ModelRunner(self.model, s, self.kv, bs, self.device, self.grammars)
        if self.device.type == "cuda" and cfg.model.cuda_graphs:
            self.runner.graphs = decode_graphs(self.model, self.kv, self.allocator, bs,
                                               cfg.decode.max_batch, self.device)
        from tetri_server.workers.base import length_tail
        from tetri_server.workers.coupled import CoupledLoop

        budget = cfg.prefill.token_budget
        self.loop = CoupledLoop(self.runner, self.kv_manager, eos, self.max_model_len,
                                self.device, chunked=cfg.cluster.mode == "coupled-chunked",
                                token_budget=budget, max_batch=cfg.decode.max_batch,
                                max_prefill_tokens=max(self.max_model_len, budget),
                                recompute_tokens=cfg.decode.recompute_tokens,
                                waiting_kv_first=cfg.decode.waiting_kv_first,
                                pad_chunks=pad_chunks,
                                tail=length_tail(cfg, "none"))  # as the coupled worker's
        self.seqs = self.loop.seqs
        self.failures: dict[int, str] = {}  # request id -> why it failed (``step``)
        self._held: list[TokenDelta] = []  # deltas of add_request's requests a generate() ran

    def add_request(self, req_id: int, prompt_ids: list[int],
                    params: SamplingParams | None = None) -> None:
        if not prompt_ids:
            raise ValueError("prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(prompt_ids)} tokens; max_model_len is "
                             f"{self.max_model_len}")
        if req_id in self.seqs:
            raise ValueError(f"duplicate request id {req_id}")
        vocab = self.runner.spec.vocab_size
        if bad := [t for t in prompt_ids if not 0 <= t < vocab]:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary (0.."
                             f"{vocab - 1})")
        if params is not None:
            check_params(params, vocab)
        if params is not None and params.guide is not None:
            self.grammars.compile(params.guide)  # GuideError (a ValueError) if it is bad
        self.failures.pop(req_id, None)  # an id used again: its old failure is not this one's
        self.loop.add(req_id, prompt_ids, params or SamplingParams(), time.monotonic())

    def abort(self, req_id: int) -> None:
        self.loop.abort(req_id)

    def has_unfinished(self) -> bool:
        return self.loop.has_work()

    def step(self) -> list[TokenDelta]:
        """One step; the deltas of the requests it served. A request that failed in it (its
        grammar allows no next token, it no longer fits the pool) gets no more deltas: its
        error is in ``failures`` (the others' deltas of the step are not lost). Deltas of
        ``add_request``'s requests that a ``generate()`` call stepped come first."""
        deltas = self.loop.step()
        for f in self.loop.failed:
            self.failures[f.req_id] = f.error
        self.loop.failed.clear()
        if not self.loop.last_step_ran and self.loop.has_work():
            raise RuntimeError("no request fits in the KV pool")
        held, self._held = self._held, []
        return held + deltas

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[list[int]]:
        """Run prompts to completion; returns the output token ids of each."""
        plist = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        base = max(self.seqs, default=-1) + 1
        added: list[int] = []
        try:
            for i, (p, sp) in enumerate(zip(prompts, plist, strict=True)):
                self.add_request(base + i, p, sp)
                added.append(base + i)
        except BaseException:  # one bad prompt: none of the batch stays behind
            for req_id in added:
                self.abort(req_id)
            raise
        out: dict[int, list[int]] = {base + i: [] for i in range(len(prompts))}
        try:
            while self.has_unfinished():
                for d in self.step():
                    if d.req_id in out:
                        out[d.req_id].extend(d.token_ids)
                    else:  # an add_request of the caller's, run beside them: its next step()
                        self._held.append(d)
                if failed := [r for r in added if r in self.failures]:
                    raise RuntimeError("; ".join(f"request {r}: {self.failures.pop(r)}"
                                                 for r in failed))
        except BaseException:  # a failed step: none of the batch stays behind to fail the
            for req_id in added:  # next call too
                self.abort(req_id)
            raise
        return [out[base + i] for i in range(len(prompts))]

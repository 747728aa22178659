"""Cost model: how long a forward pass or a KV hand-off takes on a profile, by roofline.

A forward pass is a ragged batch of items ``(num_new_tokens, num_prefix_tokens)`` (a prompt
chunk, or a decode row with ``num_new_tokens == 1``) plus padding slots. Its time is

    max(C, M) + (1 - overlap) x min(C, M) + step_overhead_s,
    C = FLOPs / (peak * eff(T)),  M = bytes / (bandwidth * mem_eff)

with T the tokens computed, ``eff(T) = compute_eff * T / (T + half_tokens)`` (small passes
under-use the device: the prefill knee), FLOPs = 2 x matmul params x T + 2 x hidden x vocab per
sampled row + causal attention (4 x layers x attention width per query-key pair), less the last
layer's o-projection and MLP on the rows not sampled (the engine runs them on the sampled rows
alone; its attention is still counted for every row), and bytes =
the weights once + the KV read (every item's prefix and new tokens). ``overlap`` is how much of
the shorter side hides under the longer: 1 on a GPU (the roofline), less on a CPU core whose
attention streams the KV after the matmuls are done (``sim fit`` fits it). A hand-off moves
``tokens x kv_bytes_per_token`` over the link: bytes / bandwidth + latency.
"""

from __future__ import annotations

from collections.abc import Iterable

from tetri_server.sim.profiles import Hardware, Link, ModelShape


class CostModel:
    """Times on one (hardware, model) pair; pure arithmetic."""

    def __init__(self, hw: Hardware, model: ModelShape, link: Link | None = None) -> None:
        self.hw, self.model = hw, model
        self.link = link or hw.link()
        m = model
        self._flops_per_token = 2.0 * m.num_matmul_params
        self._flops_last_layer_skip = 2.0 * m.params_after_qkv  # per row not sampled
        self._flops_lm_head = 2.0 * m.hidden * m.vocab
        self._attn_flops_per_pair = 4.0 * m.num_layers * m.num_heads * m.head_dim
        self._kv_bytes = float(m.kv_bytes_per_token)

    def num_kv_blocks(self, block_size: int) -> int:
        """KV blocks that fit one instance beside the weights."""
        room = self.hw.memory_bytes * self.hw.memory_utilization - self.model.weight_bytes
        num = int(room // (block_size * self._kv_bytes))
        if num < 1:
            raise ValueError(f"{self.model.name} does not fit {self.hw.name}: no room for KV")
        return num

    def _parts(self, items: Iterable[tuple[int, int]], num_pad: int,
               num_sampled: int | None) -> tuple[float, float]:
        """(compute seconds, memory seconds) of one pass; (0, 0) for an empty one."""
        num_tokens = num_pairs = num_kv = num_items = 0
        for n, s in items:
            num_tokens += n
            num_pairs += n * s + n * (n + 1) // 2
            num_kv += s + n
            num_items += 1
        if self.hw.pads_compute:
            num_tokens += num_pad
        if num_tokens == 0:
            return 0.0, 0.0
        sampled = num_items if num_sampled is None else num_sampled
        flops = (self._flops_per_token * num_tokens + self._flops_lm_head * sampled
                 + self._attn_flops_per_pair * num_pairs
                 - self._flops_last_layer_skip * max(0, num_tokens - sampled))
        eff = self.hw.compute_eff * num_tokens / (num_tokens + self.hw.half_tokens)
        compute_s = flops / (self.hw.peak_flops * eff)
        memory_s = (self.model.weight_bytes + self._kv_bytes * num_kv) / (
            self.hw.mem_bw_Bps * self.hw.mem_eff)
        return compute_s, memory_s

    def step_s(self, items: Iterable[tuple[int, int]], num_pad: int = 0,
               num_sampled: int | None = None) -> float:
        """One forward pass over ``items`` = (new tokens, prefix tokens) pairs. ``num_sampled``:
        rows that go through the LM head (default: one per item)."""
        compute_s, memory_s = self._parts(items, num_pad, num_sampled)
        if compute_s == 0.0:
            return 0.0
        hidden = (1.0 - self.hw.overlap) * min(compute_s, memory_s)
        return max(compute_s, memory_s) + hidden + self.hw.step_overhead_s

    def bound(self, items: Iterable[tuple[int, int]], num_pad: int = 0) -> str:
        """'compute' or 'memory': which side of the roofline the pass is on."""
        compute_s, memory_s = self._parts(items, num_pad, None)
        return "memory" if memory_s >= compute_s else "compute"

    def prefill_s(self, num_tokens: int, num_prefix: int = 0) -> float:
        """One sequence's prompt chunk alone."""
        return self.step_s([(num_tokens, num_prefix)])

    def decode_s(self, contexts: Iterable[int]) -> float:
        """One decode step: each context (tokens already in the KV cache) adds one token."""
        return self.step_s((1, c) for c in contexts)

    def handoff_s(self, num_tokens: int) -> float:
        """Moving ``num_tokens`` of KV from a prefill to a decode instance."""
        return num_tokens * self._kv_bytes / self.link.bandwidth_Bps + self.link.latency_s


def knee_chunk_size(cost: CostModel, prompt_tokens: int = 1024, rows: int = 0,
                    rider_context: int | None = None) -> int:
    """The chunk size ``policy.knee.pick_chunk_size`` picks from this model's prefill curve
    (passes of ``CALIBRATION_SIZES`` tokens packed from ``prompt_tokens``-token prompts), as
    the prefill worker calibrates with ``prefill.chunk_size = 0`` (``workers/calibrate.py``:
    prompts of ``min(max_model_len - 1, 1024)`` tokens); with ``rows`` (its
    ``prefill.local_decode_batch``) that many one-token decode rows over ``rider_context``
    (``RIDER_CONTEXT``; the worker's: at most ``max_model_len - 1``) tokens of context take
    part of each pass (sizes not above ``rows`` are skipped, as the worker skips them), and the
    pick is the knee of the prompt tokens' rate."""
    from tetri_server.policy import CALIBRATION_SIZES, RIDER_CONTEXT, pick_chunk_size

    context = RIDER_CONTEXT if rider_context is None else rider_context
    samples = []
    if rows >= CALIBRATION_SIZES[-1]:
        raise ValueError(f"chunk_size 0 calibrates over passes of up to {CALIBRATION_SIZES[-1]} "
                         f"tokens; local_decode_batch {rows} leaves none room for prompt tokens")
    for num in (n for n in CALIBRATION_SIZES if rows < n):
        full, rest = divmod(num - rows, prompt_tokens)  # every prompt token of the pass
        items = ([(1, context)] * rows + [(prompt_tokens, 0)] * full
                 + ([(rest, 0)] if rest else []))
        samples.append((num, cost.step_s(items, 0, len(items))))
    return pick_chunk_size(samples, riders=rows)

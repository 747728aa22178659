"""One request inside a worker: its tokens, how much of its KV is computed, its blocks."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from tetri_server.messages import PromptLogprobs, SamplingParams

if TYPE_CHECKING:
    from tetri_server.engine.grammar import GuideState


class SeqStatus(enum.Enum):
    WAITING = "waiting"  # queued for (re)prefill; no blocks, or blocks being filled by chunks
    RUNNING = "running"  # prompt done, decoding
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """Owned by exactly one worker at a time. ``blocks`` is one extent (consecutive ids) holding
    the KV of ``token_ids[:num_computed]``; the last token in ``token_ids`` may not be computed."""

    req_id: int
    token_ids: list[int]
    num_prompt: int
    params: SamplingParams
    arrival_s: float = 0.0
    num_computed: int = 0
    blocks: list[int] = field(default_factory=list)
    status: SeqStatus = SeqStatus.WAITING
    logprobs: list[float] = field(default_factory=list)
    # per sampled token, its top-k alternatives (id, logprob), best first; filled by the
    # sampler only when the request asked for top_logprobs
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    generator: torch.Generator | None = None
    num_emitted: int = 0  # output tokens already reported to the caller
    predicted_bucket: int = 0
    predicted_len: int = 0
    # the matcher of a guided request (params.guide), built where it is first sampled
    # (ModelRunner -> Grammars.bind, replaying output_ids) and advanced by stops.append_token
    guide: GuideState | None = None
    # params.prompt_logprobs: the prompt's logprobs, filled chunk by chunk by the runner during
    # the first prefill and sent (then dropped) with the first delta
    prompt_logprobs: PromptLogprobs | None = None
    scheduled_s: float | None = None  # time.monotonic() its first tokens were scheduled

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.num_prompt

    @property
    def num_uncomputed(self) -> int:
        return len(self.token_ids) - self.num_computed

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Prompt logprobs are computed in this sequence's chunks: asked for, and this is its
        first prefill (a recompute after preemption holds output tokens)."""
        return self.params.prompt_logprobs is not None and self.num_output == 0

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt:]

    @property
    def generated_ids(self) -> list[int]:
        """Every token the request generated, those of earlier runs too: a re-run after a
        worker died prefills the streamed tokens as prompt (``params.num_prior_output``), but
        its grammar and penalties count them as output."""
        return self.token_ids[self.num_prompt - self.params.num_prior_output:]

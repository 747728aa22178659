"""Elastic P/D, the prefill side: when a prefill worker keeps a request it has prefilled and
decodes it itself instead of handing it off.

At equal hardware a strict split loses whenever one side idles while the other queues (on a
decode-heavy workload the prefill worker idles while one decode worker carries every request).
A prefill worker with ``LocalDecode`` keeps a prefilled request when (1) its own local batch
has room, (2) its prompt backlog fits in one chunk (prefill is not the bottleneck: the chunk has
room for decode rows), and (3) every decode worker in the last view holds more requests than it
decodes locally (decode is the busier side). Kept requests decode in the prefill worker's own
steps, their rows riding in its chunks (Sarathi-style, within the chunk size), so a prompt never
waits for them, and they finish where they are (no second hand-off).
"""

from __future__ import annotations

from dataclasses import dataclass

from tetri_server.policy.views import DecodeSnapshot


@dataclass(frozen=True)
class LocalDecode:
    max_batch: int  # most requests a prefill worker decodes itself

    def keep(self, num_local: int, num_queued_prompt_tokens: int, chunk_size: int,
             view: DecodeSnapshot | None) -> bool:
        if num_local >= self.max_batch:
            return False
        if num_queued_prompt_tokens > chunk_size:
            return False  # prompts are waiting: the chunks are theirs
        if view is None or not view.decodes:
            return True  # no decode worker known (none up yet, or all restarting)
        return num_local < min(d.num_heavy + d.num_light for d in view.decodes)

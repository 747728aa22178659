"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, chosen-token logprobs."""

from __future__ import annotations

import torch

from tetri_server.engine.sequence import Sequence


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A per-request generator: same seed, same prompt -> same tokens, whatever the batch."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] (already divided by temperature); masked entries become -inf."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= top_p  # keep the smallest set reaching top_p
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop),
                                    float("-inf"))
    return logits


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float] | None]:
    """logits: [S, vocab] float32, one row per sequence. Returns the chosen token of each row and,
    if any sequence asked for them, the log-probability of each chosen token."""
    tokens = logits.argmax(dim=-1)
    for i, seq in enumerate(seqs):
        p = seq.params
        if p.temperature <= 0.0 or p.top_k == 1:
            continue
        row = _filter(logits[i] / p.temperature, p.top_k, p.top_p)
        probs = row.softmax(-1)
        tokens[i] = torch.multinomial(probs, 1, generator=seq.generator)[0]
    token_list = tokens.tolist()
    if not any(s.params.logprobs for s in seqs):
        return token_list, None
    logp = torch.log_softmax(logits, dim=-1).gather(1, tokens[:, None])[:, 0]
    return token_list, logp.tolist()

"""Token sampling: greedy, temperature, top-k, top-p, per-request seeds, chosen-token logprobs.

``sample`` is total: whatever the parameters and whatever the model produced (inf, NaN), every row
yields a token id in ``[0, vocab)`` and nothing NaN reaches ``torch.multinomial`` (on CUDA a NaN
there is a device assert that kills the worker)."""

from __future__ import annotations

import torch

from tetri_server.engine.sequence import Sequence

# Below this temperature sampling is greedy up to ties, and logits / T can overflow float32: such
# rows take the argmax, ties broken exactly as temperature 0 breaks them.
GREEDY_BELOW_TEMPERATURE = 1e-5
_FLOAT32_MAX = torch.finfo(torch.float32).max
_NEG_INF = float("-inf")


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A per-request generator: same seed, same prompt -> same tokens, whatever the batch."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _sanitize(logits: torch.Tensor) -> torch.Tensor:
    """float32 copy with NaN -> -inf (never chosen) and +inf -> float32 max (the argmax)."""
    return torch.nan_to_num(logits.float(), nan=_NEG_INF, posinf=_FLOAT32_MAX, neginf=_NEG_INF)


def _filter(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] (already scaled by temperature); masked entries become -inf. The top entry is
    never masked, so any top_k and top_p (0, negative, NaN, > 1) leave a row to sample from."""
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, _NEG_INF)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest set reaching top_p
        drop[0] = False
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), _NEG_INF)
    return logits


def _probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits: [V] raw. Returns [V] float32 probabilities; NaN only if no entry is finite."""
    row = _sanitize(logits)
    row = row - row.max()  # the maximum becomes 0, so scaling cannot overflow to +inf
    return _filter(row / min(temperature, _FLOAT32_MAX), top_k, top_p).softmax(-1)


def sample(logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list[float] | None]:
    """logits: [S, vocab] float32, one row per sequence. Returns the chosen token of each row and,
    if any sequence asked for them, the log-probability of each chosen token."""
    tokens = logits.argmax(dim=-1)  # greedy; a row with no finite entry falls back to this
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.temperature >= GREEDY_BELOW_TEMPERATURE or p.top_k == 1:  # NaN too
            continue
        probs = _probs(logits[i], p.temperature, p.top_k, p.top_p)
        ok = probs.isfinite().all() & (probs.sum() > 0)  # a tensor: no device sync per row
        greedy = torch.zeros_like(probs).scatter_(0, tokens[i:i + 1], 1.0)
        probs = torch.where(ok, probs, greedy)
        tokens[i] = torch.multinomial(probs, 1, generator=seq.generator)[0]
    token_list = tokens.tolist()
    if not any(s.params.logprobs for s in seqs):
        return token_list, None
    logp = torch.log_softmax(_sanitize(logits), dim=-1).gather(1, tokens[:, None])[:, 0]
    return token_list, logp.tolist()

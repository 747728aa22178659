"""Token sampling: penalties and logit bias, greedy, temperature, min-p, top-k, top-p,
per-request seeds, chosen-token logprobs and the top alternatives.

Order per row (vLLM's): logit bias, repetition / frequency / presence penalties (counts from the
``Sequence``'s own tokens, so every worker that samples applies them identically), the grammar
mask of a guided request (structured output, ``engine/grammar.py``), then greedy or
temperature -> min-p -> top-k -> top-p -> draw. Logprobs are of the raw model output (vLLM's
default ``raw_logprobs``), with a guided row's grammar mask applied (vLLM applies the grammar's
bitmask before its sampler takes them: a token the grammar forbids has no probability).
Neutral parameters leave the logits untouched (no copy).

``sample`` is total: whatever the parameters and whatever the model produced (inf, NaN), every row
yields a token id in ``[0, vocab)`` and nothing NaN reaches ``torch.multinomial`` (on CUDA a NaN
there is a device assert that kills the worker)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from tetri_server.engine.grammar import allowed_tokens
from tetri_server.engine.ops.layer import argmax_rows
from tetri_server.engine.sequence import Sequence
from tetri_server.messages import PromptLogprobs

# Below this temperature sampling is greedy up to ties, and logits / T can overflow float32: such
# rows take the argmax, ties broken exactly as temperature 0 breaks them.
GREEDY_BELOW_TEMPERATURE = 1e-5
_FLOAT32_MAX = torch.finfo(torch.float32).max
_NEG_INF = float("-inf")


_MASK64 = (1 << 64) - 1


def draw_seed(seed: int, index: int) -> int:
    """The generator seed for a request's output token ``index`` (splitmix64 of the pair, 63
    bits): each draw depends on (seed, index) alone, not on the draws before it, so a token is
    the same whichever worker samples it — after a hand-off, kept on the prefill worker, or in
    a re-run after a crash."""
    z = (seed * 0x9E3779B97F4A7C15 + index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (z ^ (z >> 31)) & ((1 << 63) - 1)


def make_generator(seed: int | None, device: torch.device) -> torch.Generator | None:
    """A per-request generator: same seed, same prompt -> same tokens, whatever the batch (and,
    reseeded per token by ``sample``, whatever the worker)."""
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


def _sanitize(logits: torch.Tensor) -> torch.Tensor:
    """float32 copy with NaN -> -inf (never chosen) and +inf -> float32 max (the argmax)."""
    return torch.nan_to_num(logits.float(), nan=_NEG_INF, posinf=_FLOAT32_MAX, neginf=_NEG_INF)


def penalize(row: torch.Tensor, seq: Sequence) -> torch.Tensor:
    """row: [V] raw logits of ``seq``; returns a new row with its logit bias and penalties
    applied, in vLLM's order: bias, repetition, frequency, presence. Counts: output tokens for
    presence/frequency, prompt + output for repetition."""
    p = seq.params
    row = row.float().clone()
    vocab = row.shape[-1]
    if p.logit_bias:
        ids = torch.tensor(list(p.logit_bias), dtype=torch.long, device=row.device)
        bias = torch.tensor(list(p.logit_bias.values()), dtype=row.dtype, device=row.device)
        row.index_add_(0, ids.clamp(0, vocab - 1), bias)
    if p.repetition_penalty != 1.0 and p.repetition_penalty > 0:  # first, as in vLLM
        seen = torch.tensor(sorted({t for t in seq.token_ids if 0 <= t < vocab}),
                            dtype=torch.long, device=row.device)
        vals = row[seen]
        row[seen] = torch.where(vals > 0, vals / p.repetition_penalty,
                                vals * p.repetition_penalty)
    if p.presence_penalty or p.frequency_penalty:
        out = [t for t in seq.generated_ids if 0 <= t < vocab]
        if out:
            counts = torch.bincount(torch.tensor(out, device=row.device), minlength=vocab)
            row -= p.frequency_penalty * counts.to(row.dtype)
            row -= p.presence_penalty * (counts > 0).to(row.dtype)
    return row


def hold_stops(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...]
               ) -> torch.Tensor:
    """logits: [S, V]; returns them with each row's stop tokens (the model's EOS unless
    ``ignore_eos``, and ``stop_token_ids``) at -inf while it has fewer than ``min_tokens``
    output tokens, so they are not drawn: vLLM's min-tokens processor, transformers'
    ``min_new_tokens``. (Drawn and passed over, an EOS was a token of the reply.)"""
    out = logits.clone()
    vocab = logits.shape[-1]
    for i, seq in enumerate(seqs):
        p = seq.params
        if seq.num_output < p.min_tokens:
            ids = [t for t in (*(() if p.ignore_eos else eos_ids), *p.stop_token_ids)
                   if 0 <= t < vocab]
            if ids:
                out[i, ids] = _NEG_INF
    return out


LOGPROB_FLOOR = -9999.0


class GuideMask(NamedTuple):
    """The guided rows of a step (``rows``) and the tokens each grammar allows ([G, V])."""

    rows: torch.Tensor
    allowed: torch.Tensor


def guide_mask(logits: torch.Tensor, seqs: list[Sequence]) -> GuideMask:
    """The grammars' allowed tokens for the guided rows of ``seqs`` (each matcher read once).
    A grammar that allows no token at all (no base case, an impossible pattern) is marked
    ``dead_end``: its request cannot be completed (``append_token`` ends it)."""
    guided = [(i, s.guide) for i, s in enumerate(seqs) if s.guide is not None]
    allowed = allowed_tokens([g for _, g in guided], logits.shape[-1])
    for (_, guide), some in zip(guided, allowed.any(dim=-1).tolist(), strict=True):
        guide.dead_end = not some
    return GuideMask(torch.tensor([i for i, _ in guided], dtype=torch.long,
                                  device=logits.device), allowed.to(logits.device))


def constrain(logits: torch.Tensor, seqs: list[Sequence],
              mask: GuideMask | None = None) -> torch.Tensor:
    """logits: [S, V]; returns them with every token a guided row's grammar forbids at -inf
    (other rows untouched). A guided row whose allowed tokens are all -inf or NaN samples
    uniformly among them, so a draw never leaves the grammar. ``mask``: ``guide_mask``'s,
    read already."""
    idx, allowed = mask if mask is not None else guide_mask(logits, seqs)
    masked = _sanitize(logits[idx]).masked_fill(~allowed, _NEG_INF)
    dead = ~masked.isfinite().any(dim=-1, keepdim=True)
    masked = torch.where(dead & allowed, 0.0, masked)
    out = logits.float().clone()
    out[idx] = masked
    return out


def _filter(logits: torch.Tensor, top_k: int, top_p: float, min_p: float = 0.0) -> torch.Tensor:
    """logits: [V] (already scaled by temperature); masked entries become -inf. The top entry is
    never masked, so any top_k, top_p and min_p (0, negative, NaN, > 1) leave a row to sample
    from."""
    if 0 < min_p <= 1:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < min_p * probs.max(), _NEG_INF)
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


def _probs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float, min_p: float = 0.0
) -> torch.Tensor:
    """logits: [V] raw. Returns [V] float32 probabilities; NaN only if no entry is finite."""
    row = _sanitize(logits)
    row = row - row.max()  # the maximum becomes 0, so scaling cannot overflow to +inf
    return _filter(row / min(temperature, _FLOAT32_MAX), top_k, top_p, min_p).softmax(-1)


def sample(logits: torch.Tensor, seqs: list[Sequence], eos_ids: tuple[int, ...] = ()
           ) -> tuple[list[int], list[float] | None]:
    """logits: [S, vocab] float32, one row per sequence. Returns the chosen token of each row and,
    if any sequence asked for them, the log-probability of each chosen token. Sequences that
    ask for ``top_logprobs`` get them appended to their ``top_logprobs`` list, if it has one.
    ``eos_ids``: the model's, held back below a row's ``min_tokens`` (``hold_stops``)."""
    raw = logits
    if any(s.params.penalized for s in seqs):
        logits = logits.clone()
        for i, seq in enumerate(seqs):
            if seq.params.penalized:
                logits[i] = penalize(logits[i], seq)
    if any(s.num_output < s.params.min_tokens for s in seqs):
        logits = hold_stops(logits, seqs, eos_ids)
    mask = guide_mask(logits, seqs) if any(s.guide is not None for s in seqs) else None
    if mask is not None:
        logits = constrain(logits, seqs, mask)
    tokens = argmax_rows(logits)  # greedy; a row with no finite entry falls back to this
    for i, seq in enumerate(seqs):
        p = seq.params
        if not p.temperature >= GREEDY_BELOW_TEMPERATURE or p.top_k == 1:  # NaN too
            continue
        probs = _probs(logits[i], p.temperature, p.top_k, p.top_p, p.min_p)
        ok = probs.isfinite().all() & (probs.sum() > 0)  # a tensor: no device sync per row
        greedy = torch.zeros_like(probs).scatter_(0, tokens[i:i + 1], 1.0)
        probs = torch.where(ok, probs, greedy)
        if seq.generator is not None and p.seed is not None:
            seq.generator.manual_seed(draw_seed(p.seed, p.num_prior_output + seq.num_output))
        tokens[i] = torch.multinomial(probs, 1, generator=seq.generator)[0]
    token_list = tokens.tolist()
    if not any(s.params.logprobs for s in seqs):
        return token_list, None
    if mask is not None:  # a token the grammar forbids has no probability (as in vLLM)
        raw = constrain(raw, seqs, mask)
    # [S, V]; -inf (a forbidden token) as vLLM's API writes it: JSON has no infinity
    all_logp = torch.log_softmax(_sanitize(raw), dim=-1).clamp_min(LOGPROB_FLOOR)
    logp = all_logp.gather(1, tokens[:, None])[:, 0]
    for i, seq in enumerate(seqs):
        k = min(seq.params.top_logprobs, all_logp.shape[-1]) if seq.params.logprobs else 0
        store = getattr(seq, "top_logprobs", None)
        if k > 0 and store is not None:
            top = torch.topk(all_logp[i], k)
            store.append(list(zip(top.indices.tolist(), top.values.tolist(), strict=True)))
    return token_list, logp.tolist()


class PromptSpan(NamedTuple):
    """``num_rows`` prompt positions of ``seq`` from ``position`` on, at batch row ``row``: the
    logits of position p score the prompt token at p + 1."""

    seq: Sequence
    position: int
    row: int
    num_rows: int


PROMPT_ROWS_AT_ONCE = 256  # bounds the float32 [rows, V] copies alive while scoring


def add_prompt_logprobs(logits: torch.Tensor, spans: list[PromptSpan]) -> None:
    """logits: [sum of num_rows, V] raw, the spans' rows in order. Appends each position's
    prompt-token logprob, rank and top ``params.prompt_logprobs`` to ``seq.prompt_logprobs``,
    ``PROMPT_ROWS_AT_ONCE`` rows at a time."""
    first = 0
    for seq, position, _, num_rows in spans:
        for start in range(0, num_rows, PROMPT_ROWS_AT_ONCE):
            num = min(PROMPT_ROWS_AT_ONCE, num_rows - start)
            _score(seq, position + start, logits[first + start:first + start + num])
        first += num_rows


def _score(seq: Sequence, position: int, logits: torch.Tensor) -> None:
    """logits: [num, V], of prompt positions ``position`` .. ``position + num - 1``."""
    num = logits.shape[0]
    logp = torch.log_softmax(_sanitize(logits), dim=-1)  # [num, V]
    targets = torch.tensor(seq.token_ids[position + 1:position + 1 + num],
                           dtype=torch.long, device=logp.device)
    own = logp.gather(1, targets[:, None])  # [num, 1]
    out = seq.prompt_logprobs or PromptLogprobs([], [], [])
    out.ranks += ((logp > own).sum(dim=-1) + 1).tolist()
    logp = logp.clamp_min(LOGPROB_FLOOR)  # as the output's: JSON has no -inf (vLLM clamps too)
    out.logprobs += own[:, 0].clamp_min(LOGPROB_FLOOR).tolist()
    k = min(seq.params.prompt_logprobs or 0, logp.shape[-1])
    if k > 0:
        top = torch.topk(logp, k)
        out.top += [list(zip(i, v, strict=True))
                    for i, v in zip(top.indices.tolist(), top.values.tolist(), strict=True)]
    else:
        out.top += [[] for _ in range(num)]
    seq.prompt_logprobs = out

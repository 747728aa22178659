"""Token-level stop rules applied after every sampled token (stop *strings* are matched on
detokenized text by the control process)."""

from __future__ import annotations

from collections.abc import Iterable

from tetri_server.engine.sequence import Sequence
from tetri_server.messages import PromptLogprobs, RequestFailed, TokenDelta

DEAD_END = "dead_end"  # append_token: the grammar allows no next token; the request fails


def append_token(seq: Sequence, token: int, logprob: float | None, eos_ids: tuple[int, ...],
                 max_model_len: int) -> str | None:
    """Append a sampled token; return the finish reason (``stop`` | ``length``) or None.
    ``DEAD_END`` (the token is not appended): the request's grammar allows no token here, so
    it cannot be completed; the caller frees it and reports ``dead_end_failure``."""
    if seq.guide is not None and seq.guide.dead_end:
        return DEAD_END
    seq.token_ids.append(token)
    if logprob is not None:
        seq.logprobs.append(logprob)
    if seq.guide is not None and seq.guide.advance(token):
        return "stop"  # the grammar is complete: the reply ends, whatever min_tokens says
    p = seq.params
    n = seq.num_output
    if n >= p.min_tokens:
        if (not p.ignore_eos and token in eos_ids) or token in p.stop_token_ids:
            return "stop"
    if n >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


def dead_end_failure(seq: Sequence) -> RequestFailed:
    """The client's error (a 400) for a request whose grammar allows no next token."""
    return RequestFailed(seq.req_id, f"the request's grammar (response_format or structured "
                                     f"outputs) allows no token after {seq.num_output} output "
                                     f"tokens: no reply can match it", invalid=True)


def emit(seq: Sequence, reason: str | None) -> TokenDelta:
    """The output tokens of ``seq`` not yet reported, as one delta (and mark them reported)."""
    new = seq.token_ids[seq.num_prompt + seq.num_emitted:]
    # The last len(new) logprobs belong to the new tokens (a decode worker only holds the
    # logprobs of the tokens it sampled itself).
    lps = seq.logprobs[len(seq.logprobs) - len(new):] if seq.params.logprobs else None
    tops = (seq.top_logprobs[len(seq.top_logprobs) - len(new):]
            if seq.params.logprobs and seq.params.top_logprobs else None)
    delta = TokenDelta(seq.req_id, new, lps, reason, tops)
    if seq.num_emitted == 0:  # this worker prefilled it: the first delta's fields
        delta.scheduled_s = seq.scheduled_s
        if seq.params.prompt_logprobs is not None:
            delta.prompt_logprobs = seq.prompt_logprobs or PromptLogprobs([], [], [])
            seq.prompt_logprobs = None  # sent; a recompute does not fill it again
    seq.num_emitted = seq.num_output
    return delta


def prompt_parts(seqs: Iterable[Sequence]) -> list[TokenDelta]:
    """The prompt logprobs a step computed for prompts it did not finish, each on a delta with
    no tokens (the first token's delta, ``emit``, carries the last part). Call after the step's
    forward; a request that did not ask has none."""
    parts = []
    for seq in seqs:
        if seq.prompt_logprobs is not None and seq.num_computed < seq.num_prompt:
            parts.append(TokenDelta(seq.req_id, [], prompt_logprobs=seq.prompt_logprobs))
            seq.prompt_logprobs = None
    return parts


# msgpack bytes of one prompt position at most: its logprob (9) and rank (5) with list
# headers, and per top entry a (token id, logprob) pair (1 + 5 + 9)
POSITION_BYTES, TOP_ENTRY_BYTES = 24, 16


def _position_bytes(part: PromptLogprobs) -> int:
    return POSITION_BYTES + TOP_ENTRY_BYTES * (len(part.top[0]) if part.top else 0)


def split_prompt_parts(deltas: list[TokenDelta], budget_bytes: int) -> list[list[TokenDelta]]:
    """``deltas`` in order, in groups whose prompt logprobs take at most ``budget_bytes``: a
    prefill-first step computes whole prompts, and their logprobs in one message would not fit
    the worker's ring on a long-context model. A part too big for one group is cut into parts
    (deltas with no tokens, joined again in order by the control process); the delta that ends
    a part keeps its tokens and fields. Deltas without prompt logprobs are free."""
    groups: list[list[TokenDelta]] = [[]]
    room = budget_bytes
    for d in deltas:
        part = d.prompt_logprobs
        if part is not None and part.logprobs:
            each = _position_bytes(part)
            while len(part.logprobs) * each > room:
                n = room // each
                if n:
                    groups[-1].append(TokenDelta(d.req_id, [], prompt_logprobs=PromptLogprobs(
                        part.logprobs[:n], part.ranks[:n], part.top[:n])))
                    part = PromptLogprobs(part.logprobs[n:], part.ranks[n:], part.top[n:])
                groups.append([])
                room = max(budget_bytes, each)  # at least one position per message
            d.prompt_logprobs = part
            room -= len(part.logprobs) * each
        groups[-1].append(d)
    return [g for g in groups if g]

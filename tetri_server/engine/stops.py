"""Token-level stop rules applied after every sampled token (stop *strings* are matched on
detokenized text by the control process)."""

from __future__ import annotations

from tetri_server.engine.sequence import Sequence


def append_token(seq: Sequence, token: int, logprob: float | None, eos_ids: tuple[int, ...],
                 max_model_len: int) -> str | None:
    """Append a sampled token; return the finish reason (``stop`` | ``length``) or None."""
    seq.token_ids.append(token)
    if logprob is not None:
        seq.logprobs.append(logprob)
    p = seq.params
    n = seq.num_output
    if n >= p.min_tokens:
        if (not p.ignore_eos and token in eos_ids) or token in p.stop_token_ids:
            return "stop"
    if n >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None

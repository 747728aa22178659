"""Structured output in the workers: a request's ``Guide`` compiled with xgrammar (once per
spec per worker, LRU-cached), one matcher per ``Sequence`` built where the sequence is first
sampled, advanced as its tokens are accepted (``stops.append_token``), and the mask of the
tokens it allows next (``sampling.sample``).

No grammar state crosses the prefill -> decode hand-off: the ``Guide`` travels in the request's
``SamplingParams`` and the receiving worker builds a new matcher and replays the tokens already
generated (``Grammars.bind``). The same holds for a request re-run after a worker restart.

Termination: the grammar lets the model's EOS (and the request's stop tokens) through only when
it is complete; a reply ends when the grammar is complete and a stop token was drawn, or when
the grammar admits nothing more, whatever ``min_tokens`` and ``ignore_eos`` say.

Cost: xgrammar imports torch, so only workers compile. It is imported, and the tokenizer
scanned, at a worker's first guided request (about 2 s with an 8k vocabulary); compiling a
typical schema then takes milliseconds, on the worker's own thread, and a cached spec nothing.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from tetri_server.messages import Guide

if TYPE_CHECKING:
    from tetri_server.engine.sequence import Sequence

CACHE_ENTRIES = 256  # compiled specs kept per worker
# JSON on one line with json.dumps' separators (", " and ": "): what models write, and a reply
# cannot run away in whitespace (a known failure of any-whitespace JSON grammars)
JSON_LAYOUT: dict[str, Any] = {"any_whitespace": False}
_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
_BITS = torch.arange(32, dtype=torch.int32)


class GuideError(ValueError):
    """The guide does not compile (bad schema, regex or grammar): the request's fault."""


def choice_grammar(choices: list[str]) -> str:
    """EBNF accepting exactly one of ``choices`` (JSON string escapes are EBNF's)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


class Grammars:
    """One worker's compiler and cache, over its model's tokenizer. ``vocab_size`` is the width
    of the logits (lm_head rows, possibly more than the tokenizer has); ``stop_ids`` end a
    complete reply (the model's EOS ids; empty: the tokenizer's EOS)."""

    def __init__(self, tokenizer_dir: str | Path | None, vocab_size: int,
                 stop_ids: tuple[int, ...] = (), *, num_threads: int = 1,
                 vocab: list[str] | None = None) -> None:
        self._tokenizer_dir = tokenizer_dir
        self._vocab = vocab  # a hand-made vocabulary instead of a tokenizer (tests)
        self.vocab_size = vocab_size
        self.stop_ids = stop_ids
        self._num_threads = max(1, num_threads)
        self._compiler: Any = None
        self._cache: OrderedDict[Guide, Any] = OrderedDict()
        self.num_compiled = 0  # compilations done (cache misses)

    def _get_compiler(self) -> Any:
        if self._compiler is None:
            import xgrammar as xgr

            stops = list(self.stop_ids) or None
            if self._vocab is not None:
                info = xgr.TokenizerInfo(self._vocab, vocab_size=self.vocab_size,
                                         stop_token_ids=stops)
            else:
                from tetri_server.modelinfo import load_tokenizer, resolve_model_path

                tok = load_tokenizer(resolve_model_path(str(self._tokenizer_dir)))
                info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size,
                                                          stop_token_ids=stops)
            self._compiler = xgr.GrammarCompiler(info, max_threads=self._num_threads,
                                                 cache_enabled=False)  # our LRU is the cache
        return self._compiler

    def compile(self, guide: Guide) -> Any:
        """The compiled grammar of ``guide``, from the cache when seen before; ``GuideError``
        naming what is wrong when it does not compile."""
        hit = self._cache.get(guide)
        if hit is not None:
            self._cache.move_to_end(guide)
            return hit
        compiled = self._compile(guide)
        self.num_compiled += 1
        self._cache[guide] = compiled
        if len(self._cache) > CACHE_ENTRIES:
            self._cache.popitem(last=False)
        return compiled

    def check(self, guide: Guide | None) -> str | None:
        """Why ``guide`` does not compile, or None (compiled into the cache, or no guide)."""
        if guide is None:
            return None
        try:
            self.compile(guide)
        except GuideError as e:
            return str(e)
        return None

    def _compile(self, guide: Guide) -> Any:
        c = self._get_compiler()
        try:
            if guide.kind == "json_schema":
                return c.compile_json_schema(guide.spec, **JSON_LAYOUT)
            if guide.kind == "json_object":  # any object; strict mode would allow only {}
                return c.compile_json_schema('{"type": "object"}', strict_mode=False,
                                             **JSON_LAYOUT)
            if guide.kind == "regex":
                return c.compile_regex(guide.spec)
            if guide.kind == "choice":
                return c.compile_grammar(choice_grammar(json.loads(guide.spec)))
            if guide.kind == "grammar":
                return c.compile_grammar(guide.spec)
        except (RuntimeError, ValueError) as e:
            message = _LOG_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e) else "")
            raise GuideError(f"the {guide.kind.replace('_', ' ')} does not compile: "
                             f"{message or type(e).__name__}") from None
        raise GuideError(f"unknown guide kind {guide.kind!r}")

    def bind(self, seqs: list[Sequence]) -> None:
        """Give every guided sequence in ``seqs`` its matcher, replaying the tokens it already
        generated (sampled here, by the prefill worker before the hand-off, or streamed by an
        earlier run before its worker died)."""
        for seq in seqs:
            guide = seq.params.guide
            if guide is not None and seq.guide is None:
                stops = set(self.stop_ids) | set(seq.params.stop_token_ids)
                seq.guide = GuideState(self.compile(guide), stops, seq.generated_ids)


class GuideState:
    """The matcher of one sequence; ``num_accepted`` tokens fed so far. ``stop_ids`` (the
    model's EOS and the request's stop tokens) are allowed once the grammar is complete."""

    def __init__(self, compiled: Any, stop_ids: set[int], replay: list[int] | None = None) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled)
        self.stop_ids = sorted(stop_ids)
        self.num_accepted = 0
        self.dead_end = False  # the grammar allows no next token (set by the sampler's mask)
        for token in replay or []:
            if self.advance(token):
                raise RuntimeError("a replayed reply already ended its grammar")

    def advance(self, token: int) -> bool:
        """Feed the token just sampled; True when the reply must end here (a stop token drawn
        with the grammar complete, or nothing more allowed)."""
        self.num_accepted += 1
        if self.matcher.accept_token(token):
            return bool(self.matcher.is_terminated())
        if token in self.stop_ids and self.matcher.is_completed():
            return True
        # the sampler masks every other token: a mismatch means the mask or a replay is wrong
        raise RuntimeError(f"token {token} is not allowed by the request's grammar")

    def fill(self, bitmask: torch.Tensor, row: int) -> bool:
        """Write the allowed next tokens into ``bitmask[row]``; True if the grammar is
        complete (the stop tokens are then allowed too)."""
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return bool(self.matcher.is_completed())


def allowed_tokens(guides: list[GuideState], vocab_size: int) -> torch.Tensor:
    """[len(guides), vocab_size] bool on the CPU: the tokens each guide allows next."""
    words = (vocab_size + 31) // 32
    bitmask = torch.full((len(guides), words), -1, dtype=torch.int32)  # int32 [n, words]
    complete = [g.fill(bitmask, i) for i, g in enumerate(guides)]
    # bit j of word w is token 32 * w + j
    allowed = ((bitmask.unsqueeze(-1) >> _BITS) & 1).bool().flatten(1)[:, :vocab_size]
    for i, (g, done) in enumerate(zip(guides, complete, strict=True)):
        if done:
            ids = [t for t in g.stop_ids if 0 <= t < vocab_size]
            allowed[i, ids] = True
    return allowed

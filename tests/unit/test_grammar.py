"""The structured-output mask on hand-made logits over a hand-made vocabulary: only what the
grammar allows is sampled (greedy and drawn), unguided rows are untouched, EOS ends a reply only
once its grammar is complete, a rebuilt matcher (hand-off) replays to the same state, and a
spec is compiled once."""

from __future__ import annotations

import json

import pytest
import torch

from tetri_server.engine.grammar import Grammars, GuideError, choice_grammar
from tetri_server.engine.sampling import make_generator, sample
from tetri_server.engine.sequence import Sequence
from tetri_server.engine.stops import append_token
from tetri_server.messages import Guide, SamplingParams

VOCAB = ["a", "b", "c", "{", "}", "</s>", "ab", "x", '"', ":", "1", " "]
A, B, C, LB, RB, EOS, AB, X, Q, COLON, ONE, SP = range(len(VOCAB))
V = 16  # logits are wider than the vocabulary (padded lm_head rows): never allowed
CPU = torch.device("cpu")
REGEX = Guide("regex", "ab?c")


@pytest.fixture
def grammars() -> Grammars:
    return Grammars(None, V, (EOS,), vocab=VOCAB)


def seq(grammars: Grammars, guide: Guide | None = REGEX, seed: int | None = None,
        output: tuple[int, ...] = (), **params: object) -> Sequence:
    params.setdefault("temperature", 0.0)  # greedy unless a test draws
    s = Sequence(0, [X, *output], 1, SamplingParams(guide=guide, **params),
                 generator=make_generator(seed, CPU))
    grammars.bind([s])
    return s


def favouring(*tokens: int) -> torch.Tensor:
    """[1, V] logits: ``tokens`` highest, in order; everything else lower."""
    row = torch.zeros(1, V)
    for rank, t in enumerate(tokens):
        row[0, t] = 10.0 - rank
    return row


def allowed(s: Sequence) -> set[int]:
    """The tokens greedy sampling can pick for ``s``: probe each one alone at the top."""
    out = set()
    for t in range(V):
        tok, _ = sample(favouring(t), [s])
        if tok[0] == t:
            out.add(t)
    return out


def test_greedy_picks_the_best_token_the_grammar_allows(grammars: Grammars) -> None:
    s = seq(grammars)
    assert allowed(s) == {A, AB}
    assert sample(favouring(X, C, AB, A), [s])[0] == [AB]  # x and c are forbidden here
    assert append_token(s, AB, None, (EOS,), 100) is None
    assert allowed(s) == {C}
    assert append_token(s, C, None, (EOS,), 100) is None
    assert allowed(s) == {EOS}  # complete: only the end is left
    assert append_token(s, EOS, None, (EOS,), 100) == "stop"


def test_request_stop_tokens_are_allowed_once_the_grammar_is_complete(
    grammars: Grammars,
) -> None:
    s = seq(grammars, Guide("regex", "a+"), stop_token_ids=[X])
    assert X not in allowed(s)
    append_token(s, A, None, (EOS,), 100)
    assert allowed(s) == {A, EOS, X}  # "a+" may go on, or end with either stop token
    assert append_token(s, X, None, (EOS,), 100) == "stop"


def test_a_complete_grammar_ends_the_reply_despite_ignore_eos_and_min_tokens(
    grammars: Grammars,
) -> None:
    s = seq(grammars, ignore_eos=True, min_tokens=10)
    for tok in (A, C):
        assert append_token(s, tok, None, (EOS,), 100) is None
    assert allowed(s) == {EOS}
    assert append_token(s, EOS, None, (EOS,), 100) == "stop"


def test_drawn_tokens_stay_in_the_grammar_and_unguided_rows_are_untouched(
    grammars: Grammars,
) -> None:
    logits = torch.randn(3, V, generator=torch.Generator().manual_seed(0)) * 3
    free = Sequence(1, [X], 1, SamplingParams(temperature=0.0))
    for seed in range(50):
        guided = seq(grammars, seed=seed, temperature=1.5)
        toks, _ = sample(logits, [free, guided, free])
        assert toks[1] in (A, AB)
        assert toks[0] == toks[2] == int(logits[0].argmax())  # unguided: plain greedy
    plain, _ = sample(logits[:1].clone(), [free])
    assert plain == [int(logits[0].argmax())]


def test_a_row_with_no_finite_allowed_logit_samples_among_the_allowed(
    grammars: Grammars,
) -> None:
    logits = torch.full((1, V), float("-inf"))
    logits[0, X] = 5.0
    logits[0, A] = float("nan")
    for seed in (None, 1, 2, 3):
        toks, _ = sample(logits, [seq(grammars, seed=seed, temperature=1.0)])
        assert toks[0] in (A, AB)


def test_a_rebuilt_matcher_replays_to_the_same_state(grammars: Grammars) -> None:
    """What a decode worker does after the hand-off: a new matcher over the tokens so far."""
    guide = Guide("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}))
    first = seq(grammars, guide)
    for tok in (LB, Q, A, Q, COLON, SP):
        assert tok in allowed(first)
        append_token(first, tok, None, (EOS,), 100)
    rebuilt = seq(grammars, guide, output=tuple(first.output_ids))
    assert allowed(rebuilt) == allowed(first) == {ONE}
    assert grammars.num_compiled == 1  # one spec, compiled once


def test_a_rerun_replays_the_tokens_streamed_before_its_worker_died(grammars: Grammars) -> None:
    """Regression (invalid structured output with HTTP 200): a request re-run after its worker
    died prefills prompt + streamed tokens (``num_prior_output`` of them); its matcher started
    from the grammar's root, so the reply could begin a second object after the first part."""
    guide = Guide("json_schema", json.dumps({"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}))
    streamed = (LB, Q, A, Q, COLON, SP)
    rerun = Sequence(0, [X, *streamed], 1 + len(streamed),
                     SamplingParams(guide=guide, temperature=0.0,
                                    num_prior_output=len(streamed)))
    grammars.bind([rerun])
    assert rerun.output_ids == [] and rerun.generated_ids == list(streamed)
    assert allowed(rerun) == {ONE}  # the value goes on; no new "{"


def test_bad_specs_raise_guide_error_naming_the_problem(grammars: Grammars) -> None:
    with pytest.raises(GuideError, match="regex does not compile.*parenthesis"):
        grammars.compile(Guide("regex", "(ab"))
    with pytest.raises(GuideError, match="json schema does not compile.*foo"):
        grammars.compile(Guide("json_schema", '{"type": "foo"}'))
    assert grammars.check(Guide("grammar", "root ::= nothing")) is not None
    assert grammars.check(REGEX) is None and grammars.check(None) is None


def test_choice_grammar_escapes_quotes() -> None:
    assert choice_grammar(['a"b', "c"]) == 'root ::= "a\\"b" | "c"'
    g = Grammars(None, V, (EOS,), vocab=VOCAB)
    s = seq(g, Guide("choice", json.dumps(["ab", "c"])))
    assert allowed(s) == {A, AB, C}

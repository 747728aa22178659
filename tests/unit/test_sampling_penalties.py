"""Penalties, logit bias, min-p and top logprobs in sample(): vLLM's semantics on hand-made
logits, counts taken from the Sequence's own tokens; neutral values change nothing."""

from __future__ import annotations

import pytest
import torch

from tetri_server.engine.sampling import make_generator, penalize, sample
from tetri_server.engine.sequence import Sequence
from tetri_server.messages import SamplingParams

V = 10
CPU = torch.device("cpu")


def seq(prompt: list[int], output: list[int] = (), seed: int | None = 0, **params) -> Sequence:
    return Sequence(req_id=0, token_ids=[*prompt, *output], num_prompt=len(prompt),
                    params=SamplingParams(**params), generator=make_generator(seed, CPU))


def logits(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float32)  # [S, V]


ROW = [0.0, 1.0, 2.0, 3.0, 4.0, -1.0, -2.0, 0.5, 3.9, 3.95]


def test_frequency_penalty_counts_each_output_occurrence() -> None:
    s = seq([1], [4, 4, 9], frequency_penalty=0.5)
    row = penalize(logits(ROW)[0], s)
    assert row[4] == pytest.approx(4.0 - 1.0) and row[9] == pytest.approx(3.95 - 0.5)
    assert row[1] == 1.0  # prompt tokens do not count for frequency/presence


def test_penalties_count_the_output_streamed_before_a_rerun() -> None:
    """Regression: a re-run after a worker died holds the streamed tokens in its prompt
    (``num_prior_output`` of them); the penalties forgot them, so even greedy output changed."""
    s = seq([1, 4, 4], [9], frequency_penalty=0.5, presence_penalty=0.25, num_prior_output=2)
    row = penalize(logits(ROW)[0], s)
    assert row[4] == pytest.approx(4.0 - 1.0 - 0.25) and row[9] == pytest.approx(3.95 - 0.75)
    assert row[1] == 1.0  # the real prompt still does not count


def test_presence_penalty_once_per_token() -> None:
    row = penalize(logits(ROW)[0], seq([1], [4, 4, 9], presence_penalty=0.5))
    assert (row[4], row[9], row[1]) == (pytest.approx(3.5), pytest.approx(3.45), 1.0)


def test_repetition_penalty_on_prompt_and_output_divides_positive_multiplies_negative() -> None:
    row = penalize(logits(ROW)[0], seq([5], [4], repetition_penalty=2.0))
    assert row[4] == pytest.approx(2.0) and row[5] == pytest.approx(-2.0)
    assert row[3] == 3.0  # unseen: untouched


def test_repetition_penalty_goes_before_presence_and_frequency_as_in_vllm() -> None:
    """Regression (review of session 64): presence/frequency were subtracted first, and the
    repetition penalty then divided or multiplied by the sign of the changed logit. vLLM
    applies repetition first: here its greedy token is 1, ours was 0."""
    logits = torch.tensor([[1.0, -0.7, -5.0, -5.0]])
    p = SamplingParams(temperature=0.0, presence_penalty=1.5, repetition_penalty=1.3,
                       max_tokens=5)
    seq = Sequence(0, [2, 0], 1, p)  # prompt [2], output [0]
    # vLLM: 1.0 / 1.3 - 1.5 for token 0; -5.0 * 1.3 for the prompt's token 2
    want = torch.tensor([1.0 / 1.3 - 1.5, -0.7, -6.5, -5.0])
    assert torch.allclose(penalize(logits[0], seq), want)
    assert sample(logits, [seq])[0] == [1]


def test_greedy_with_penalties_avoids_repeating() -> None:
    greedy = dict(temperature=0.0)
    plain = sample(logits(ROW), [seq([0], [4], **greedy)])[0]
    assert plain == [4]
    for kw in ({"repetition_penalty": 1.5}, {"frequency_penalty": 1.0},
               {"presence_penalty": 1.0}):
        assert sample(logits(ROW), [seq([0], [4], **greedy, **kw)])[0] == [9], kw


def test_logit_bias_forces_or_bans_a_token_at_any_temperature() -> None:
    for temperature in (0.0, 1.0, 5.0):
        for s in range(20):
            forced = seq([0], seed=s, temperature=temperature, logit_bias={6: 100.0})
            assert sample(logits(ROW), [forced])[0] == [6]
    banned = seq([0], temperature=0.0, logit_bias={4: -100.0})
    assert sample(logits(ROW), [banned])[0] == [9]


def test_min_p_keeps_only_tokens_near_the_top() -> None:
    row = [0.0] * V
    row[2], row[3] = 10.0, 9.9  # p(3)/p(2) = e^-0.1 ~ 0.905
    drawn = {sample(logits(row), [seq([0], seed=s, min_p=0.5)])[0][0] for s in range(100)}
    assert drawn == {2, 3}
    drawn = {sample(logits(row), [seq([0], seed=s, min_p=0.95)])[0][0] for s in range(50)}
    assert drawn == {2}


def test_neutral_parameters_give_the_same_tokens_and_leave_logits_alone() -> None:
    lg = torch.randn(4, V, generator=torch.Generator().manual_seed(0)) * 3
    before = lg.clone()
    base = [seq([1, 2], [3], seed=10 + i, temperature=0.9) for i in range(4)]
    neutral = [seq([1, 2], [3], seed=10 + i, temperature=0.9, presence_penalty=0.0,
                   frequency_penalty=0.0, repetition_penalty=1.0, min_p=0.0, logit_bias={})
               for i in range(4)]
    assert sample(lg, base)[0] == sample(lg, neutral)[0]
    assert torch.equal(lg, before)


def test_penalized_seeded_sampling_is_reproducible_and_batch_independent() -> None:
    lg = torch.randn(3, V, generator=torch.Generator().manual_seed(1))
    kw = dict(temperature=1.0, frequency_penalty=0.7, repetition_penalty=1.3, min_p=0.05)
    outs = [[2, 2, 5], [7], []]
    together = sample(lg, [seq([1], outs[i], seed=i, **kw) for i in range(3)])[0]
    alone = [sample(lg[i:i + 1], [seq([1], outs[i], seed=i, **kw)])[0][0] for i in range(3)]
    assert together == alone
    # a greedy neighbour in the batch is unaffected by its penalized neighbours
    mixed = sample(lg, [seq([1], seed=0, **kw), seq([1], temperature=0.0), seq([1], seed=2)])[0]
    assert mixed[1] == int(lg[1].argmax())


def test_logprobs_stay_those_of_the_raw_logits_under_penalties() -> None:
    lg = logits(ROW)
    s = seq([0], [4], temperature=0.0, logprobs=True, repetition_penalty=3.0)
    tokens, lps = sample(lg, [s])
    assert lps == pytest.approx([float(torch.log_softmax(lg[0], -1)[tokens[0]])])


def test_top_logprobs_are_the_k_best_of_the_raw_distribution() -> None:
    lg = logits(ROW)
    s = seq([0], temperature=0.0, logprobs=True, top_logprobs=3)
    s.top_logprobs = []  # the store a Sequence provides (see sample()'s contract)
    sample(lg, [s])
    want = torch.log_softmax(lg[0], -1)
    assert [t for t, _ in s.top_logprobs[0]] == [4, 9, 8]
    assert [v for _, v in s.top_logprobs[0]] == pytest.approx([float(want[i]) for i in (4, 9, 8)])


def test_min_tokens_holds_back_eos_and_stop_tokens_until_reached() -> None:
    """Regression: below min_tokens an EOS could be drawn (then passed over as a token of the
    reply); vLLM and transformers' min_new_tokens never draw it there."""
    eos, greedy = (4,), dict(temperature=0.0)  # the best token of ROW is the EOS, then 9, 8
    s = seq([1], [3], min_tokens=3, stop_token_ids=[9], **greedy)
    assert sample(logits(ROW), [s], eos)[0] == [8]  # 4 and 9 held back: the next best
    assert sample(logits(ROW), [seq([1], [3, 3], min_tokens=3, **greedy)], eos)[0] == [9]
    assert sample(logits(ROW), [seq([1], [3, 3, 3], min_tokens=3, **greedy)], eos)[0] == [4]
    kept = seq([1], [3], min_tokens=3, ignore_eos=True, **greedy)  # EOS never stops it
    assert sample(logits(ROW), [kept], eos)[0] == [4]

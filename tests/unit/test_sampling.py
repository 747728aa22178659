"""sample() is total: any temperature, top_p, top_k and any logits (inf, NaN) give a valid token,
greedy-equivalent where the request is; seeded sampling stays reproducible."""

from __future__ import annotations

import math

import pytest
import torch

from tetri_server.engine.sampling import make_generator, sample
from tetri_server.engine.sequence import Sequence
from tetri_server.messages import SamplingParams

V = 50
CPU = torch.device("cpu")


def seq(seed: int | None = 0, **params: object) -> Sequence:
    return Sequence(
        req_id=0,
        token_ids=[1],
        num_prompt=1,
        params=SamplingParams(**params),
        generator=make_generator(seed, CPU),
    )


def rand_logits(rows: int, seed: int = 0, scale: float = 5.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, V, generator=g) * scale  # [rows, V] float32


def with_ties(logits: torch.Tensor) -> torch.Tensor:
    """Every row's maximum also appears at two later indices; greedy picks the first."""
    logits = logits.clone()
    for row in logits:
        top = int(row.argmax())
        row[(top + 7) % V] = row[top]
        row[(top + 19) % V] = row[top]
    return logits


def greedy(logits: torch.Tensor) -> list[int]:
    return logits.argmax(dim=-1).tolist()


def assert_valid(tokens: list[int], rows: int) -> None:
    assert len(tokens) == rows and all(isinstance(t, int) and 0 <= t < V for t in tokens)


@pytest.mark.parametrize(
    "temperature", [1e-40, 5e-324, 1e-45, torch.finfo(torch.float32).tiny, 1e-30, 1e-7]
)
def test_tiny_temperature_is_greedy_even_with_ties(temperature):
    logits = with_ties(rand_logits(6))
    seqs = [seq(seed=i, temperature=temperature) for i in range(6)]
    tokens, _ = sample(logits, seqs)
    assert tokens == greedy(logits)


def test_tiny_temperature_without_seed_is_greedy():
    logits = rand_logits(3, scale=1e3)
    tokens, _ = sample(logits, [seq(seed=None, temperature=1e-40) for _ in range(3)])
    assert tokens == greedy(logits)


def test_huge_logits_at_small_temperature_do_not_overflow():
    """(logits / T) overflows float32 here; the distinct maximum must still win."""
    logits = rand_logits(4, scale=1e36)
    tokens, lps = sample(logits, [seq(seed=i, temperature=1e-3, logprobs=True) for i in range(4)])
    assert tokens == greedy(logits)
    assert all(math.isfinite(x) for x in lps)


@pytest.mark.parametrize("top_p", [0.0, 1e-12, -0.5])
def test_top_p_at_or_below_zero_keeps_only_the_top_token(top_p):
    logits = rand_logits(8, seed=1)
    tokens, _ = sample(logits, [seq(seed=i, top_p=top_p) for i in range(8)])
    assert tokens == greedy(logits)


@pytest.mark.parametrize("top_p", [1.0, 1.5, float("nan")])
def test_top_p_at_or_above_one_is_no_filter(top_p):
    logits = torch.zeros(1, V)  # uniform: without a filter, many seeds give many tokens
    tokens = [sample(logits, [seq(seed=s, top_p=top_p)])[0][0] for s in range(200)]
    assert_valid(tokens, 200)
    assert len(set(tokens)) > V // 2


@pytest.mark.parametrize("top_k", [0, -1, -100, V, V + 10])
def test_top_k_off_values_equal_no_filter(top_k):
    logits = rand_logits(5, seed=2, scale=1.0)
    off = sample(logits, [seq(seed=i) for i in range(5)])[0]
    tokens = sample(logits, [seq(seed=i, top_k=top_k) for i in range(5)])[0]
    assert tokens == off


def test_top_k_keeps_only_the_k_largest():
    logits = rand_logits(1, seed=3, scale=0.1)
    top2 = set(torch.topk(logits[0], 2).indices.tolist())
    tokens = {sample(logits, [seq(seed=s, top_k=2)])[0][0] for s in range(100)}
    assert tokens == top2


@pytest.mark.parametrize("temperature", [0.0, 1.0, 1e-40, float("inf"), float("nan")])
def test_non_finite_logits_give_a_valid_token(temperature):
    logits = rand_logits(5, seed=4)
    logits[0, 9] = float("inf")  # a model that overflowed: the inf token is the only choice
    logits[1] = float("nan")
    logits[2] = float("-inf")
    logits[3, ::2] = float("nan")  # NaN entries are never chosen by sampling
    logits[4, 1:] = float("-inf")  # one finite entry
    seqs = [seq(seed=i, temperature=temperature, logprobs=True) for i in range(5)]
    tokens, lps = sample(logits, seqs)
    assert_valid(tokens, 5)
    assert tokens[1:3] == greedy(logits)[1:3] and tokens[4] == 0
    if math.isfinite(temperature):
        assert tokens[0] == 9
    if 1e-5 <= temperature < math.inf:
        assert tokens[3] % 2 == 1
    elif not temperature >= 1e-5:  # greedy, unchanged: torch's argmax picks a NaN entry
        assert tokens[3] == greedy(logits)[3]
    assert math.isfinite(lps[0]) and math.isfinite(lps[4])


def test_infinite_temperature_samples_uniformly_over_unmasked_tokens():
    logits = rand_logits(1, seed=5)
    logits[0, 10:] = float("-inf")
    tokens = {sample(logits, [seq(seed=s, temperature=float("inf"))])[0][0] for s in range(200)}
    assert tokens == set(range(10))


def test_greedy_is_argmax_including_non_finite_rows():
    logits = with_ties(rand_logits(4, seed=6))
    logits[1, 3] = float("nan")
    logits[2] = float("-inf")
    tokens, _ = sample(logits, [seq(seed=None, temperature=0.0) for _ in range(4)])
    assert tokens == greedy(logits)


def test_seeded_sampling_is_reproducible_and_batch_independent():
    logits = rand_logits(4, seed=7, scale=1.0)
    params = {"temperature": 0.8, "top_p": 0.9, "top_k": 20}
    together = sample(logits, [seq(seed=100 + i, **params) for i in range(4)])[0]
    alone = [sample(logits[i : i + 1], [seq(seed=100 + i, **params)])[0][0] for i in range(4)]
    assert together == alone
    draws = {sample(logits[:1], [seq(seed=s, **params)])[0][0] for s in range(50)}
    assert len(draws) > 1  # it does sample


def test_logprobs_are_of_the_unscaled_logits():
    logits = rand_logits(3, seed=8)
    tokens, lps = sample(logits, [seq(seed=i, temperature=0.5, logprobs=True) for i in range(3)])
    want = torch.log_softmax(logits, -1)[torch.arange(3), torch.tensor(tokens)]
    assert lps == pytest.approx(want.tolist())


def test_a_seeded_draw_depends_on_the_seed_and_the_token_index_alone():
    """Token k of a seeded request is the same whether this generator drew tokens 0..k-1 (one
    worker all along), a fresh one samples it (a decode worker after the hand-off, the prefill
    worker that kept it) or a re-run whose prompt holds the k streamed tokens."""
    logits = rand_logits(1, seed=9, scale=1.0)
    params = {"seed": 5, "temperature": 1.0}
    along = Sequence(0, [1], 1, SamplingParams(**params), generator=make_generator(5, CPU))
    drawn = []
    for _ in range(6):
        tok = sample(logits, [along])[0][0]
        drawn.append(tok)
        along.token_ids.append(tok)
    for k in range(6):
        handed = Sequence(0, [1, *drawn[:k]], 1, SamplingParams(**params),
                          generator=make_generator(5, CPU))
        rerun = Sequence(0, [1, *drawn[:k]], 1 + k,
                         SamplingParams(**params, num_prior_output=k),
                         generator=make_generator(5, CPU))
        assert sample(logits, [handed])[0][0] == drawn[k] == sample(logits, [rerun])[0][0]
    assert len(set(drawn)) > 1  # it does sample

"""The refined decode estimate: remaining length given the tokens generated (policy/remaining.py),
its distributions stored with the predictor artifact (predictor/tails.py), and what it changes
in decode admission and preemption."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.unit.test_policy_decode import FakeRuntime
from tetri_server.policy import LengthTail
from tetri_server.predictor import PredictorError, tails
from tetri_server.predictor.artifact import shipped_artifacts
from tetri_server.predictor.base import LengthPredictor
from tetri_server.predictor.data import Sample
from tetri_server.predictor.train import held_out_ids

# ---------------------------------------------------------------------- the arithmetic


def test_expected_output_is_the_conditional_mean_capped_at_max_tokens() -> None:
    tail = LengthTail.from_lengths({0: [10, 50, 100, 300]}, 1, 16)
    assert tail.expected_output(0, 1, 1000) == 115  # (10 + 50 + 100 + 300) / 4
    assert tail.expected_output(0, 60, 1000) == 150  # 10 and 50 have stopped: (50+100+300)/3
    assert tail.expected_output(0, 60, 200) == 117  # 300 capped at 200: (50 + 100 + 200) / 3
    assert tail.expected_output(0, 1, 20) == 18  # (10 + 20 + 20 + 20) / 4
    assert tail.expected_output(0, 400, 1000) is None  # past every length seen
    assert tail.expected_output(0, 299, 1000) == 300  # at least one more token


def test_a_heavy_tail_raises_the_expected_remaining_length_as_a_request_runs() -> None:
    lengths = [int(20 * 1.5**i) for i in range(12) for _ in range(2 ** (11 - i))]
    tail = LengthTail.from_lengths({0: lengths}, 1, 10)
    remaining = [tail.expected_output(0, g, 10**6) - g for g in (1, 50, 200, 800)]  # type: ignore[operator]
    assert remaining == sorted(remaining) and remaining[-1] > 3 * remaining[0]


def test_responses_cut_at_the_data_cap_run_one_cap_further() -> None:
    """The data's responses were cut at 1024 tokens: a request asking for more is expected to
    run past the cut (it said 1021 at 1020 before session 63), by one cut's length (regression,
    review of session 64: counted as running to max_tokens, a short request whose max_tokens
    was the rest of a 32k context reserved 2,385 tokens in bucket 0 and 11,906 in the top one,
    and dispatch to a decode worker stopped with its pool 6% used)."""
    lengths = [100, 300, 1024, 1024]
    cut = LengthTail.from_json(LengthTail.from_lengths({0: lengths}, 1, 20).to_json(), clip=1024)
    assert cut.expected_output(0, 1, 4096) == -(-(100 + 300 + 2048 + 2048) // 4)
    assert cut.expected_output(0, 1020, 4096) == 2048
    assert cut.expected_output(0, 2000, 4096) == 3024  # past every length in the data
    assert cut.expected_output(0, 3500, 4096) == 4096
    assert cut.expected_output(0, 1, 1024) == 612  # a cap at the cut: nothing is censored
    assert cut.expected_output(0, 1, 1500) == -(-(100 + 300 + 1500 + 1500) // 4)
    assert cut.expected_output(0, 1, 512) == (100 + 300 + 512 + 512) // 4
    for name in shipped_artifacts():
        for kind in ("classifier", "oracle", "none"):
            tail = tails.load(kind, name)
            top = tail.num_buckets - 1
            assert tail.expected_output(top, 1030, 2048) == 2048, (name, kind)
            for bucket in range(tail.num_buckets):
                est = tail.expected_output(bucket, 1, 32668)
                assert est is None or est <= 2048, (name, kind, bucket)


def test_a_bucket_past_the_last_row_uses_the_last() -> None:
    tail = LengthTail.from_lengths({0: [10], 1: [500]}, 2, 20)
    assert tail.expected_output(7, 1, 1000) == tail.expected_output(1, 1, 1000) == 500


def test_bad_histograms_are_refused() -> None:
    with pytest.raises(ValueError):
        LengthTail(0, [[1]], [[1]])
    with pytest.raises(ValueError):
        LengthTail(16, [[1, 2]], [[1]])
    with pytest.raises(ValueError):
        LengthTail(16, [[-1]], [[0]])


# ---------------------------------------------------------------------- with the artifact


def samples(lengths: list[int]) -> list[Sample]:
    return [Sample(f"p{i}", f"prompt {i}", "m", n) for i, n in enumerate(lengths)]


class EveryThird(LengthPredictor):
    """Predicts bucket ``i % 3`` for ``prompt i``, whatever its length."""

    def predict(self, prompts, true_lengths=None):  # type: ignore[no-untyped-def]
        return [int(p.split()[1]) % 3 for p in prompts]


def test_compute_keys_the_held_out_lengths_by_predicted_bucket() -> None:
    data = samples([30 * i for i in range(40)])
    entry = tails.compute(data, EveryThird(200, 3), test_frac=0.5, seed=0)
    by_pred = LengthTail.from_json(entry["by_predicted"])
    held_ids = held_out_ids({s.prompt_id: s.prompt for s in data}, 0.5, 0)
    held = [s for s in data if s.prompt_id in held_ids]
    assert entry["heldout_responses"] == len(held) == 20
    for b in range(3):  # row b: exactly the held-out lengths of the prompts predicted b
        want = sorted(s.output_tokens for s in held if int(s.prompt_id[1:]) % 3 == b)
        assert sum(by_pred.sums[b]) == sum(want) and sum(by_pred.counts[b]) == len(want)
    assert sum(LengthTail.from_json(entry["marginal"]).counts[0]) == 40


@pytest.mark.parametrize("name", shipped_artifacts())
def test_every_shipped_artifact_has_tails_for_every_kind(name: str) -> None:
    meta = json.loads(Path(tails.artifact_io.resolve(name)).read_text())
    g, k = int(meta["granularity"]), int(meta["num_buckets"])
    assert tails.load("classifier", name).num_buckets == k
    assert tails.load("none", name).num_buckets == 1
    oracle = tails.load("oracle", name)
    for b in range(k):  # the oracle knows the bucket: its estimate stays inside it
        est = oracle.expected_output(b, 1, 10**6)
        assert est is not None and b * g <= est <= (b + 1) * g or b == k - 1


def test_decode_estimate_picks_the_tail_the_roles_get() -> None:
    from tetri_server.config import load_config
    from tetri_server.workers.base import length_tail

    assert length_tail(load_config(None, []), "classifier") is None  # the default: bucket
    refined = load_config(None, ["decode.estimate=refined"])
    got = length_tail(refined, "classifier")
    assert got is not None and got.num_buckets == 6  # the shipped arena_g200
    got = length_tail(refined, "none")  # coupled roles: the distribution of all lengths
    assert got is not None and got.num_buckets == 1


def test_an_artifact_without_tails_fails_at_load_naming_the_command(tmp_path: Path) -> None:
    src = Path(tails.artifact_io.resolve("arena_g200"))
    meta = json.loads(src.read_text())
    del meta["length_tails"]
    (tmp_path / "x.json").write_text(json.dumps(meta))
    with pytest.raises(PredictorError, match="predictor tails"):
        tails.load("classifier", tmp_path / "x.json")


# ---------------------------------------------------------------------- admission, preemption


class Runtime(FakeRuntime):
    """test_policy_decode's runtime (plans executed against a pool as a decode worker does)
    over an admission with a length tail; it remembers each request's prompt."""

    def __init__(self, policy: str, num_total_blocks: int, tail: LengthTail | None) -> None:
        super().__init__(policy, num_total_blocks, tail=tail)  # type: ignore[arg-type]
        self.prompt: dict[int, int] = {}

    def add(self, rid: int, prompt: int, bucket: int, max_tokens: int = 4000,
            gen: int = 1) -> None:
        self.prompt[rid] = prompt
        super().add(rid, prompt, bucket, max_tokens, gen)


# bucket 1 of granularity 200 is [200, 400); its requests really run about 390 tokens
LATE_IN_BUCKET = LengthTail.from_lengths({0: [20] * 4, 1: [385, 390, 395]}, 2, 10)


def two_requests(tail: LengthTail | None) -> Runtime:
    rt = Runtime("reserve-static", 60, tail)
    rt.add(1, prompt=160, bucket=1)
    assert rt.step().admit.req_ids == (1,)
    rt.add(2, prompt=384, bucket=1)
    return rt


def test_refined_reserve_static_refuses_what_the_bucket_estimate_admits() -> None:
    # bucket: 1 reserves 200 tokens (12 more blocks), 2 needs 13 of the 25 free -> admitted.
    # refined: 1 reserves ~390 tokens (24 more blocks), 2 needs 25 -> waits.
    assert two_requests(None).step().admit.req_ids == (2,)
    assert two_requests(LATE_IN_BUCKET).step().admit.req_ids == ()


@pytest.mark.parametrize(("tail", "num_preemptions"), [(None, 1), (LATE_IN_BUCKET, 0)])
def test_the_refused_admission_is_the_one_that_would_have_been_preempted(
    tail: LengthTail | None, num_preemptions: int
) -> None:
    rt = two_requests(tail)  # both run 390 tokens: 35 + 49 blocks, more than the 60 there are
    for _ in range(2000):
        done = {r for r in rt.tokens if rt.tokens[r] - rt.prompt[r] >= 390}
        rt.step(done)
        if not rt.tokens:
            break
    assert not rt.tokens
    assert rt.adm.load().num_preemptions == num_preemptions


def test_refined_preemption_evicts_the_request_expected_to_run_longest() -> None:
    tail = LengthTail.from_lengths({0: [50] * 8, 1: [600] * 8}, 2, 10)
    victims = {}
    for name, t in (("bucket", None), ("refined", tail)):
        rt = Runtime("greedy", 12, t)
        rt.add(1, prompt=64, bucket=1)  # admitted first, expected to run 600 tokens
        rt.add(2, prompt=64, bucket=0)  # admitted second, expected to stop at 50
        assert rt.step().admit.req_ids == (1, 2)
        while not (preempted := rt.step().preempt.req_ids):
            pass
        victims[name] = preempted
    assert victims == {"bucket": (2,), "refined": (1,)}

"""Benchmark request lists: the paper's five workloads, real-trace lengths, or Arena prompts.

Length classes (TetriInfer §5): a prefill is heavy when the prompt has > 512 tokens, a decode is
heavy when it generates > 128 tokens. LPLD / LPHD / HPLD / HPHD draw (prompt, output) pairs
uniformly from the ShareGPT rows of that class; Mixed draws an equal quarter from each class
(remainder to the first classes) and shuffles them. ``Trace`` takes the lengths of the arrival
trace's own rows; ``Arena`` sends a real Arena prompt with one real response's length;
``Fixed`` sends every request with the same ``fixed_lens`` (prompt, output), like
``vllm bench serve --dataset-name random`` with no range (for checking one client against another).

Context rule (``fit_to_context``): a pair with prompt + output > max_model_len is scaled by one
factor f = max_model_len / (prompt + output), rounded down, so both keep their proportion; a
heavy side that falls to its threshold or below is raised to threshold + 1 (513 / 129) and the
other side gives up the excess, so every request keeps its class. Arena pairs that do not fit
are skipped instead (their lengths are labels for the predictor and must stay true).

Same spec and seed → the same requests: lengths, arrivals and prompts use three independent
generators seeded from ``(seed, stream)``, so changing the arrival process keeps the lengths.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from tetri_server.bench import arrivals, data
from tetri_server.bench.prompts import PromptTokenizer, RandomIdPrompts, TextPrompts

HEAVY_PROMPT_TOKENS = 512  # prompt_len > this: heavy prefill
HEAVY_OUTPUT_TOKENS = 128  # output_len > this: heavy decode
CLASSES = ("LPLD", "LPHD", "HPLD", "HPHD")
WORKLOADS = (*CLASSES, "Mixed", "Trace", "Arena", "Fixed")
PROMPT_MODES = ("ids", "text")
RATE_ARRIVALS = ("poisson", "constant")  # arrival processes driven by rate_rps
_LENGTHS, _ARRIVALS, _PROMPTS = 1, 2, 3  # generator streams


def length_class(prompt_len: int, output_len: int) -> str:
    heavy_p = prompt_len > HEAVY_PROMPT_TOKENS
    heavy_d = output_len > HEAVY_OUTPUT_TOKENS
    return f"{'H' if heavy_p else 'L'}P{'H' if heavy_d else 'L'}D"


def fit_to_context(
    prompt_len: int, output_len: int, max_model_len: int, keep_class: bool = True
) -> tuple[int, int]:
    """Scale (prompt, output) so prompt + output <= max_model_len (rule in the module doc)."""
    if prompt_len + output_len <= max_model_len:
        return prompt_len, output_len
    floor_p = HEAVY_PROMPT_TOKENS + 1 if keep_class and prompt_len > HEAVY_PROMPT_TOKENS else 1
    floor_o = HEAVY_OUTPUT_TOKENS + 1 if keep_class and output_len > HEAVY_OUTPUT_TOKENS else 1
    if floor_p + floor_o > max_model_len:
        cls = length_class(prompt_len, output_len)
        raise ValueError(f"max_model_len {max_model_len} cannot hold class {cls}")
    factor = max_model_len / (prompt_len + output_len)
    p = max(floor_p, math.floor(prompt_len * factor))
    o = max(floor_o, math.floor(output_len * factor))
    if p + o > max_model_len:  # a side was raised to its floor: the other gives up the excess
        if p > floor_p:
            p = max(floor_p, max_model_len - o)
        o = min(o, max_model_len - p)
    return p, o


@dataclass(frozen=True)
class BenchRequest:
    """One request to send. ``prompt_len`` counts what the server will see."""

    request_id: int
    prompt: list[int] | str
    prompt_len: int
    output_len: int  # sent as max_tokens with ignore_eos
    arrival_s: float  # seconds from the start of the run
    kind: str  # length class (LPLD, ...)
    source: str  # where the lengths came from: "sharegpt:<row>", "arena:<id>/<model>#<n>", ...


@dataclass(frozen=True)
class WorkloadSpec:
    """Everything that determines a request list; written beside every result."""

    name: str = "Mixed"  # one of WORKLOADS
    num_requests: int = 100
    seed: int = 0
    max_model_len: int = 4096
    prompt_mode: str = "ids"  # "ids": random token ids; "text": real Arena text
    arrival: str = "poisson"  # "poisson", "constant" or a trace name (data.TRACE_FILES)
    rate_rps: float | None = 1.0  # Poisson rate; for a trace, the target mean rate
    time_scale: float | None = None  # trace only: multiply the trace's gaps (overrides rate)
    trace_start: int = 0  # trace only: first row of the window
    arena_model: str | None = None  # Arena only: use only this model's responses
    # Arena only: only the prompts the shipped length predictor's training held out (its
    # test_frac and seed), so its classifier is not measured on prompts it learned
    arena_held_out: bool = True
    fixed_lens: tuple[int, int] | None = None  # Fixed only: (prompt_len, output_len)
    prompt_salt: int = 0  # != 0: other prompt tokens, the same lengths (a sweep's rate index)

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"workload {self.name!r} not in {WORKLOADS}")
        if self.prompt_mode not in PROMPT_MODES:
            raise ValueError(f"prompt_mode {self.prompt_mode!r} not in {PROMPT_MODES}")
        if self.arrival not in RATE_ARRIVALS and self.arrival not in data.TRACE_FILES:
            raise ValueError(
                f"arrival {self.arrival!r}: one of {[*RATE_ARRIVALS, *data.TRACE_FILES]}"
            )
        if self.num_requests <= 0:
            raise ValueError("num_requests must be > 0")
        if self.arrival in RATE_ARRIVALS and self.rate_rps is None:
            raise ValueError(f"{self.arrival} arrivals need rate_rps")
        if self.name == "Trace" and self.arrival in RATE_ARRIVALS:
            raise ValueError("the Trace workload takes its lengths from a trace arrival")
        if (self.name == "Fixed") != (self.fixed_lens is not None):
            raise ValueError("fixed_lens (prompt, output) is given exactly for the Fixed workload")
        if self.fixed_lens is not None:
            p, o = self.fixed_lens
            if p < 1 or o < 1 or p + o > self.max_model_len:
                raise ValueError(f"fixed lengths {p} + {o} must be >= 1 and fit max_model_len")

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


_Pair = tuple[int, int, str]  # (prompt_len, output_len, source)


def _class_pairs(
    spec: WorkloadSpec, rows: list[data.LengthRow], rng: np.random.Generator
) -> list[_Pair]:
    wanted = CLASSES if spec.name == "Mixed" else (spec.name,)
    shares = [spec.num_requests // len(wanted)] * len(wanted)
    for i in range(spec.num_requests % len(wanted)):
        shares[i] += 1
    pairs: list[_Pair] = []
    for cls, n in zip(wanted, shares, strict=True):
        idx = [i for i, r in enumerate(rows) if length_class(r.prompt_len, r.output_len) == cls]
        for j in rng.choice(len(idx), size=n, replace=n > len(idx)):
            row = rows[idx[int(j)]]
            p, o = fit_to_context(row.prompt_len, row.output_len, spec.max_model_len)
            pairs.append((p, o, f"sharegpt:{idx[int(j)]}"))
    if len(wanted) > 1:
        pairs = [pairs[int(k)] for k in rng.permutation(len(pairs))]
    return pairs


def _arrival_times(spec: WorkloadSpec, folder: Path, rng: np.random.Generator) -> list[float]:
    if spec.arrival == "poisson":
        assert spec.rate_rps is not None
        return arrivals.poisson_arrivals(spec.num_requests, spec.rate_rps, rng)
    if spec.arrival == "constant":
        assert spec.rate_rps is not None
        return arrivals.constant_arrivals(spec.num_requests, spec.rate_rps)
    rows = data.load_trace(folder, spec.arrival)
    window = arrivals.trace_window([r.time_s for r in rows], spec.num_requests, spec.trace_start)
    if spec.time_scale is not None:
        return arrivals.scale_times(window, spec.time_scale)
    if spec.rate_rps is not None:
        return arrivals.scale_times(window, arrivals.scale_for_rate(window, spec.rate_rps))
    return window


def _trace_pairs(spec: WorkloadSpec, folder: Path) -> list[_Pair]:
    rows = data.load_trace(folder, spec.arrival)[
        spec.trace_start : spec.trace_start + spec.num_requests
    ]
    out: list[_Pair] = []
    for i, r in enumerate(rows, start=spec.trace_start):
        p, o = fit_to_context(max(1, r.prompt_len), max(1, r.output_len), spec.max_model_len, False)
        out.append((p, o, f"{spec.arrival}:{i}"))
    return out


def _arena_requests(
    spec: WorkloadSpec, folder: Path, tok: PromptTokenizer, rng: np.random.Generator
) -> list[tuple[str, int, int, str]]:
    """(prompt text, prompt_len, real output_len, source) for random fitting Arena pairs."""
    prompts = {p.prompt_id: p.text for p in data.load_arena_prompts(folder)}
    if spec.arena_held_out:
        from tetri_server.predictor import artifact
        from tetri_server.predictor.train import held_out_ids

        split = artifact.read_meta(artifact.resolve(None))["training"]
        held = held_out_ids(prompts, float(split["test_frac"]), int(split["seed"]))
        prompts = {pid: text for pid, text in prompts.items() if pid in held}
    responses = [
        (i, r)  # i: index in data.load_arena_responses order, names the sample
        for i, r in enumerate(data.load_arena_responses(folder))
        if r.text.strip()
        and r.prompt_id in prompts
        and (spec.arena_model is None or r.model == spec.arena_model)
    ]
    out: list[tuple[str, int, int, str]] = []
    for k in rng.permutation(len(responses)):
        i, r = responses[int(k)]
        text = prompts[r.prompt_id]
        p = len(tok.encode(text, add_special_tokens=True))
        o = len(tok.encode(r.text, add_special_tokens=False))
        if p + o <= spec.max_model_len:
            out.append((text, p, o, f"arena:{r.prompt_id}/{r.model}#{i}"))
            if len(out) == spec.num_requests:
                return out
    raise ValueError(f"only {len(out)} Arena pairs fit max_model_len {spec.max_model_len}")


def build_workload(
    spec: WorkloadSpec,
    folder: Path,
    *,
    vocab: tuple[int, frozenset[int]] | None = None,
    tokenizer: PromptTokenizer | None = None,
) -> list[BenchRequest]:
    """The request list of ``spec``, sorted by arrival. ``vocab`` = (size, special ids) is needed
    for id prompts; ``tokenizer`` for text prompts and for the Arena workload."""
    rng_len = np.random.default_rng([spec.seed, _LENGTHS])
    salt = [spec.prompt_salt] if spec.prompt_salt else []  # none: the prompts as before
    rng_prompt = np.random.default_rng([spec.seed, _PROMPTS, *salt])
    times = _arrival_times(spec, folder, np.random.default_rng([spec.seed, _ARRIVALS]))
    if spec.name == "Arena":
        if tokenizer is None:
            raise ValueError("the Arena workload needs the served model's tokenizer")
        arena = _arena_requests(spec, folder, tokenizer, rng_len)
        return [
            BenchRequest(i, text, p, o, t, length_class(p, o), src)
            for i, ((text, p, o, src), t) in enumerate(zip(arena, times, strict=True))
        ]
    if spec.name == "Trace":
        pairs = _trace_pairs(spec, folder)
    elif spec.fixed_lens is not None:
        pairs = [(*spec.fixed_lens, "fixed")] * spec.num_requests
    else:
        pairs = _class_pairs(spec, data.load_sharegpt_lengths(folder), rng_len)
    maker: RandomIdPrompts | TextPrompts
    if spec.prompt_mode == "ids":
        if vocab is None:
            raise ValueError("token-id prompts need the vocabulary size (model folder)")
        maker = RandomIdPrompts(*vocab)
    else:
        if tokenizer is None:
            raise ValueError("text prompts need the served model's tokenizer")
        texts = [p.text for p in data.load_arena_prompts(folder)]
        texts = [texts[int(k)] for k in rng_prompt.permutation(len(texts))]
        maker = TextPrompts(tokenizer, texts, min_pool_tokens=2 * max(p for p, _, _ in pairs))
    out: list[BenchRequest] = []
    for i, ((p, o, src), t) in enumerate(zip(pairs, times, strict=True)):
        prompt, got = maker.make(p, rng_prompt)
        out.append(BenchRequest(i, prompt, got, o, t, length_class(got, o), src))
    return out

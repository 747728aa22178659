"""Our engine's greedy output equals transformers generate(), token for token, in every mode and
chunk size; blocks never leak; seeded sampling is reproducible."""

from __future__ import annotations

import dataclasses
import json
import shutil

import pytest
import torch

from tests.conftest import hf_greedy, random_prompts
from tetri_server.engine.runner import ScheduledSeq, StepPlan
from tetri_server.engine.sequence import Sequence
from tetri_server.llm import make_engine
from tetri_server.messages import SamplingParams

GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
# (mode, chunk, KV pool layout): both layouts in turn (auto is head-major for the tiny models)
MODES = [("coupled", 2048, "token-major"), ("coupled-chunked", 512, "head-major"),
         ("coupled-chunked", 97, "token-major"), ("coupled-chunked", 16, "head-major"),
         ("coupled-chunked", 7, "token-major")]


@pytest.fixture(scope="module", params=["llama", "opt", "qwen2", "mistral"])
def family_case(request, model_dir):
    """A checkpoint, 24 prompts of mixed lengths (1..400 tokens) and HF's greedy outputs."""
    path = model_dir(request.param)
    prompts = random_prompts(24, 8000, (1, 400), seed=1)
    return path, prompts, hf_greedy(path, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize(("mode", "chunk", "layout"), MODES)
def test_greedy_equals_transformers(family_case, mode, chunk, layout):
    path, prompts, ref = family_case
    # A small pool forces relocations (extents that cannot grow in place) during decode.
    eng = make_engine(str(path), f"cluster.mode={mode}", f"prefill.token_budget={chunk}",
                      "kv.block_size=16", "kv.num_blocks=700", "decode.max_batch=24",
                      f"kv.layout={layout}")
    assert (eng.kv.stride(3) == eng.spec.num_kv_heads * eng.spec.head_dim) == (
        layout == "token-major")
    got = eng.generate(prompts, GREEDY)
    mismatches = [i for i, (g, r) in enumerate(zip(got, ref, strict=True)) if g != r]
    assert not mismatches, f"{len(mismatches)} prompts differ, first {mismatches[0]}"
    assert eng.allocator.num_free == eng.allocator.num_blocks


def test_packed_fixed_size_chunks_with_padding_match(model_dir):
    """Prefill-only steps of exactly chunk_size tokens (TetriInfer packing, last one padded)."""
    path = model_dir("llama")
    prompts = random_prompts(20, 8000, (3, 60), seed=2)
    eng = make_engine(str(path), "cluster.mode=coupled-chunked", "prefill.token_budget=64",
                      "kv.num_blocks=400", pad_chunks=True)
    for i, p in enumerate(prompts):
        eng.add_request(i, p, GREEDY)
    plan = eng.loop.plan()
    assert plan.num_tokens == 64 and len(plan.slices) > 1  # several prompts packed in one chunk
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for d in eng.step():
            got[d.req_id].extend(d.token_ids)
    assert [got[i] for i in range(len(prompts))] == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_staggered_arrivals_decode_with_different_context_lengths(model_dir):
    path = model_dir("opt")
    prompts = random_prompts(8, 8000, (5, 300), seed=3)
    ref = hf_greedy(path, prompts, 12)
    eng = make_engine(str(path), "cluster.mode=coupled-chunked", "prefill.token_budget=64",
                      "kv.num_blocks=300")
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):  # a new request joins every two steps
        eng.add_request(i, p, params)
        for _ in range(2):
            for d in eng.step():
                got[d.req_id].extend(d.token_ids)
    while eng.has_unfinished():
        for d in eng.step():
            got[d.req_id].extend(d.token_ids)
    assert [got[i] for i in range(len(prompts))] == ref


def test_preemption_under_memory_pressure_still_matches(model_dir):
    path = model_dir("llama")
    prompts = random_prompts(6, 8000, (40, 60), seed=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng = make_engine(str(path), "cluster.mode=coupled-chunked", "prefill.token_budget=64",
                      "kv.block_size=16", "kv.num_blocks=20", "model.max_model_len=256",
                      "kv.layout=token-major")
    got = eng.generate(prompts, params)
    assert eng.loop.num_preemptions > 0
    assert got == hf_greedy(path, prompts, 40)
    assert eng.allocator.num_free == 20


@pytest.mark.parametrize("on", [True, False])
def test_decode_waiting_kv_first_reaches_the_coupled_engine(model_dir, on):
    """``decode.waiting_kv_first`` (new key): the coupled loop's admission takes it from the
    config (the simulator's test shows what it changes)."""
    eng = make_engine(str(model_dir("llama")), f"decode.waiting_kv_first={str(on).lower()}")
    assert eng.loop.admission.waiting_kv_first is on


@pytest.mark.parametrize(("mode", "sets", "bound"), [
    ("coupled-chunked", ("prefill.token_budget=64",), 64),  # the step's budget bounds it
    ("coupled", ("decode.recompute_tokens=32",), 32),
])
def test_a_preempted_request_is_recomputed_in_slices_and_still_matches(model_dir, mode, sets,
                                                                       bound):
    """Regression (inter-token gap spike): a request preempted for blocks was recomputed whole
    (prompt and generated tokens, 100-160 here) in the step that re-admitted it, so the other
    rows of that step waited for a whole prefill. Now no step computes more than the bound of
    a recompute, and greedy output still equals transformers."""
    path = model_dir("llama")
    prompts = random_prompts(6, 8000, (100, 120), seed=4)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng = make_engine(str(path), f"cluster.mode={mode}", *sets, "kv.block_size=16",
                      "kv.num_blocks=30", "model.max_model_len=256")
    for i, p in enumerate(prompts):
        eng.add_request(i, p, params)
    recomputes: list[int] = []  # tokens of each recompute row, as the runner is given them
    steps: list[int] = []  # tokens of each step with a recompute
    execute = eng.runner.execute

    def watched(plan: StepPlan):
        rows = [i.num_tokens for i in plan.items if i.seq.num_output > 0 and i.num_tokens > 1]
        recomputes.extend(rows)
        if rows:
            steps.append(plan.num_tokens)
        return execute(plan)

    eng.runner.execute = watched
    got: dict[int, list[int]] = {i: [] for i in range(len(prompts))}
    while eng.has_unfinished():
        for d in eng.step():
            got[d.req_id].extend(d.token_ids)
    assert eng.loop.num_preemptions > 0 and recomputes
    assert max(recomputes) <= bound, recomputes
    if mode == "coupled-chunked":  # the rows and the recompute within the step's budget
        assert max(steps) <= 64, steps
    assert [got[i] for i in range(len(prompts))] == hf_greedy(path, prompts, 40)
    assert eng.allocator.num_free == 30


def test_a_batch_with_a_bad_prompt_leaves_nothing_behind(model_dir):
    """Regression (review of session 63): generate() added prompts one by one, so one refused
    left those before it queued, and the next generate() stepped them too and failed with a
    KeyError on ids it did not own."""
    eng = make_engine(str(model_dir("llama")), "model.max_model_len=64")
    with pytest.raises(ValueError, match="max_model_len"):
        eng.generate([[5, 6, 7], [5] * 100])
    greedy = SamplingParams(max_tokens=3, temperature=0.0)
    assert len(eng.generate([[8, 9, 10]], greedy)[0]) == 3
    eng.add_request(999, [11, 12], greedy)  # the caller's own request beside a batch
    assert len(eng.generate([[8, 9, 10]], greedy)[0]) == 3


def test_rope_scaling_from_config(model_dir):
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256,
               "rope_theta": 500000.0}
    path = model_dir("llama", rope_parameters=scaling)
    prompts = random_prompts(4, 8000, (200, 500), seed=5)
    eng = make_engine(str(path), "cluster.mode=coupled-chunked", "prefill.token_budget=128",
                      "kv.num_blocks=300")
    assert eng.generate(prompts, GREEDY) == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_a_context_extended_by_linear_rope_scaling_is_served_whole(model_dir):
    """Review of session 63: the served context was max_position_embeddings whatever the
    RoPE scaling; vLLM serves positions x factor for linear and yarn scaling (a 4,096-position
    checkpoint scaled x4 serves 16,384), and a longer --max-model-len was refused. Positions
    past the table still equal transformers."""
    from tetri_server.modelinfo import read_limits

    scaling = {"rope_type": "linear", "factor": 4.0, "rope_theta": 10000.0}
    path = model_dir("llama", rope_parameters=scaling, max_position_embeddings=128)
    assert read_limits(path).max_model_len() == 512
    eng = make_engine(str(path), "kv.num_blocks=200")
    assert eng.max_model_len == 512
    prompts = random_prompts(2, 8000, (200, 300), seed=7)  # past the 128 positions
    assert eng.generate(prompts, GREEDY) == hf_greedy(path, prompts, GREEDY.max_tokens)


def test_seeded_sampling_is_reproducible_and_independent_of_batch(model_dir):
    path = model_dir("llama")
    prompts = random_prompts(5, 8000, (5, 50), seed=6)
    sp = [SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, top_k=50, seed=100 + i,
                         ignore_eos=True) for i in range(5)]
    eng = make_engine(str(path), "kv.num_blocks=200")
    together = eng.generate(prompts, sp)
    alone = [eng.generate([p], [s])[0] for p, s in zip(prompts, sp, strict=True)]
    assert together == alone
    other_seed = eng.generate(prompts[:1], [SamplingParams(max_tokens=20, temperature=1.0,
                                                           seed=7, ignore_eos=True)])
    assert other_seed[0] != together[0]


def test_stop_rules_and_logprobs(model_dir):
    path = model_dir("llama")
    eng = make_engine(str(path), "kv.num_blocks=200")
    prompt = random_prompts(1, 8000, (10, 10), seed=7)[0]
    free = eng.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))[0]
    stop_at = free[3]
    eng.add_request(99, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True,
                                               stop_token_ids=[stop_at], logprobs=True))
    deltas = []
    while eng.has_unfinished():
        deltas += eng.step()
    tokens = [t for d in deltas for t in d.token_ids]
    assert tokens == free[:free.index(stop_at) + 1]
    assert deltas[-1].finish_reason == "stop"
    lps = [x for d in deltas for x in (d.logprobs or [])]
    assert len(lps) == len(tokens) and all(x <= 0.0 for x in lps)


def test_bad_requests_are_clear_errors(model_dir):
    eng = make_engine(str(model_dir("llama")), "kv.num_blocks=200", "model.max_model_len=64")
    with pytest.raises(ValueError, match="empty"):
        eng.add_request(1, [], GREEDY)
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request(2, list(range(5, 70)), GREEDY)


def test_in_process_bad_requests_are_refused_and_a_failed_step_wedges_nothing(model_dir,
                                                                               monkeypatch):
    """Regression (review of session 64): the in-process engine took a prompt id outside the
    vocabulary (an IndexError in the forward), a logit_bias id outside it (clamped onto the
    last token), max_tokens 0 (one token) and min_tokens above max_tokens; and a step that
    raised left its requests queued, so every later generate() raised the same error."""
    eng = make_engine(str(model_dir("llama")), "kv.num_blocks=200", "model.max_model_len=64")
    vocab = eng.runner.spec.vocab_size
    bad = [([5, vocab], GREEDY), ([5], SamplingParams(logit_bias={vocab + 5: 100.0})),
           ([5], SamplingParams(stop_token_ids=[-1])), ([5], SamplingParams(max_tokens=0)),
           ([5], SamplingParams(max_tokens=2, min_tokens=3))]
    for prompt, params in bad:
        with pytest.raises(ValueError, match="vocabulary|max_tokens"):
            eng.generate([prompt], params)
        assert not eng.has_unfinished()
    real = eng.runner.execute
    monkeypatch.setattr(eng.runner, "execute", lambda plan: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        eng.generate([[5, 6, 7], [8, 9]], GREEDY)
    monkeypatch.setattr(eng.runner, "execute", real)
    assert not eng.has_unfinished()
    assert len(eng.generate([[8, 9, 10]], GREEDY)[0]) == GREEDY.max_tokens


@pytest.mark.parametrize("family,overrides", [
    ("mistral", {"sliding_window": 64}),
    ("qwen2", {"use_sliding_window": True, "sliding_window": 48, "max_window_layers": 1}),
])
@pytest.mark.parametrize(("mode", "chunk", "layout"), [
    ("coupled", 2048, "token-major"), ("coupled-chunked", 97, "head-major"),
    ("coupled-chunked", 7, "token-major")])
def test_sliding_window_models_equal_transformers_past_the_window(model_dir, family, overrides,
                                                                  mode, chunk, layout):
    """Regression: a checkpoint whose sliding_window is shorter than the prompt was served with
    full attention (different greedy text from transformers). Prompts up to 5x the window,
    outputs that cross it too."""
    path = model_dir(family, **overrides)
    prompts = random_prompts(8, 8000, (30, 300), seed=9)
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    eng = make_engine(str(path), f"cluster.mode={mode}", f"prefill.token_budget={chunk}",
                      "kv.num_blocks=400", f"kv.layout={layout}")
    assert eng.spec.sliding_window == overrides["sliding_window"]
    assert eng.generate(prompts, params) == hf_greedy(path, prompts, params.max_tokens)


def test_a_llama_config_with_a_sliding_window_field_attends_to_the_whole_context(
        model_dir, tmp_path):
    """Regression: Llama has no window, and vLLM ignores the field; we applied it. (The
    reference here is transformers on the same weights without the field: transformers 5's
    forward ignores it too, but its DynamicCache keeps only the window when decoding, so its
    own generate() mixes the two.)"""
    path = model_dir("llama", sliding_window=16)
    plain = tmp_path / "plain"
    shutil.copytree(path, plain)
    cfg = json.loads((plain / "config.json").read_text())
    del cfg["sliding_window"]
    (plain / "config.json").write_text(json.dumps(cfg))
    prompts = random_prompts(2, 8000, (60, 100), seed=3)
    eng = make_engine(str(path), "kv.num_blocks=200")
    assert eng.spec.sliding_window is None
    assert eng.generate(prompts, GREEDY) == hf_greedy(plain, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_a_tied_config_with_another_lm_head_in_the_checkpoint_is_refused(model_dir, tmp_path,
                                                                         family):
    """Regression (review of session 64): config.json ties the head to the embeddings and the
    checkpoint also holds a different lm_head.weight. We served the embeddings (as vLLM);
    transformers serves the stored head: other tokens. Now refused, saying how to choose; a
    stored head equal to the embeddings loads as before."""
    from safetensors.torch import load_file, save_file

    src = model_dir(family, tie_word_embeddings=True)
    for name, differs in (("other", True), ("same", False)):
        path = tmp_path / name
        shutil.copytree(src, path)
        weights = load_file(path / "model.safetensors")
        embed = next(v for k, v in weights.items() if k.endswith("embed_tokens.weight"))
        weights["lm_head.weight"] = embed + 1.0 if differs else embed.clone()
        save_file(weights, path / "model.safetensors")
        if differs:  # OPT serves no head of its own: only the other way out is offered
            with pytest.raises(ValueError, match="tie_word_embeddings") as info:
                make_engine(str(path), "kv.num_blocks=50", "model.max_model_len=256")
            assert ("set it to false" in str(info.value)) == (family != "opt")
        else:
            prompts = random_prompts(1, 8000, (10, 20), seed=4)
            eng = make_engine(str(path), "kv.num_blocks=50", "model.max_model_len=256")
            assert eng.generate(prompts, GREEDY) == hf_greedy(path, prompts, GREEDY.max_tokens)


@pytest.mark.parametrize(("family", "overrides", "field"), [
    ("llama", {"hidden_act": "gelu"}, "hidden_act"),
    ("qwen2", {"hidden_act": "relu"}, "hidden_act"),
    ("llama", {"attention_bias": True}, "attention_bias"),
    ("llama", {"sliding_window": 16, "num_hidden_layers": 2,
               "layer_types": ["full_attention", "sliding_attention"]},
     "sliding_window"),
    ("mistral", {"mlp_bias": True}, "mlp_bias"),
    ("llama", {"rope_scaling": {"rope_type": "longrope", "short_factor": [1.0] * 8,
                                "long_factor": [2.0] * 8,
                                "original_max_position_embeddings": 64}}, "longrope"),
    ("opt", {"tie_word_embeddings": False}, "tie_word_embeddings"),
    ("opt", {"enable_bias": False}, "enable_bias"),
    ("opt", {"layer_norm_elementwise_affine": False}, "layer_norm_elementwise_affine"),
    ("opt", {"activation_function": "gelu_new"}, "activation_function"),
])
def test_configs_the_engine_would_serve_wrong_are_refused_by_name(family, overrides, field):
    """Regression: each of these loaded and served tokens different from transformers'
    (hidden_act, longrope past its original length, an untied OPT head), or failed to load
    with a bare KeyError or 'unexpected weights'. Now the load names the field."""
    from transformers import AutoConfig

    from tetri_server.engine.spec import spec_from_hf_config

    hf = AutoConfig.for_model(family, **overrides)
    with pytest.raises(ValueError, match=field):
        spec_from_hf_config(hf)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize(("mode", "chunk"), [("coupled", 2048), ("coupled-chunked", 97)])
def test_head_dim_64_equals_transformers(model_dir, kv_heads, mode, chunk):
    """Head dim 64 (the tiny models have 16): prompt chunks of 16+ rows take the tiled prefill
    attention kernel (engine/ops/prefill_attention.cpp) on AVX-512 builds, MHA and GQA; the
    KV pool is token-major with 4 kv heads (1 KiB a token, kv.layout = auto), head-major with
    2."""
    path = model_dir("llama", hidden_size=256, num_attention_heads=4,
                     num_key_value_heads=kv_heads, intermediate_size=512)
    prompts = random_prompts(8, 8000, (20, 300), seed=9)
    ref = hf_greedy(path, prompts, GREEDY.max_tokens)
    eng = make_engine(str(path), f"cluster.mode={mode}", f"prefill.token_budget={chunk}",
                      "kv.num_blocks=400")
    assert (eng.kv.stride(3) == kv_heads * 64) == (kv_heads == 4)
    assert eng.generate(prompts, GREEDY) == ref


@pytest.mark.parametrize("family", ["llama", "opt"])
def test_last_layer_runs_only_the_sampled_rows_with_the_same_logits(model_dir, family):
    """In a step of a decode row, a whole prompt and a prompt's first chunk, the last layer's
    attention (and all after it) sees the two sampled rows only, and their logits are those of
    the last layer run over every row."""
    eng = make_engine(str(model_dir(family)), "kv.block_size=16", "kv.num_blocks=200")
    ids = random_prompts(3, 8000, (120, 120), seed=9)
    decoding = Sequence(0, ids[0][:40], 39, GREEDY, num_computed=39)
    whole = Sequence(1, ids[1][:50], 50, GREEDY)
    first_chunk = Sequence(2, ids[2], 120, GREEDY)
    plan = StepPlan([ScheduledSeq(decoding, 1), ScheduledSeq(whole, 50),
                     ScheduledSeq(first_chunk, 60)])
    for item in plan.items:
        assert eng.kv_manager.reserve(item.seq, item.seq.num_tokens)
    tokens, meta, rows, _, _ = eng.runner._build(plan)
    assert rows == [0, 50] and meta.sampled_only is not None
    rows_t = torch.tensor(rows)
    model, kern = eng.model, eng.model.kernels
    seen: list[int] = []

    def attention(q, *args, **kwargs):
        seen.append(q.shape[0])
        return kern.attention(q, *args, **kwargs)

    model.kernels = dataclasses.replace(kern, attention=attention)
    try:
        with torch.inference_mode():
            cut = model(tokens, meta, eng.kv, rows_t)
            layers = len(seen)
            full = model(tokens, dataclasses.replace(meta, sampled_only=None), eng.kv, rows_t)
    finally:
        model.kernels = kern
    assert seen[:layers] == [111] * (layers - 1) + [2]
    assert seen[layers:] == [111] * layers
    assert torch.equal(cut.argmax(-1), full.argmax(-1))
    torch.testing.assert_close(cut, full, rtol=1e-5, atol=1e-5)


def test_a_request_failing_in_a_step_loses_no_other_requests_tokens(model_dir):
    """Regression (review of session 65's fix): a request that failed in a step (here its
    grammar allows no token) made LLMEngine.step() raise, and the deltas the others got in
    that step were lost for good (marked sent). Now step() returns them and names the failed
    one in ``failures``; generate() raises for a batch with a failed request."""
    from tetri_server.messages import Guide

    eng = make_engine(str(model_dir("llama")), "kv.num_blocks=200", "model.max_model_len=64")
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [ref] = eng.generate([[5, 6, 7]], plain)
    eng.add_request(100, [5, 6, 7], plain)
    eng.add_request(101, [8, 9], SamplingParams(max_tokens=6, temperature=0.0,
                                                guide=Guide("regex", "[^\\s\\S]")))
    got: list[int] = []
    while eng.has_unfinished():
        got += [t for d in eng.step() if d.req_id == 100 for t in d.token_ids]
    assert got == ref and "grammar" in eng.failures.pop(101) and not eng.failures
    with pytest.raises(RuntimeError, match="grammar"):
        eng.generate([[5, 6, 7], [8, 9]], [plain, SamplingParams(
            max_tokens=6, temperature=0.0, guide=Guide("regex", "[^\\s\\S]"))])
    assert not eng.has_unfinished() and eng.generate([[5, 6, 7]], plain) == [ref]


def test_generate_keeps_the_callers_own_requests_and_forgets_old_failures(model_dir):
    """Regression (session 66 review): generate() stepped requests added earlier with
    add_request() and dropped their deltas (marked sent, never returned); and a failure the
    caller had not popped from ``failures`` failed a later generate() whose new request took
    the same id."""
    from tetri_server.messages import Guide

    eng = make_engine(str(model_dir("llama")), "kv.num_blocks=200", "model.max_model_len=64")
    plain = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [ref] = eng.generate([[5, 6, 7]], plain)
    eng.add_request(7, [5, 6, 7], plain)
    assert eng.generate([[5, 6, 7]], plain) == [ref]  # it ran request 7 beside its own
    got: list[int] = []
    while True:
        deltas = eng.step()
        got += [t for d in deltas if d.req_id == 7 for t in d.token_ids]
        if not eng.has_unfinished() and not deltas:
            break
    assert got == ref
    eng.add_request(0, [8, 9], SamplingParams(max_tokens=6, temperature=0.0,
                                              guide=Guide("regex", "[^\\s\\S]")))
    while eng.has_unfinished():
        eng.step()
    assert "grammar" in eng.failures[0]  # not popped by the caller
    assert eng.generate([[5, 6, 7]], plain) == [ref]  # request 0 again: not the old failure


def test_the_in_process_engine_stops_on_generation_configs_eos_as_transformers(model_dir,
                                                                              tmp_path):
    """Regression (session 66 review): LLMEngine stopped only on config.json's EOS id, not on
    generation_config.json's (Llama 3 Instruct's <|eot_id|>), where transformers' generate()
    and vLLM stop (the HTTP server adds them as stop ids)."""
    from transformers import AutoModelForCausalLM

    src = model_dir("llama")
    prompt = [5, 6, 7, 8]
    greedy = SamplingParams(max_tokens=8, temperature=0.0)
    sets = ("kv.num_blocks=64", "model.max_model_len=64")
    [plain] = make_engine(str(src), *sets).generate([prompt], greedy)
    dst = tmp_path / "eot"
    shutil.copytree(src, dst)
    gc_path = dst / "generation_config.json"
    gc = json.loads(gc_path.read_text()) if gc_path.is_file() else {}
    gc["eos_token_id"] = [json.loads((dst / "config.json").read_text())["eos_token_id"],
                          plain[2]]
    gc_path.write_text(json.dumps(gc))
    [got] = make_engine(str(dst), *sets).generate([prompt], greedy)
    model = AutoModelForCausalLM.from_pretrained(dst, dtype=torch.float32).eval()
    with torch.inference_mode():
        ref = model.generate(torch.tensor([prompt]), max_new_tokens=8, do_sample=False)
    assert got == ref[0, len(prompt):].tolist() == plain[:3]


def test_the_in_process_engine_takes_decode_estimate_refined_as_the_coupled_worker(model_dir):
    """Regression (session 66 review): ``decode.estimate = "refined"`` was ignored in-process
    (no length tail), so under preemption the engine evicted another request than the coupled
    worker did with the same config."""
    from tetri_server.workers.base import length_tail

    for estimate in ("refined", "bucket"):
        eng = make_engine(str(model_dir("llama")), "kv.num_blocks=64", "model.max_model_len=64",
                          f"decode.estimate={estimate}")
        want = length_tail(eng.cfg, "none")
        assert (eng.loop.admission.tail is None) == (want is None) == (estimate == "bucket")

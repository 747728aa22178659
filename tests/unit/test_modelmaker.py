"""The model maker: deterministic random checkpoints that transformers loads offline."""

from __future__ import annotations

import gzip
import json
import statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from tetri_server.modelmaker import (
    FAMILIES,
    STAMP_FILE,
    TOKENIZER_DIR,
    builtin_model_path,
    count_parameters,
    make_model,
    parse_builtin,
)

DATA = Path(__file__).resolve().parents[3] / "shared" / "data"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("models")
    return {family: make_model(root / family, family, "tiny") for family in FAMILIES}


@pytest.fixture(scope="module")
def tok(tiny: dict[str, Path]):  # noqa: ANN201 - a transformers tokenizer
    return AutoTokenizer.from_pretrained(tiny["llama"], local_files_only=True)


def test_same_args_give_identical_bytes(tmp_path: Path, tiny: dict[str, Path]) -> None:
    again = make_model(tmp_path / "a", "llama", "tiny", seed=0)
    other = make_model(tmp_path / "b", "llama", "tiny", seed=1)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        assert (again / name).read_bytes() == (tiny["llama"] / name).read_bytes(), name
    weights = (again / "model.safetensors").read_bytes()
    assert (other / "model.safetensors").read_bytes() != weights


def test_shipped_tokenizer_is_small_and_complete() -> None:
    files = sorted(p.name for p in TOKENIZER_DIR.iterdir())
    assert files == ["tokenizer.json", "tokenizer_config.json"]
    assert sum(p.stat().st_size for p in TOKENIZER_DIR.iterdir()) < 1_000_000


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_loads_offline_and_generates(family: str, tiny: dict[str, Path]) -> None:
    path = tiny[family]
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    config = model.config
    assert config.vocab_size == len(tokenizer) == 8192
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 0)
    assert config.tie_word_embeddings
    if family != "opt":
        assert config.num_key_value_heads < config.num_attention_heads  # GQA
    if family == "qwen2":
        assert model.model.layers[0].self_attn.q_proj.bias.abs().sum() > 0
    ids = tokenizer("The quick brown fox jumps over", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
        again = model.generate(ids, max_new_tokens=8, min_new_tokens=8, do_sample=False)
    assert out.shape == (1, ids.shape[1] + 8)
    assert torch.equal(out, again)


def test_greedy_margins_are_clear_and_logits_sane(tiny: dict[str, Path], tok) -> None:  # noqa: ANN001
    model = AutoModelForCausalLM.from_pretrained(tiny["llama"], local_files_only=True).eval()
    ids = tok("Explain how a hash map handles collisions.", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=50,
            min_new_tokens=50,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    logits = torch.cat(out.logits)  # [50, vocab]
    top2 = logits.topk(2, dim=-1).values
    assert statistics.median((top2[:, 0] - top2[:, 1]).tolist()) > 1e-2
    assert torch.isfinite(logits).all()
    assert logits.std() < 20


def test_config_overrides_reach_the_checkpoint(tmp_path: Path) -> None:
    rope = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 512,
    }
    path = make_model(
        tmp_path,
        "llama",
        "tiny",
        rope_scaling=rope,
        rope_theta=500000.0,
        max_position_embeddings=4096,
    )
    config = AutoConfig.from_pretrained(path, local_files_only=True)
    assert config.max_position_embeddings == 4096
    saved = (path / "config.json").read_text()  # rope_parameters (v5) or rope_scaling (v4)
    assert '"rope_type": "llama3"' in saved and '"rope_theta": 500000.0' in saved


def test_chat_template_renders_chatml(tok) -> None:  # noqa: ANN001
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == (
        "<s><|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    closed = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert not closed.endswith("assistant\n")
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert ids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 3


@pytest.mark.parametrize(
    "text", ["naïve café, Grüße — 日本語のテキスト 🚀", "  two  spaces\n\ttab . <b>x</b>"]
)
def test_tokenizer_round_trips(tok, text: str) -> None:  # noqa: ANN001
    ids = tok(text).input_ids
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == text


def test_english_token_counts_are_plausible(tok) -> None:  # noqa: ANN001
    sentence = (
        "Write a short story about a lighthouse keeper who discovers that the sea "
        "has been sending him letters every night."
    )
    assert len(sentence.split()) == 20
    assert 20 <= len(tok(sentence).input_ids) <= 40


@pytest.mark.skipif(not DATA.is_dir(), reason="shared data folder not present")
def test_arena_prompts_tokenize_to_plausible_counts(tok) -> None:  # noqa: ANN001
    with gzip.open(DATA / "arena_prompts.jsonl.gz", "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    english = [r["prompt"] for r in rows if r.get("language", "English") == "English"][:300]
    ratios = [len(tok(p).input_ids) / max(1, len(p.split())) for p in english]
    assert 1.0 < statistics.median(ratios) < 2.5


def test_builtin_is_made_once_and_shared_by_racers(tmp_path: Path) -> None:
    with ThreadPoolExecutor(2) as pool:
        paths = list(pool.map(lambda _: builtin_model_path("tiny", tmp_path), range(2)))
    assert paths[0] == paths[1] == tmp_path / "llama-tiny-seed0"
    assert [p.name for p in tmp_path.iterdir()] == ["llama-tiny-seed0"]  # no temp leftovers
    weights = paths[0] / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    assert builtin_model_path("builtin:tiny", tmp_path) == paths[0]
    assert weights.stat().st_mtime_ns == mtime  # reused, not remade
    assert count_parameters(paths[0]) > 0


def test_builtin_replaces_a_stale_folder(tmp_path: Path) -> None:
    stale = tmp_path / "opt-tiny-seed0"
    stale.mkdir()
    (stale / STAMP_FILE).write_text('{"maker_version": 0}')
    path = builtin_model_path("builtin:opt-tiny", tmp_path)
    assert path == stale
    assert AutoConfig.from_pretrained(path, local_files_only=True).model_type == "opt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["opt-tiny-seed0"]


def test_parse_builtin_names() -> None:
    assert parse_builtin("tiny") == ("llama", "tiny")
    assert parse_builtin("builtin:qwen2-bench") == ("qwen2", "bench")
    with pytest.raises(ValueError, match="family"):
        parse_builtin("gpt2-tiny")
    with pytest.raises(ValueError, match="size"):
        parse_builtin("huge")

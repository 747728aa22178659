"""`tetri-server serve MODEL --port ... --served-model-name ...`: vLLM-style flags as aliases of
config keys (file < env < flags < --set), MODEL as the default served name, Hugging Face ids
resolved from the local cache only (a fake cache laid out as huggingface_hub lays it out)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import pytest

from tetri_server.api.models import ServedModel
from tetri_server.cli import _serve_args, build_config
from tetri_server.config import ConfigError

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    _serve_args(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def fake_hub(home: Path, repo_id: str, model: Path) -> Path:
    """``HF_HOME/hub/models--org--name/{refs/main, snapshots/<commit>/...}``."""
    repo = home / "hub" / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for f in model.iterdir():
        (snap / f.name).write_bytes(f.read_bytes())
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def test_flags_alias_config_keys_with_file_env_flag_set_precedence(tmp_path: Path) -> None:
    toml = tmp_path / "c.toml"
    toml.write_text('[server]\nport = 7000\nhost = "127.0.0.1"\napi_key = "file"\n'
                    '[cluster]\nmode = "coupled"\n')
    env = {"TETRI_API_KEY": "env"}
    cfg, _ = build_config(parse("--config", str(toml)), env)
    assert (cfg.server.port, cfg.server.api_key, cfg.cluster.mode) == (7000, "env", "coupled")
    args = parse("--config", str(toml), "--port", "7001", "--api-key", "flag", "--host",
                 "0.0.0.0", "--mode", "disaggregated", "--prefill-workers", "2",
                 "--decode-workers", "3", "--max-model-len", "128", "--dtype", "float32")
    cfg, _ = build_config(args, env)
    assert (cfg.server.port, cfg.server.api_key, cfg.server.host) == (7001, "flag", "0.0.0.0")
    assert (cfg.cluster.mode, cfg.cluster.prefill_workers, cfg.cluster.decode_workers) == (
        "disaggregated", 2, 3)
    assert (cfg.model.max_model_len, cfg.model.dtype) == (128, "float32")
    cfg, _ = build_config(parse("--allowed-origins", "http://a.example", "https://b.example",
                                "--generation-config", "vllm", "--tool-call-parser", "hermes",
                                "--enable-auto-tool-choice"), env)
    assert cfg.server.allowed_origins == ("http://a.example", "https://b.example")
    assert cfg.model.use_generation_config is False and cfg.model.tool_call_parser == "hermes"
    cfg, _ = build_config(parse("--port", "7001", "--set", "server.port=7002"), env)
    assert cfg.server.port == 7002  # --set wins over everything


def test_vllms_dtype_aliases_are_taken() -> None:
    """Regression: ``--dtype half`` and ``--dtype float`` (vLLM's spellings) were refused."""
    for given, dtype in (("half", "float16"), ("float", "float32"), ("bfloat16", "bfloat16")):
        assert build_config(parse("--dtype", given), {})[0].model.dtype == dtype


def test_bad_flag_values_name_the_key() -> None:
    with pytest.raises(ConfigError, match="cluster.mode"):
        build_config(parse("--mode", "tetris"), {})
    with pytest.raises(ConfigError, match="model.dtype"):
        build_config(parse("--dtype", "int3"), {})


def test_model_argument_is_the_default_served_name(model_dir) -> None:
    folder = str(model_dir("llama", "tiny"))
    cfg, given = build_config(parse(folder), {})
    assert (cfg.model.path, cfg.model.served_name, given) == (folder, folder, folder)
    cfg, _ = build_config(parse(folder, "--served-model-name", "a", "b"), {})
    assert (cfg.model.served_name, cfg.model.served_aliases) == ("a", ("b",))
    cfg, _ = build_config(parse("builtin:tiny"), {})
    assert cfg.model.served_name == "builtin:tiny"
    cfg, _ = build_config(parse("--set", f"model.path={folder}"), {})
    assert cfg.model.served_name == ""  # no MODEL argument: the folder name, as before


def test_served_model_accepts_names_path_and_folder_and_lists_names(model_dir) -> None:
    folder = str(model_dir("llama", "tiny"))
    cfg, given = build_config(parse(folder, "--served-model-name", "a", "b"), {})
    served = ServedModel.from_config(cfg.model, "a", root=folder, given_path=given)
    assert served.names == ("a", "b") and served.root == folder
    assert {"a", "b", folder, Path(folder).name} <= served.accepted
    # started with a relative path, named by its absolute one (guidellm model=/abs/path)
    rel = os.path.relpath(folder)
    cfg, given = build_config(parse(rel), {})
    served = ServedModel.from_config(cfg.model, rel, root=rel, given_path=given)
    assert {rel, os.path.abspath(folder)} <= served.accepted
    assert served.root == os.path.abspath(folder)  # /v1/models root loads from any folder


def test_hugging_face_id_resolves_from_the_local_cache(tmp_path: Path, model_dir) -> None:
    snap = fake_hub(tmp_path / "hf", "org/tiny", model_dir("llama", "tiny"))
    env = {"HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1"}
    cfg, given = build_config(parse("org/tiny"), env)
    assert Path(cfg.model.path) == snap and cfg.model.served_name == "org/tiny"
    assert given == "org/tiny"
    served = ServedModel.from_config(cfg.model, "org/tiny", root=cfg.model.path, given_path=given)
    assert served.names == ("org/tiny",) and "tiny" in served.accepted
    cfg, _ = build_config(parse("--set", "model.path=org/tiny"), env)
    assert Path(cfg.model.path) == snap and cfg.model.served_name == "org/tiny"  # not the hash


def test_missing_hub_model_is_a_clear_error_and_never_downloads(tmp_path: Path) -> None:
    env = {"HF_HOME": str(tmp_path / "empty")}
    with pytest.raises(ConfigError, match=r"org/absent.*local Hugging Face cache.*hf download"):
        build_config(parse("org/absent"), env)
    with pytest.raises(ConfigError, match="not a folder"):
        build_config(parse(str(tmp_path / "no" / "such")), env)
    # regression (review of session 64): a typo in a built-in name was a traceback at start
    with pytest.raises(ConfigError, match="builtin:nope"):
        build_config(parse("builtin:nope"), env)


def test_a_max_model_len_beyond_the_models_is_refused(model_dir) -> None:
    """Regression: --max-model-len above the model's max_position_embeddings was lowered to it
    without a word (vLLM refuses to start)."""
    from tetri_server.control.cluster import Cluster

    path = model_dir("llama", "tiny")  # 2048 positions
    cfg, _ = build_config(parse(str(path), "--max-model-len", "4096"), {})
    with pytest.raises(ConfigError, match=r"max_model_len = 4096 .* \(2048 positions"):
        Cluster(cfg.resolve(cpu_count=2))
    cfg, _ = build_config(parse(str(path), "--max-model-len", "1024"), {})
    assert Cluster(cfg.resolve(cpu_count=2)).max_model_len == 1024


def test_the_generation_configs_eos_ids_stop_requests_without_its_sampling_defaults(
        tmp_path: Path, model_dir) -> None:
    """Regression (review of session 62): ``--generation-config vllm`` dropped the eos ids of
    generation_config.json with its sampling defaults, so a model whose config.json names
    fewer (Qwen2.5-Instruct: <|endoftext|>; Llama-3-Instruct: 128001) ran past its end of
    text to max_tokens on /v1/completions. vLLM keeps them."""
    import json
    import shutil

    folder = tmp_path / "m"
    shutil.copytree(model_dir("llama", "tiny"), folder)
    (folder / "generation_config.json").write_text(json.dumps(
        {"eos_token_id": [2, 7], "temperature": 0.6}))
    for flag, temperature in (("auto", 0.6), ("vllm", None)):
        cfg, given = build_config(parse(str(folder), "--generation-config", flag), {})
        served = ServedModel.from_config(cfg.model, "m", root=str(folder), given_path=given)
        assert served.defaults.eos_token_ids == (2, 7)
        assert served.defaults.temperature == temperature

from __future__ import annotations

import dataclasses
import json
import tomllib
from pathlib import Path

import pytest

from tetri_server.config import (
    ClusterConfig,
    Config,
    ConfigError,
    KVConfig,
    ModelConfig,
    load_config,
)

SHIPPED = Path(__file__).resolve().parents[2] / "config.toml"


def _section_keys(cfg: Config) -> dict[str, set[str]]:
    return {
        f.name: {g.name for g in dataclasses.fields(getattr(cfg, f.name))}
        for f in dataclasses.fields(cfg)
    }


# --- shipped config.toml --------------------------------------------------------------------


def test_shipped_config_equals_builtin_defaults() -> None:
    assert load_config(SHIPPED, []) == Config()
    assert load_config(None, []) == Config()


def test_shipped_keys_match_dataclasses_both_ways() -> None:
    with open(SHIPPED, "rb") as f:
        raw = tomllib.load(f)
    assert {s: set(keys) for s, keys in raw.items()} == _section_keys(Config())


def test_every_shipped_key_has_a_comment_above_it() -> None:
    lines = SHIPPED.read_text().splitlines()
    for i, line in enumerate(lines):
        if "=" in line and not line.lstrip().startswith("#"):
            assert lines[i - 1].lstrip().startswith("#"), f"undocumented key: {line}"


def test_keys_later_code_relies_on() -> None:
    keys = _section_keys(Config())
    required = """
        server.host server.port server.api_key server.max_body_bytes server.max_queued_requests
        server.request_timeout_s server.drain_timeout_s server.log_level
        model.path model.dtype model.max_model_len model.served_name
        cluster.mode cluster.prefill_workers cluster.decode_workers cluster.workers
        cluster.device cluster.threads_per_worker cluster.worker_start_timeout_s
        cluster.restart_workers
        kv.transport kv.block_size kv.num_blocks kv.memory_fraction kv.memory_gb
        prefill.chunk_size prefill.policy prefill.sched_batch prefill.token_budget
        decode.policy decode.max_batch predictor.kind predictor.artifact
        predictor.heavy_decode_tokens dispatch.policy monitor.interval_ms
        flip.enabled flip.idle_s flip.low_load flip.window_s flip.min_interval_s
    """.split()
    for name in required:
        section, key = name.split(".")
        assert key in keys[section], name


def test_documented_defaults() -> None:
    cfg = Config()
    assert (cfg.server.host, cfg.server.port, cfg.server.api_key) == ("127.0.0.1", 8000, "")
    assert cfg.model.path == "builtin:tiny"
    assert cfg.cluster.mode == "disaggregated"
    assert (cfg.cluster.prefill_workers, cfg.cluster.decode_workers, cfg.cluster.workers) == (
        1,
        1,
        2,
    )
    assert (cfg.kv.transport, cfg.kv.block_size, cfg.kv.num_blocks) == ("auto", 16, 0)
    assert (cfg.prefill.chunk_size, cfg.prefill.sched_batch) == (0, 16)
    assert cfg.decode.max_batch == 32
    assert cfg.predictor.heavy_decode_tokens == 128
    assert cfg.monitor.interval_ms == 100
    assert (cfg.flip.enabled, cfg.flip.low_load) == (False, 0.1)


# --- --set overrides ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("override", "section", "key", "expected"),
    [
        ("server.port=8123", "server", "port", 8123),
        ("server.host=0.0.0.0", "server", "host", "0.0.0.0"),
        ('server.api_key="s3cret"', "server", "api_key", "s3cret"),
        ("server.api_key=12345", "server", "api_key", "12345"),  # str key keeps the text
        ("server.api_key=a=b", "server", "api_key", "a=b"),
        ("server.api_key=", "server", "api_key", ""),
        ("model.path=/models/opt-125m", "model", "path", "/models/opt-125m"),
        ("model.dtype=bfloat16", "model", "dtype", "bfloat16"),
        ("cluster.mode=coupled-chunked", "cluster", "mode", "coupled-chunked"),
        ("cluster.restart_workers=false", "cluster", "restart_workers", False),
        ("kv.memory_fraction=0.25", "kv", "memory_fraction", 0.25),
        ("kv.memory_gb=2", "kv", "memory_gb", 2.0),  # int accepted for a float key
        ("flip.window_s=30.5", "flip", "window_s", 30.5),
        (" prefill.chunk_size = 512 ", "prefill", "chunk_size", 512),
    ],
)
def test_set_override_of_each_type(override: str, section: str, key: str, expected: object) -> None:
    value = getattr(getattr(load_config(None, [override]), section), key)
    assert value == expected
    assert type(value) is type(expected)


def test_overrides_apply_on_top_of_file_in_order(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = 9000\n[cluster]\nmode = "coupled"\nworkers = 3\n')
    cfg = load_config(path, ["server.port=9001", "server.port=9002"])
    assert (cfg.server.port, cfg.cluster.mode, cfg.cluster.workers) == (9002, "coupled", 3)
    assert cfg.kv == KVConfig()  # untouched sections keep their defaults


def test_overrides_validate_together_not_one_by_one() -> None:
    # device=cuda alone with transport=shm would be invalid; the final combination is checked.
    cfg = load_config(None, ["kv.transport=cuda_ipc", "cluster.device=cuda"])
    assert (cfg.kv.transport, cfg.cluster.device) == ("cuda_ipc", "cuda")


@pytest.mark.parametrize(
    ("override", "must_mention"),
    [
        ("server.prot=1", ["server.prot", "port", "api_key", "log_level"]),
        ("srv.port=1", ["srv", "server", "cluster", "flip"]),
        ("server.port", ["section.key=value"]),
        ("port=1", ["section.key=value"]),
        ("server.port=abc", ["server.port", "'abc'", "integer"]),
        ("server.port=true", ["server.port", "integer"]),
        ("server.port=1.5", ["server.port", "integer"]),
        ("kv.memory_gb=lots", ["kv.memory_gb", "number"]),
        ("flip.enabled=yes", ["flip.enabled", "true or false"]),
        ("cluster.mode=tetris", ["cluster.mode", "disaggregated", "coupled", "coupled-chunked"]),
        ("cluster.device=1", ["cluster.device", "cpu", "cuda"]),
        ("decode.policy=lazy", ["decode.policy", "greedy", "reserve-static", "reserve-dynamic"]),
        ("decode.estimate=mean", ["decode.estimate", "bucket", "refined"]),
        ("prefill.policy=random", ["prefill.policy", "fcfs", "sjf", "ljf"]),
        ("kv.transport=tcp", ["kv.transport", "auto", "shm", "cuda_ipc"]),
        ("server.port=70000", ["server.port", "65535"]),
        ("decode.max_batch=0", ["decode.max_batch", ">= 1"]),
        ("kv.memory_fraction=1.5", ["kv.memory_fraction"]),
    ],
)
def test_bad_override_names_the_key_and_the_choices(override: str, must_mention: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(None, [override])
    for text in must_mention:
        assert text in str(info.value)


def test_keys_that_undo_each_other_are_refused() -> None:
    """Regression (review of session 64): with both on, past a chunk of prompt backlog the
    prefill worker handed every kept request back and kept it again in the same step, each
    step, dispatching none (and resetting its admission estimate each time)."""
    with pytest.raises(ConfigError, match="local_decode_hand_back.*local_decode_balance_back"):
        load_config(None, ["prefill.local_decode_hand_back=true",
                           "prefill.local_decode_balance_backlog=true"])
    load_config(None, ["prefill.local_decode_hand_back=true"])
    load_config(None, ["prefill.local_decode_balance_backlog=true"])
    from tetri_server.sim.cluster import SimConfig  # the simulator refuses them too

    with pytest.raises(ValueError, match="contradict"):
        SimConfig(local_decode_hand_back=True, local_decode_balance=True,
                  local_decode_balance_backlog=True)


def test_bad_file_values_name_the_file_and_key(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[server]\nport = "8000"\n')
    with pytest.raises(ConfigError, match=r"c\.toml.*server\.port.*integer"):
        load_config(path, [])
    path.write_text("[cluster]\nmode = 'fast'\n")
    with pytest.raises(ConfigError, match=r"c\.toml.*cluster\.mode.*disaggregated"):
        load_config(path, [])
    path.write_text("[cluster]\nfoo = 1\n")
    with pytest.raises(ConfigError, match=r"unknown key cluster\.foo.*prefill_workers"):
        load_config(path, [])
    path.write_text("port = 8000\n")
    with pytest.raises(ConfigError, match=r"unknown section \[port\]"):
        load_config(path, [])
    path.write_text("[server\n")
    with pytest.raises(ConfigError, match="invalid TOML"):
        load_config(path, [])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.toml", [])


# --- cross-field rules ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "must_mention"),
    [
        (["kv.transport=cuda_ipc"], "cluster.device = cuda"),
        (["cluster.device=cuda", "kv.transport=shm"], "cluster.device = cpu"),
        (["cluster.prefill_workers=0"], "cluster.prefill_workers >= 1"),
        (["cluster.decode_workers=0"], "cluster.decode_workers >= 1"),
        (["flip.enabled=true"], "at least 3 workers"),
        (["flip.enabled=true", "cluster.mode=coupled", "cluster.workers=4"], "disaggregated"),
        (["predictor.kind=none"], "predictor.kind"),
        # every calibration pass (<= 4096 tokens) full of the kept requests' rows: the worker
        # failed at start with "no samples"
        (["prefill.local_decode_batch=4096", "prefill.local_decode_chunk=0"],
         "prefill.chunk_size"),
    ],
)
def test_cross_field_rules(overrides: list[str], must_mention: str) -> None:
    with pytest.raises(ConfigError, match=must_mention):
        load_config(None, overrides)


def test_cross_field_rules_allow_valid_combinations() -> None:
    load_config(None, ["cluster.mode=coupled", "cluster.prefill_workers=0"])  # ignored there
    load_config(None, ["flip.enabled=true", "cluster.decode_workers=2"])
    load_config(None, ["predictor.kind=none", "decode.policy=greedy"])
    load_config(None, ["predictor.kind=none", "cluster.mode=coupled"])  # admits greedily
    load_config(None, ["cluster.device=cuda"])  # transport auto
    load_config(None, ["prefill.local_decode_batch=4096"])  # chunk steps carry no rows
    load_config(None, ["prefill.local_decode_batch=4096", "prefill.local_decode_chunk=0",
                       "prefill.chunk_size=512"])
    load_config(None, ["prefill.local_decode_batch=4096", "prefill.local_decode_chunk=0",
                       "cluster.elastic=off"])


def test_constructors_validate_too() -> None:
    with pytest.raises(ConfigError, match="model.dtype"):
        ModelConfig(dtype="int8")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="cuda_ipc"):
        Config(kv=KVConfig(transport="cuda_ipc"))


# --- frozen, serialisable -------------------------------------------------------------------


def test_frozen() -> None:
    cfg = Config()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.server = cfg.server  # type: ignore[misc]


def test_to_dict_round_trips_through_json() -> None:
    cfg = load_config(None, ["cluster.mode=coupled", "kv.memory_gb=1.5"]).resolve(cpu_count=8)
    data = json.loads(json.dumps(cfg.to_dict()))
    assert data["cluster"]["mode"] == "coupled"
    assert Config.from_dict(data) == cfg


def test_to_dict_redacts_the_api_key_unless_asked() -> None:
    cfg = load_config(None, ["server.api_key=s3cret"])
    assert cfg.to_dict()["server"]["api_key"] == "<redacted>"
    assert Config.from_dict(cfg.to_dict(redact=False)) == cfg


def test_bad_override_error_names_the_set_not_the_file() -> None:
    with pytest.raises(ConfigError, match=r"^--set 'cluster.mode=tetris': cluster\.mode"):
        load_config(SHIPPED, ["cluster.mode=tetris"])


def test_overrides_that_a_rule_ties_together_are_judged_together(tmp_path: Path) -> None:
    """Regression: each --set was checked in a section otherwise at its defaults, so two keys
    a rule ties (a stall bound covering 3 load reports) could not be raised together from the
    command line, in either order, nor one beside the file's other; and a long stall bound
    is not refused for the heartbeat's max_step_s (the larger of the two applies)."""
    for sets in (["monitor.interval_ms=2000", "monitor.stall_timeout_s=10"],
                 ["monitor.stall_timeout_s=10", "monitor.interval_ms=2000"],
                 ["monitor.stall_timeout_s=200"]):
        load_config(None, sets)
    path = tmp_path / "c.toml"
    path.write_text("[monitor]\nstall_timeout_s = 10.0\n")
    assert load_config(path, ["monitor.interval_ms=2000"]).monitor.interval_ms == 2000
    with pytest.raises(ConfigError, match=r"^--set 'monitor.interval_ms=2000'"):
        load_config(None, ["monitor.interval_ms=2000"])  # still refused alone
    # the error names the --set it is about, not the first one refused alone
    with pytest.raises(ConfigError, match=r"^--set 'server.port=-1'"):
        load_config(None, ["monitor.stall_timeout_s=10", "monitor.interval_ms=2000",
                           "server.port=-1"])


# --- resolve --------------------------------------------------------------------------------


def test_resolve_on_cpu() -> None:
    cfg = Config()
    resolved = cfg.resolve(cpu_count=8)
    assert resolved is not cfg and cfg == Config()  # a new object; the original is untouched
    assert resolved.model.dtype == "float32"
    assert resolved.kv.transport == "shm"
    assert resolved.cluster.threads_per_worker == 4  # 8 cores / (1 prefill + 1 decode)
    assert resolved.model.served_name == "tiny"
    # left for the runtime: they need the model or the device
    assert (resolved.model.max_model_len, resolved.prefill.chunk_size) == (0, 0)
    assert resolved.kv.num_blocks == 0
    assert resolved.resolve(cpu_count=8) == resolved  # idempotent


def test_resolve_on_cuda() -> None:
    resolved = load_config(None, ["cluster.device=cuda"]).resolve(cpu_count=16)
    assert resolved.model.dtype == "bfloat16"
    assert resolved.kv.transport == "cuda_ipc"


@pytest.mark.parametrize(
    ("overrides", "elastic"),
    [
        ([], True),  # auto on cpu: elastic P/D
        (["cluster.device=cuda"], False),  # auto on cuda: the strict split
        (["cluster.device=cuda", "cluster.elastic=on"], True),
        (["cluster.elastic=off"], False),
    ],
)
def test_resolve_elastic_by_device(overrides: list[str], elastic: bool) -> None:
    cfg = load_config(None, overrides)
    resolved = cfg.resolve(cpu_count=16)
    assert resolved.cluster.elastic == ("on" if elastic else "off")
    kept = (resolved.prefill.local_decode_batch, resolved.decode.local_prefill_tokens)
    assert kept == ((cfg.prefill.local_decode_batch, cfg.decode.local_prefill_tokens)
                    if elastic else (0, 0))
    assert kept != (0, 0) or not elastic  # the defaults are elastic on both sides
    assert resolved.resolve(cpu_count=16) == resolved  # idempotent


@pytest.mark.parametrize(
    ("overrides", "warned"),
    [
        (["cluster.device=cuda", "prefill.local_decode_batch=8"],
         ["prefill.local_decode_batch = 8"]),
        (["cluster.elastic=off", "decode.local_prefill_tokens=512"],
         ["decode.local_prefill_tokens = 512"]),
        (["cluster.device=cuda"], []),  # the defaults: nothing the user asked for is dropped
        (["cluster.device=cuda", "prefill.local_decode_batch=0"], []),
        (["cluster.device=cuda", "cluster.elastic=on", "prefill.local_decode_batch=8"], []),
        (["cluster.device=cuda", "cluster.mode=coupled", "prefill.local_decode_batch=8"], []),
    ],
)
def test_the_split_names_the_elastic_keys_it_overrides(overrides: list[str],
                                                       warned: list[str]) -> None:
    assert load_config(None, overrides).split_overrides() == warned


def test_resolve_keeps_explicit_values() -> None:
    cfg = load_config(
        None,
        [
            "model.dtype=float16",
            "model.served_name=m",
            "cluster.threads_per_worker=3",
            "kv.transport=shm",
        ],
    ).resolve(cpu_count=64)
    assert (cfg.model.dtype, cfg.model.served_name) == ("float16", "m")
    assert (cfg.cluster.threads_per_worker, cfg.kv.transport) == (3, "shm")


@pytest.mark.parametrize(
    ("overrides", "cpu_count", "threads"),
    [
        (["cluster.mode=coupled", "cluster.workers=3"], 8, 2),
        (["cluster.prefill_workers=2", "cluster.decode_workers=2"], 2, 1),  # never 0
        ([], 2, 1),
    ],
)
def test_resolve_threads_divide_cores_among_workers(
    overrides: list[str], cpu_count: int, threads: int
) -> None:
    cfg = load_config(None, overrides).resolve(cpu_count=cpu_count)
    assert cfg.cluster.threads_per_worker == threads


@pytest.mark.parametrize(
    ("path", "name"),
    [
        ("/models/Qwen2-0.5B/", "Qwen2-0.5B"),
        ("models/opt-125m", "opt-125m"),
        ("builtin:tiny", "tiny"),
    ],
)
def test_resolve_served_name_from_path(path: str, name: str) -> None:
    cfg = Config(model=ModelConfig(path=path)).resolve(cpu_count=2)
    assert cfg.model.served_name == name


def test_num_workers_by_mode() -> None:
    assert ClusterConfig(prefill_workers=2, decode_workers=3).num_workers == 5
    assert ClusterConfig(mode="coupled", workers=4).num_workers == 4


@pytest.mark.parametrize("override", ["monitor.stall_timeout_s=nan", "kv.memory_gb=inf",
                                      "flip.window_s=-inf"])
def test_non_finite_numbers_are_refused(override: str) -> None:
    """Regression: nan passed every range check (a nan stall timeout turned stall detection
    off: `silent > nan` is never true), and inf sized a KV pool into a crash in every worker."""
    with pytest.raises(ConfigError, match="finite"):
        load_config(None, [override])


def test_a_flip_low_load_the_flip_rule_refuses_is_a_config_error() -> None:
    """Regression: flip.low_load in [0.7, 1] passed validation, then the control process
    died at start-up building the flip policy (which needs low < its high 0.7), flips on or
    off."""
    from tetri_server.config.sections import FLIP_HIGH_UTIL
    from tetri_server.policy.flip import HIGH_UTIL, FlipPolicy

    assert FLIP_HIGH_UTIL == HIGH_UTIL
    with pytest.raises(ConfigError, match="low_load"):
        load_config(None, ["flip.low_load=0.7"])
    cfg = load_config(None, ["flip.low_load=0.69"])
    FlipPolicy(low_util=cfg.flip.low_load)


def test_auto_dtype_on_cuda_keeps_a_float16_checkpoint_in_float16(tmp_path) -> None:
    """Review of session 63: auto meant bfloat16 on cuda whatever the weights, so a float16
    checkpoint (Llama-2, OPT) lost mantissa bits and its greedy tokens could differ from
    vLLM's (auto keeps float16) and transformers' in float16."""
    from tetri_server.modelinfo import checkpoint_dtype

    cuda = load_config(None, ["cluster.device=cuda"])
    assert cuda.resolve(cpu_count=2, checkpoint_dtype="float16").model.dtype == "float16"
    assert cuda.resolve(cpu_count=2, checkpoint_dtype="bfloat16").model.dtype == "bfloat16"
    assert cuda.resolve(cpu_count=2, checkpoint_dtype="float32").model.dtype == "bfloat16"
    assert cuda.resolve(cpu_count=2).model.dtype == "bfloat16"
    assert load_config(None, []).resolve(cpu_count=2, checkpoint_dtype="float16"
                                         ).model.dtype == "float32"
    (tmp_path / "config.json").write_text('{"torch_dtype": "float16"}')
    assert checkpoint_dtype(tmp_path) == "float16"
    (tmp_path / "config.json").write_text('{"text_config": {"dtype": "bfloat16"}}')
    assert checkpoint_dtype(tmp_path) == "bfloat16"


def test_the_rope_scaled_context_is_the_one_the_workers_serve(tmp_path) -> None:
    """The control process reads config.json raw, the workers through transformers'
    standardised config; both must find the same context. Regression (review of session 63):
    a top-level ``original_max_position_embeddings`` beside a yarn dict, or ``rope_scaling``
    beside a default ``rope_parameters``, gave control a context the workers did not serve (a
    9,000-token prompt accepted, then cut at the workers' 8,192 with "length")."""
    import json

    from transformers import AutoConfig

    from tetri_server.engine.spec import spec_from_hf_config
    from tetri_server.modelinfo import read_limits, rope_context

    assert rope_context(4096, {"rope_type": "linear", "factor": 4.0}) == 16384
    assert rope_context(32768, {"type": "yarn", "factor": 4.0,
                                "original_max_position_embeddings": 32768}) == 131072
    assert rope_context(8192, {"rope_type": "llama3", "factor": 8.0}) == 8192
    from tetri_server.modelmaker import build_config

    base = build_config("llama", "tiny").to_dict()
    yarn = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0}
    cases = [
        {"original_max_position_embeddings": 2048, "rope_scaling": yarn},
        {"original_max_position_embeddings": 8192,
         "rope_scaling": {**yarn, "original_max_position_embeddings": 2048}},
        {"rope_scaling": {**yarn, "original_max_position_embeddings": 2048}},
        {"rope_scaling": {"type": "linear", "factor": 4.0}},
        {"rope_scaling": {"rope_type": "linear", "factor": 4.0},
         "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0}},
        {"rope_parameters": {**yarn, "original_max_position_embeddings": 1024}},
    ]
    for i, over in enumerate(cases):
        folder = tmp_path / str(i)
        folder.mkdir()
        cfg = {k: v for k, v in base.items() if not k.startswith("rope")}
        (folder / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 4096,
                                                         **over}))
        engine = spec_from_hf_config(AutoConfig.from_pretrained(str(folder))).max_model_len(0)
        assert read_limits(folder).max_model_len() == engine, over


def test_limits_default_as_transformers_configs_do(tmp_path):
    """A config.json that leaves out max_position_embeddings / vocab_size / eos_token_id (the
    config classes default them) gives control the limits the workers load with: it was a
    KeyError at start-up."""
    import json

    from transformers import CONFIG_MAPPING

    from tetri_server.modelinfo import CONFIG_DEFAULTS, read_limits

    for family, (positions, vocab, eos) in CONFIG_DEFAULTS.items():
        hf = CONFIG_MAPPING[family]()
        assert (hf.max_position_embeddings, hf.vocab_size, hf.eos_token_id) == (
            positions, vocab, eos), family
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    limits = read_limits(tmp_path)
    assert (limits.max_model_len(), limits.vocab_size, limits.eos_token_ids) == (2048, 32000, (2,))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ValueError, match="no max_position_embeddings"):
        read_limits(tmp_path)

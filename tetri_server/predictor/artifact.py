"""The classifier artifact: ``NAME.npz`` (the head) beside ``NAME.json`` (everything else).

No pickle: the npz holds only ``weight`` [width, num_buckets] and ``bias`` [num_buckets]
arrays and is opened with ``allow_pickle=False``; the JSON records the granularity, bucket
count, length cap, the tokenizer lengths were counted with, the feature spec, the training run
and its held-out scores. Everything is validated at load, so a bad artifact fails at start-up.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from tetri_server.predictor.base import PredictorError
from tetri_server.predictor.features import FeatureSpec
from tetri_server.predictor.train import Head

FORMAT = "tetri-length-predictor/1"
ENCODER = "hashed-ngrams"
ARTIFACT_DIR = Path(__file__).resolve().parent / "artifacts"
DEFAULT_ARTIFACT = "arena_g200"
_REQUIRED = (
    "format",
    "encoder",
    "granularity",
    "num_buckets",
    "max_tokens",
    "features",
    "tokenizer",
)


@dataclass(frozen=True)
class Artifact:
    """A loaded, validated artifact."""

    path: Path  # the .json file
    meta: dict[str, Any]
    spec: FeatureSpec
    head: Head

    @property
    def granularity(self) -> int:
        return int(self.meta["granularity"])

    @property
    def num_buckets(self) -> int:
        return int(self.meta["num_buckets"])


def shipped_artifacts() -> list[str]:
    return sorted(p.stem for p in ARTIFACT_DIR.glob("*.json"))


def resolve(artifact: str | Path | None) -> Path:
    """The metadata path of ``artifact``: a shipped name (``arena_g400``), a path to
    NAME(.json|.npz), or a folder holding exactly one artifact."""
    if artifact is None:
        artifact = DEFAULT_ARTIFACT
    p = Path(artifact)
    if p.is_dir():
        found = sorted(p.glob("*.json"))
        if len(found) != 1:
            raise PredictorError(
                f"length-predictor artifact folder {p} must hold exactly one "
                f"NAME.json (+ NAME.npz), found {len(found)}"
            )
        return found[0]
    candidates = (
        [p.with_suffix(".json")]
        if p.suffix in (".json", ".npz")
        else [p.with_name(p.name + ".json"), ARTIFACT_DIR / f"{p.name}.json"]
    )
    for c in candidates:
        if c.is_file():
            return c
    raise PredictorError(
        f"length-predictor artifact not found: {str(artifact)!r} (looked for "
        f"{', '.join(str(c) for c in candidates)}; shipped: {', '.join(shipped_artifacts())})"
    )


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PredictorError(f"corrupt length-predictor artifact {path}: {e}") from e
    if not isinstance(meta, dict):
        raise PredictorError(f"corrupt length-predictor artifact {path}: not a JSON object")
    missing = [k for k in _REQUIRED if k not in meta]
    if missing:
        raise PredictorError(f"corrupt length-predictor artifact {path}: missing {missing}")
    if meta["format"] != FORMAT or meta["encoder"] != ENCODER:
        raise PredictorError(
            f"length-predictor artifact {path} is {meta['format']!r}/"
            f"{meta['encoder']!r}; this build reads {FORMAT!r}/{ENCODER!r}"
        )
    for key in ("granularity", "num_buckets", "max_tokens"):  # (bool is an int too)
        value = meta[key]
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise PredictorError(f"corrupt length-predictor artifact {path}: {key} must be a "
                                 f"positive integer, got {value!r}")
    if not isinstance(meta["tokenizer"], dict):
        raise PredictorError(f"corrupt length-predictor artifact {path}: tokenizer must be an "
                             f"object, got {meta['tokenizer']!r}")
    return meta


def load(artifact: str | Path | None = None) -> Artifact:
    """Load and validate an artifact; every failure is a ``PredictorError`` naming the file."""
    path = resolve(artifact)
    meta = read_meta(path)
    npz = path.with_suffix(".npz")
    try:
        spec = FeatureSpec.from_json(meta["features"])
        k = int(meta["num_buckets"])
        with np.load(npz, allow_pickle=False) as f:
            weight = np.asarray(f["weight"], dtype=np.float32)
            bias = np.asarray(f["bias"], dtype=np.float32)
    except (OSError, KeyError, TypeError, ValueError, zipfile.BadZipFile) as e:
        raise PredictorError(f"corrupt length-predictor artifact {npz}: {e}") from e
    if weight.shape != (spec.width, k) or bias.shape != (k,):
        raise PredictorError(
            f"corrupt length-predictor artifact {npz}: weight {weight.shape} / bias "
            f"{bias.shape}, expected ({spec.width}, {k}) / ({k},)"
        )
    if not (np.isfinite(weight).all() and np.isfinite(bias).all()):
        raise PredictorError(f"corrupt length-predictor artifact {npz}: non-finite weights")
    return Artifact(path, meta, spec, Head(weight, bias))


def save(path_stem: str | Path, meta: dict[str, Any], head: Head) -> Path:
    """Write NAME.npz and NAME.json; returns the .json path. ``meta`` gets format/encoder."""
    stem = Path(path_stem)
    stem.parent.mkdir(parents=True, exist_ok=True)
    full = {"format": FORMAT, "encoder": ENCODER, **meta}
    # float16 halves the shipped file; the held-out scores in the JSON are computed from this
    # rounded head after reloading it (pipeline.train_and_save), so they describe what ships
    np.savez_compressed(
        stem.with_name(stem.name + ".npz"),
        weight=head.weight.astype(np.float16),
        bias=head.bias.astype(np.float32),
    )
    out = stem.with_name(stem.name + ".json")
    out.write_text(json.dumps(full, indent=2, sort_keys=False) + "\n", encoding="utf-8")
    return out

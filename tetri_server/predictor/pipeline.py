"""Split → train → save → reload → score: one call per granularity, used by both tools.

The held-out scores are computed with the artifact *as saved and reloaded* (float16 weights),
so the numbers recorded in its JSON are those of the file that ships, and the unit tests can
recompute them.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from tetri_server.predictor import artifact as artifact_io
from tetri_server.predictor import tails
from tetri_server.predictor.classifier import ClassifierPredictor
from tetri_server.predictor.data import Sample
from tetri_server.predictor.evaluate import baselines, ceiling, json_safe, score
from tetri_server.predictor.tokens import TokenCounter
from tetri_server.predictor.train import TrainConfig, split_by_prompt, train_head


def train_and_save(
    samples: Sequence[Sample],
    cfg: TrainConfig,
    out_stem: str | Path,
    prompt_counter: TokenCounter,
    tokenizer: dict[str, Any],
    data: dict[str, Any],
) -> dict[str, Any]:
    """Train one artifact on a prompt split of ``samples``; returns its metadata.

    ``tokenizer`` records what the output lengths were counted with (name, sha256);
    ``prompt_counter`` counts prompt tokens for the length-regression baseline; ``data``
    describes the training data (recorded as given).
    """
    train, test = split_by_prompt(samples, cfg.test_frac, cfg.seed)
    if not train or not test:
        raise ValueError(
            f"need prompts on both sides of the split, got {len(train)} training "
            f"and {len(test)} held-out responses"
        )
    start = time.perf_counter()
    head, cv = train_head(train, cfg)
    run = asdict(cfg)
    run["spec"] = cfg.spec.to_json()
    run["l2_grid"] = list(cfg.l2_grid)
    meta: dict[str, Any] = {
        "granularity": cfg.granularity,
        "num_buckets": cfg.num_buckets,
        "max_tokens": cfg.max_tokens,
        "features": cfg.spec.to_json(),
        "tokenizer": tokenizer,
        "data": {**data, "responses": len(samples), "prompts": len({s.prompt_id for s in samples})},
        "training": {
            **run,
            "cv_accuracy": {f"{k:g}": v for k, v in cv.items()},
            "l2": max(cv, key=lambda k: (cv[k], k)),
            "train_responses": len(train),
            "train_s": time.perf_counter() - start,
        },
    }
    path = artifact_io.save(out_stem, meta, head)
    shipped = ClassifierPredictor(path)
    heldout = score(shipped, test)
    heldout.update(baselines(train, test, cfg.granularity, cfg.num_buckets, prompt_counter))
    heldout["ceiling"] = ceiling(test, cfg.granularity, cfg.num_buckets)
    meta["heldout"] = heldout
    meta["ceiling_all_data"] = ceiling(samples, cfg.granularity, cfg.num_buckets)
    full = artifact_io.read_meta(path)
    full.update(heldout=heldout, ceiling_all_data=meta["ceiling_all_data"])
    path.write_text(json.dumps(json_safe(full), indent=2, allow_nan=False) + "\n", encoding="utf-8")
    full[tails.KEY] = tails.compute(samples, shipped, cfg.test_frac, cfg.seed)
    tails.write(path, full[tails.KEY])  # the refined decode estimate's length distributions
    return full


def format_report(metas: Sequence[dict[str, Any]]) -> str:
    """A plain-text table of held-out scores, one row per trained artifact."""
    lines = [
        f"{'g':>4} {'K':>3} {'acc':>6} {'±1':>6} {'tau':>6} {'tau_E':>6} {'major':>6} "
        f"{'lenreg':>6} {'ceil2':>6} {'mode':>6} {'n':>6} {'l2':>7}"
    ]
    for m in metas:
        h, c = m["heldout"], m["ceiling_all_data"]
        lines.append(
            f"{m['granularity']:>4} {m['num_buckets']:>3} {h['accuracy']:>6.3f} "
            f"{h['within_one_bucket']:>6.3f} {h['kendall_tau']:>6.3f} "
            f"{h.get('kendall_tau_expected', float('nan')):>6.3f} {h['majority_accuracy']:>6.3f} "
            f"{h['length_regression_accuracy']:>6.3f} {c['two_sample_agreement']:>6.3f} "
            f"{h['ceiling']['prompt_mode_bound']:>6.3f} {h['n']:>6} {m['training']['l2']:>7g}"
        )
    return "\n".join(lines)

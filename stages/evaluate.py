"""`evaluate` stage: the GenEval protocol on the test prompts for one policy.

`policy` is `base` or a training run name such as `stepwise-s0` (its newest checkpoint).
Writes `data/eval/<policy>/results.jsonl`, `reports/eval/<policy>/metrics.json` (per-tag and
overall accuracy: DVC metrics) and `reports/eval/<policy>/samples.png`.
"""

from __future__ import annotations

import json

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipeline import layout
from pipeline.config import Config, ConfigError
from pipeline.evaluation import geneval_protocol, sample_grid
from pipeline.io import write_json, write_text
from pipeline.policy import checkpoints, load_backend, restore
from pipeline.tracking import log_artifact, log_metrics

GRID_IMAGES = 32


def policy_backend(cfg: Config, policy: str):
    """The base model, or a training run's newest checkpoint applied to it."""
    if policy == "base":
        return load_backend(cfg)
    run = cfg.path(layout.TRAIN / policy)
    if not checkpoints(run / "checkpoints"):
        raise ConfigError(f"policy: no checkpoint under {run} (train `{policy}` first)")
    return restore(cfg, run).backend


@task(name="evaluate", cache_policy=NO_CACHE)
def evaluate(cfg: Config, policy: str = "base") -> dict[str, float]:
    backend = policy_backend(cfg, policy)
    test = layout.load_prompts(cfg, "test")
    images, results, summary = geneval_protocol(backend, test, cfg)
    lines = "".join(json.dumps(row) + "\n" for row in results)
    write_text(cfg.path(layout.EVAL / policy / "results.jsonl"), lines)
    report = cfg.path(layout.REPORTS / "eval" / policy)
    write_json(report / "metrics.json", summary)
    # One image per prompt (the first seed), spread over the tags.
    first = list(range(0, len(results), cfg.evaluate.images_per_prompt))[:GRID_IMAGES]
    captions = [("✓ " if results[i]["correct"] else "✗ ") + results[i]["prompt"] for i in first]
    sample_grid(images[first], captions, report / "samples.png")
    log_metrics(
        {"geneval/overall": summary["overall"]}
        | {f"geneval/{tag}": value for tag, value in summary["per_tag"].items()}
    )
    log_artifact(report / "samples.png")
    return summary

"""`evaluate` stage: the GenEval protocol on the test prompts for one policy.

`policy` is `base` or a training run name such as `stepwise-s0` (its newest checkpoint).
Writes `data/eval/<policy>/results.jsonl`, `reports/eval/<policy>/metrics.json` (per-tag and
overall accuracy: DVC metrics) and `reports/eval/<policy>/samples.png`. The scores go to this
stage's MLflow run (tagged with the policy, method and seed) and, as `eval/geneval/...` at the
step of its rounds trained, onto the MLflow run of the training run evaluated. Under
`accelerate launch` every rank samples and judges its shard of the images; the main rank writes.
"""

from __future__ import annotations

import json

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipeline import distributed, layout
from pipeline.config import Config, ConfigError
from pipeline.evaluation import geneval_protocol, judged_grid
from pipeline.io import write_json, write_text
from pipeline.policy import TRACKING_FILE, checkpoints, load_backend, restore
from pipeline.tracking import continuable_run, log_artifact, log_metrics, log_run_metrics


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
    ranks = distributed.current()  # under `accelerate launch` each rank samples a shard
    images, results, summary = geneval_protocol(backend, test, cfg, ranks=ranks)
    if not ranks.is_main:
        return summary
    lines = "".join(json.dumps(row) + "\n" for row in results)
    write_text(cfg.path(layout.EVAL / policy / "results.jsonl"), lines)
    report = cfg.path(layout.REPORTS / "eval" / policy)
    # scores only (the image counts are in results.jsonl): DVC's tables stay narrow
    write_json(report / "metrics.json", {k: summary[k] for k in ("overall", "per_tag")})
    judged_grid(images, results, cfg.evaluate.images_per_prompt, report / "samples.png")
    scores = {"geneval/overall": summary["overall"]} | {
        f"geneval/{tag}": value for tag, value in summary["per_tag"].items()
    }
    log_metrics(scores)
    log_artifact(report / "samples.png")
    if policy != "base":
        run = cfg.path(layout.TRAIN / policy)
        if trained := continuable_run(run / TRACKING_FILE, cfg.root):
            rounds = len(checkpoints(run / "checkpoints"))
            log_run_metrics(trained, {f"eval/{k}": v for k, v in scores.items()}, step=rounds)
    return summary

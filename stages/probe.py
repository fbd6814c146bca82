"""`probe` task: a training run's held-out learning curve.

Every `train.eval_every` rounds (counting from the base policy, before round 0, and always
after the last round) the policy draws `train.probe_images` images per test prompt with the
evaluation sampler from the same fixed initial noise (`evaluate.seed`), judged by the GenEval
rules. Writes `<run>/probe/rounds=<n>.json` (n = rounds trained) and logs `probe/geneval`
(overall) and `probe/<tag>` to MLflow at step n. Sampling uses its own generators, so probing
does not change what the run trains (tested).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipeline import layout
from pipeline.config import Config
from pipeline.evaluation import geneval_protocol
from pipeline.io import write_json
from pipeline.policy import probe_file
from pipeline.tracking import log_metrics


@task(name="probe", cache_policy=NO_CACHE)
def probe(cfg: Config, run: Path, rounds_done: int, backend) -> dict[str, float]:
    test = layout.load_prompts(cfg, "test")
    _, _, summary = geneval_protocol(
        backend, test, cfg, images_per_prompt=cfg.train.probe_images, desc="probe"
    )
    metrics = {"probe/geneval": summary["overall"]} | {
        f"probe/{tag}": value for tag, value in summary["per_tag"].items()
    }
    write_json(probe_file(run, rounds_done), metrics)
    log_metrics(metrics, step=rounds_done)
    return metrics

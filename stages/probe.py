"""`probe` task: a training run's held-out learning curve.

Every `train.eval_every` rounds (counting from the base policy, before round 0, and always
after the last round) the policy draws `train.probe_images` images per test prompt with the
evaluation sampler from the same fixed initial noise (`evaluate.seed`), judged by the GenEval
rules. Writes `<run>/probe/rounds=<n>.json` (n = rounds trained) and logs `probe/geneval`
(overall) and `probe/<tag>` to MLflow at step n; a grid of the probe's images, judged, goes to
`<run>/probe/rounds=<n>.png` and to the MLflow run's artifacts under `probe/`. Sampling uses its
own generators, so probing does not change what the run trains (tested).
"""

from __future__ import annotations

from pathlib import Path

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipeline import layout
from pipeline.config import Config
from pipeline.evaluation import geneval_protocol, judged_grid
from pipeline.io import write_json
from pipeline.policy import probe_file
from pipeline.tracking import log_artifact, log_metrics


@task(name="probe", cache_policy=NO_CACHE)
def probe(cfg: Config, run: Path, rounds_done: int, backend) -> dict[str, float]:
    test = layout.load_prompts(cfg, "test")
    images, results, summary = geneval_protocol(
        backend, test, cfg, images_per_prompt=cfg.train.probe_images, desc="probe"
    )
    metrics = {"probe/geneval": summary["overall"]} | {
        f"probe/{tag}": value for tag, value in summary["per_tag"].items()
    }
    path = probe_file(run, rounds_done)
    write_json(path, metrics)
    judged_grid(images, results, cfg.train.probe_images, path.with_suffix(".png"))
    log_metrics(metrics, step=rounds_done)
    log_artifact(path.with_suffix(".png"), "probe")
    return metrics

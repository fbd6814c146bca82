"""`refine` stage: the second pretraining cycle of the embedded base model.

Reads the first cycle (`data/base/pretrained`, written by `base`) and restarts flow training from
its weights (`base.refine_*`: steps, peak lr, warmup; a warm restart with a fresh optimizer),
writing the policy's base model to `model.path` (`data/base/model`), the loss curve of both
cycles to `reports/base/refine_loss.png` and its metrics to `reports/base/refine_metrics.json`.
A separate stage so that a longer or shorter refine reuses the hour of first-cycle training;
the result equals a from-scratch `pretrain_base` with the same arguments. SD3: nothing to do.
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipeline import layout
from pipeline.config import Config
from pipeline.io import atomic_path, write_json
from pipeline.pretrain import loss_curve, pretrain_base, pretrain_pool, tail_mean
from pipeline.tracking import log_artifact, log_metrics


@task(name="refine", cache_policy=NO_CACHE)
def refine(cfg: Config) -> dict[str, float]:
    report = cfg.path(layout.REPORTS / "base")
    if cfg.model.backend == "sd3":
        write_json(report / "refine_metrics.json", {"backend": "sd3"})
        return {}
    first_cycle = cfg.path(layout.PRETRAINED)
    if not first_cycle.is_dir():
        raise FileNotFoundError(f"{first_cycle} is missing (run `creditflow base` first)")
    with atomic_path(cfg.path(cfg.model.path)) as tmp:
        history = pretrain_base(
            tmp,
            prompts=pretrain_pool(cfg),
            image_size=cfg.world.image_size,
            resume_from=first_cycle,
            params=cfg.base,
        )
    losses = history["flow_loss"]
    metrics = {
        "refine_seconds": history["seconds"].get("refine", 0.0),
        "pretrain_seconds": sum(history["seconds"].values()),
    }
    # refine_steps 0: the first cycle is the base model as it is, with no restart to mark
    restart = cfg.base.steps if cfg.base.refine_steps else None
    if restart is not None:
        metrics["refine_loss_final"] = tail_mean(losses[restart:])
    write_json(report / "refine_metrics.json", metrics)
    loss_curve(losses, report / "refine_loss.png", restart=restart)
    log_metrics({f"base/{k}": v for k, v in metrics.items()})
    log_artifact(report / "refine_loss.png")
    return metrics

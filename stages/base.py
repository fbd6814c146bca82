"""`base` stage: the base policy.

ShapesWorld: pretrain the embedded flow model's autoencoder and first flow cycle
(`data/base/pretrained`; the `refine` stage turns it into `data/base/model`) on renders; write
the loss curve and the summary metrics to `reports/base/`. SD3: check the local weights
directory, train nothing. The learned reward ShapesCLIP is the `shapesclip` stage's.

`base.pool: world` pretrains on every line of the world, the way SD3 was pretrained on the web
before anyone ran GenEval on it: the test prompts' scenes are seen as pretraining data, while
GRPO only ever trains on the train split. `train` pretrains on the train split alone, a harder
held-out setting (single_object then has one test prompt the base model never saw).
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipeline import layout
from pipeline.config import Config
from pipeline.io import atomic_path, write_json
from pipeline.pretrain import loss_curve, pretrain_base, pretrain_pool, tail_mean
from pipeline.tracking import log_artifact, log_metrics


@task(name="base", cache_policy=NO_CACHE)
def base(cfg: Config) -> dict[str, float]:
    report = cfg.path(layout.REPORTS / "base")
    if cfg.model.backend == "sd3":
        from pipeline.sd3 import check_directory

        check_directory(cfg.path(cfg.model.path))
        write_json(report / "metrics.json", {"backend": "sd3"})
        return {}
    first_cycle = cfg.base.model_copy(update={"refine_steps": 0})
    with atomic_path(cfg.path(layout.PRETRAINED)) as tmp:
        history = pretrain_base(
            tmp, prompts=pretrain_pool(cfg), params=first_cycle, image_size=cfg.world.image_size
        )
    losses = history["flow_loss"]
    metrics = {
        "flow_loss_final": tail_mean(losses),
        "pretrain_seconds": sum(history["seconds"].values()),
        "parameters": sum(history["num_parameters"].values()),
    }
    write_json(report / "metrics.json", metrics)
    loss_curve(losses, report / "loss.png")
    log_metrics({f"base/{k}": v for k, v in metrics.items()})
    log_artifact(report / "loss.png")
    return metrics

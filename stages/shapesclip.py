"""`shapesclip` stage: ShapesWorld's learned reward.

ShapesWorld: train ShapesCLIP (`data/base/shapesclip`), a small contrastive text-image model that
the `shapes_clip` reward and the re-scoring ablations read, on renders of every scene of the
configured world, and write its summary metrics to `reports/base/shapesclip_metrics.json`. A stage
of its own, independent of the base policy, so that a new reward recipe does not retrain the
policy's hour of pretraining. SD3: nothing to train (its rewards are local real-image models).
"""

from __future__ import annotations

from prefect import task
from prefect.cache_policies import NO_CACHE

from pipeline import layout
from pipeline.config import Config
from pipeline.io import write_json
from pipeline.tracking import log_metrics

METRICS_FILE = "shapesclip_metrics.json"


@task(name="shapesclip", cache_policy=NO_CACHE)
def shapesclip(cfg: Config) -> dict[str, float]:
    report = cfg.path(layout.REPORTS / "base")
    if cfg.model.backend == "sd3":
        write_json(report / METRICS_FILE, {"backend": "sd3"})
        return {}
    from pipeline.rewards import SHAPESCLIP_DIR
    from pipeline.shapesclip import train_shapesclip
    from pipeline.world import world_lines

    params = cfg.shapesclip
    # captions of the configured world (hard negatives may leave it)
    clip = train_shapesclip(
        cfg.path(SHAPESCLIP_DIR),
        steps=params.steps,
        batch_size=params.batch_size,
        lr=params.lr,
        seed=params.seed,
        image_size=cfg.world.image_size,
        pool=world_lines(cfg.world),
    )
    metrics = {
        "hard_negative_accuracy": clip.get("hard_negative_accuracy", float("nan")),
        "seconds": clip.get("seconds", float("nan")),
    }
    write_json(report / METRICS_FILE, metrics)
    log_metrics({f"shapesclip/{k}": v for k, v in metrics.items()})
    return metrics

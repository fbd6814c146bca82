"""`prompts` stage: GenEval-format train/test prompt sets for ShapesWorld.

Outputs `data/prompts/{train,test}.jsonl` (one GenEval metadata line per prompt).
"""

from __future__ import annotations

from collections import Counter

from prefect import task

from pipeline import world
from pipeline.config import Config
from pipeline.io import atomic_path
from pipeline.layout import PROMPTS
from pipeline.tracking import log_metrics


@task(name="prompts")
def prompts(cfg: Config) -> dict[str, int]:
    train, test = world.make_prompts(
        cfg.prompts.n_train,
        cfg.prompts.n_test,
        seed=cfg.prompts.seed,
        shapes=tuple(cfg.world.shapes),
        colors=tuple(cfg.world.colors),
        max_count=cfg.world.max_count,
        mix=cfg.prompts.mix,
    )
    with atomic_path(cfg.path(PROMPTS)) as tmp:
        tmp.mkdir()
        world.write_prompts(tmp / "train.jsonl", train)
        world.write_prompts(tmp / "test.jsonl", test)
    counts = {
        f"prompts/{split}_{tag}": n
        for split, rows in (("train", train), ("test", test))
        for tag, n in Counter(row["tag"] for row in rows).items()
    }
    log_metrics(counts | {"prompts/train": len(train), "prompts/test": len(test)})
    return {"train": len(train), "test": len(test)}

"""Session 17 scratch check (issue 18): the committed ShapesCLIP recipe trained for more steps
(the relation is learned on some seeds and stays at chance on others, so maybe it is learned
late), then the world check's hard-negative gate. One torch thread:

    OMP_NUM_THREADS=1 python reports/world/shapesclip-seeds/longer/clip_longer.py SEED STEPS

writes /tmp/s17/clip-s<SEED>-n<STEPS> (the model) and /tmp/s17/wc-s<SEED>-n<STEPS> (the check).
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[4]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import world_check  # noqa: E402

from pipeline import shapesclip  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.world import world_lines  # noqa: E402


def train_and_check(seed: int, steps: int, model_dir: str, check_dir: str) -> None:
    """The committed recipe but `steps` and `seed`, then the world check into `check_dir`
    (shared with `position-pool/clip_position.py`, which swaps the image encoder first)."""
    cfg = load_config(REPO / "params.yaml")
    metrics = shapesclip.train_shapesclip(
        model_dir, steps=steps, batch_size=cfg.shapesclip.batch_size, lr=cfg.shapesclip.lr,
        seed=seed, image_size=cfg.world.image_size, pool=world_lines(cfg.world), progress=True,
    )  # fmt: skip
    print(json.dumps(metrics), flush=True)
    world_check.main(["--n-test", "144", "--samples", "8", "--clip", model_dir,
                      "--out", check_dir])  # fmt: skip


def main(seed: int, steps: int) -> None:
    train_and_check(seed, steps, f"/tmp/s17/clip-s{seed}-n{steps}", f"/tmp/s17/wc-s{seed}-n{steps}")


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]))

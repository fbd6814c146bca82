"""The base recipe's spread over pretraining seeds: one table from `base_quality.py` outputs.

    python reports/base/seeds/spread.py reports/base/quality.json reports/base/seeds/s1/quality.json

Prints a markdown table (one row per model, then mean and sample standard deviation) of the ODE
sampler's GenEval overall and per tag and of "a photo of a <shape>" per class, and says which
models meet the base target (`meets_target` of each file).
"""

import json
import sys
from pathlib import Path

import numpy as np

from pipeline.geneval import TAGS


def row(path: Path) -> tuple[list[float], dict, bool]:
    quality = json.loads(path.read_text())
    ode = quality["samplers"]["ode"]
    shapes = quality["single_object_by_shape"]
    values = [ode["overall"], *(ode["per_tag"][t] for t in TAGS), *shapes.values()]
    return values, shapes, quality["meets_target"]


def main(paths: list[str]) -> None:
    rows = [(Path(p), *row(Path(p))) for p in paths]
    classes = list(rows[0][2])
    header = ["model", "overall", *TAGS, *classes, "target met"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for path, values, _, met in rows:
        print(f"| {path.parent} | " + " | ".join(f"{v:.3f}" for v in values) + f" | {met} |")
    table = np.array([values for _, values, _, _ in rows])
    for name, stat in (("mean", table.mean(0)), ("std", table.std(0, ddof=1))):
        print(f"| {name} | " + " | ".join(f"{v:.3f}" for v in stat) + " | |")


if __name__ == "__main__":
    main(sys.argv[1:])

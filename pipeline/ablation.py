"""Ablations measured in another experiment, kept beside the default one.

A claim such as "joint beats per-step normalization" compares the default runs of a method with
the same method trained under other params (`dvc exp run -S advantages.normalization=per_step`,
or a copy of the project run with that override). `import_ablation` copies what the report needs
from that project — each run's `reports/train/<run>/` curves, its `data/eval/<run>/results.jsonl`
verdicts and `reports/eval/<run>/metrics.json` scores — into `reports/ablations/<name>/`, with
the params that differ, so that the comparison is committed and `creditflow report` reads it
without the other experiment's data.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from pipeline import layout
from pipeline.config import Config, CreditflowError, load_config
from pipeline.io import atomic_path, write_json

ABLATIONS = layout.REPORTS / "ablations"
TRAIN_FILES = ("rounds.json", "probe.json", "metrics.json")
RESULTS = "results.jsonl"  # per-image GenEval verdicts of the evaluation protocol
# settings that choose which runs exist rather than how any run trains
_RUN_SELECTION = {"train.method", "train.seed", "train.methods", "train.seeds"}


def param_differences(ours: Config, theirs: Config) -> dict[str, list]:
    """Dotted key -> [ours, theirs] of every parameter that differs. Paths are compared where
    they point (a copy of the project may name the same base model by an absolute path)."""
    mine, other = ours.flat(), theirs.flat()
    differing = {}
    for key in sorted(mine.keys() | other.keys()):
        a, b = mine.get(key), other.get(key)
        if key.endswith("path") and isinstance(a, str) and isinstance(b, str):
            if ours.path(a).resolve() == theirs.path(b).resolve():
                continue
        if a != b and key not in _RUN_SELECTION:
            differing[key] = [a, b]
    return differing


def import_ablation(cfg: Config, name: str, source: Path, method: str) -> Path:
    """Copy `method`'s evaluated runs of the project at `source` into `reports/ablations/<name>/`
    (`train/<run>/` curves, `eval/<run>/` verdicts and scores, `ablation.json`: the params that
    differ and where they came from). Refuses to replace an existing ablation of that name."""
    folder = cfg.path(ABLATIONS / name)
    if folder.exists():
        raise CreditflowError(
            f"{folder} exists: an ablation is never overwritten; move it aside or import under "
            "another --name"
        )
    theirs = load_config(Path(source) / "params.yaml")
    differences = param_differences(cfg, theirs)
    if not differences:
        raise CreditflowError(
            f"{source} has the same params as this project: nothing to ablate (run it with the "
            "ablation's -S overrides first)"
        )
    runs = [
        layout.run_name(method, seed)
        for seed in theirs.train.seeds
        if theirs.path(layout.EVAL / layout.run_name(method, seed) / RESULTS).is_file()
    ]
    if not runs:
        raise CreditflowError(
            f"{source} has no evaluated {method} run (data/eval/{method}-s<seed>/{RESULTS}): "
            f"run `creditflow train --method {method}` and `creditflow evaluate` there first"
        )
    with atomic_path(folder) as tmp:
        for run in runs:
            (tmp / "train" / run).mkdir(parents=True)
            for file in TRAIN_FILES:
                if (found := theirs.path(layout.REPORTS / "train" / run / file)).is_file():
                    shutil.copy2(found, tmp / "train" / run / file)
            (tmp / "eval" / run).mkdir(parents=True)
            shutil.copy2(theirs.path(layout.EVAL / run / RESULTS), tmp / "eval" / run / RESULTS)
            if (scores := theirs.path(layout.REPORTS / "eval" / run / "metrics.json")).is_file():
                shutil.copy2(scores, tmp / "eval" / run / "metrics.json")
        write_json(
            tmp / "ablation.json",
            {"method": method, "runs": runs, "source": str(Path(source).resolve()),
             "params": differences},
        )  # fmt: skip
    return folder

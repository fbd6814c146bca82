"""Sessions 43-44 (reports/search.md): what each SDE gives a group to learn from. Round 0 of
every pool run samples the unchanged base with the run's own SDE, so the runs' round 0 compare
the two SDEs on one policy: training accuracy and reward spread, mean ± standard error over runs.

    python reports/search/oracle/pool24/round0.py OUT.json --flow-sde DIRS --ddim-sde DIRS

DIRS: training report folders (`rounds.json` inside), one per run.
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from pipeline.io import write_json  # noqa: E402

METRICS = ("train/accuracy", "reward/std")


def round0_summary(runs: list[Path]) -> dict:
    """{metric: {"mean", "sem"}} of round 0 over the runs, plus the run count."""
    first = [json.loads((run / "rounds.json").read_text())[0] for run in runs]
    out: dict = {"runs": len(first)}
    for metric in METRICS:
        values = np.array([r[metric] for r in first])
        out[metric] = {"mean": values.mean(), "sem": values.std(ddof=1) / np.sqrt(len(values))}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--flow-sde", type=Path, nargs="+", required=True)
    parser.add_argument("--ddim-sde", type=Path, nargs="+", required=True)
    args = parser.parse_args()
    out = {
        "flow_grpo_sde": round0_summary(args.flow_sde),
        "ddim_sde": round0_summary(args.ddim_sde),
    }
    for sde, s in out.items():
        cells = ", ".join(f"{m} {s[m]['mean']:.3f} ± {s[m]['sem']:.3f}" for m in METRICS)
        print(f"{sde} ({s['runs']} runs): {cells}")
    write_json(args.out, out)


if __name__ == "__main__":
    main()

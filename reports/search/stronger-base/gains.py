"""Session 21 scratch measurement (reports/search.md, session 21): is the base the limit? The
default flow_grpo recipe trained on the two other pretraining seeds' bases (`reports/base/seeds`:
ODE-10 0.496 and 0.465 against the committed base's 0.383), three seeds each, in copies of the
project whose `model.path` points at those bases. Each base folder beside this file holds the
copies' evaluation verdicts (`eval/<policy>/results.jsonl`, the `evaluate` protocol) and probe
curves (`train/<run>/probe.json`).

    python reports/search/stronger-base/gains.py
    python reports/search/stronger-base/gains.py reports/search/composing-base/late-two-class

prints each base's gain table and writes gains.json (`--method M`: gains-M.json, the runs M-s*)
beside this file (for folders given as arguments, such as session 30's base that composes two
classes, into the first one's parent): per base, the base's GenEval, the method's GenEval per
seed, its gain over the base with the report's bootstrap CI over seeds and prompts
(`pipeline.report.difference`), the gain per tag, the probe curve's mean over seeds, and per
policy (the base and each run) the two_object and position images that hold both named classes
and that are judged right (`composition`, read from the verdicts' reasons).
"""

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
import numpy as np  # noqa: E402

from pipeline import layout  # noqa: E402
from pipeline import report as rep  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.geneval import TAGS  # noqa: E402
from pipeline.io import write_json  # noqa: E402
from stages.report import eval_matrix  # noqa: E402


def composition(verdicts_path: Path) -> dict:
    """Per two-class tag of a policy's verdicts: images, those holding both named classes (no
    reason line "expected <class>>=1, found 0"; each clause of these tags asks for one object)
    and those judged right."""
    rows = [json.loads(line) for line in verdicts_path.read_text().splitlines() if line]
    counts = {}
    for tag in ("two_object", "position"):
        judged = [r for r in rows if r["tag"] == tag]
        missing = sum(
            any(line.endswith(">=1, found 0") for line in r["reason"].splitlines()) for r in judged
        )
        right = sum(r["correct"] for r in judged)
        counts[tag] = {"images": len(judged), "both_named": len(judged) - missing, "right": right}
    return counts


def base_gains(folder: Path, method: str, cfg, test: list[dict], tags: np.ndarray) -> dict:
    runs = sorted(p.name for p in (folder / "eval").iterdir() if p.name.startswith(method))
    if not runs:
        raise SystemExit(f"error: {folder / 'eval'} holds no {method}-s* runs")
    base = eval_matrix(cfg, ["base"], test, folder=folder / "eval")
    trained = eval_matrix(cfg, runs, test, folder=folder / "eval")
    probes = [json.loads((folder / "train" / run / "probe.json").read_text()) for run in runs]
    rounds = [p["rounds"] for p in probes[0]]
    curve = np.mean([[p["probe/geneval"] for p in probe] for probe in probes], axis=0)
    return {
        "base_geneval": float(rep.geneval_overall(base[0], tags)),
        "runs": runs,
        "geneval_per_seed": [float(rep.geneval_overall(row, tags)) for row in trained],
        "gain_over_base": rep.difference(trained, base, tags),
        "gain_per_tag": rep.tag_gains(trained, base, tags),
        "probe": {"rounds": rounds, "geneval_mean_over_seeds": curve.round(4).tolist()},
        "composition": {
            policy: composition(folder / "eval" / policy / "results.jsonl")
            for policy in ["base", *runs]
        },
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", nargs="*", type=Path, help="default: base-s* beside this file")
    parser.add_argument("--method", default="flow_grpo", help="the runs <method>-s* of each base")
    args = parser.parse_args()
    folders = args.folders
    cfg = load_config(REPO / "params.yaml")
    test = layout.load_prompts(cfg, "test")
    tags = np.array([TAGS.index(m["tag"]) for m in test])
    out = {}
    for folder in folders or sorted(HERE.glob("base-s*")):
        out[folder.name] = g = base_gains(folder, args.method, cfg, test, tags)
        gain = g["gain_over_base"]
        print(
            f"{folder.name}: base {g['base_geneval']:.3f}, {args.method} per seed "
            + " / ".join(f"{v:.3f}" for v in g["geneval_per_seed"])
            + f", gain {gain['diff']:+.3f} [{gain['ci95'][0]:+.3f}, {gain['ci95'][1]:+.3f}]; "
            + "per tag "
            + ", ".join(f"{t} {v:+.3f}" for t, v in g["gain_per_tag"].items())
            + "; probe "
            + " / ".join(f"{v:.3f}" for v in g["probe"]["geneval_mean_over_seeds"])
        )
    name = "gains.json" if args.method == "flow_grpo" else f"gains-{args.method}.json"
    write_json((folders[0].parent if folders else HERE) / name, out)


if __name__ == "__main__":
    main()

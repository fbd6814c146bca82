"""Session 33 scratch measurement (reports/search.md, session 33): a candidate recipe's held-out
GenEval against the base and against a reference recipe (the committed default flow_grpo), from
the evaluation protocol's verdicts, with the report's bootstrap CI over seeds and prompts
(`pipeline.report.difference`).

    python reports/search/compare.py OUT.json --base data/eval/base \
        --reference data/eval/flow_grpo-s0 data/eval/flow_grpo-s1 data/eval/flow_grpo-s2 \
        --candidate DIR/eval/flow_grpo-s0 ...

Each path is a folder holding `results.jsonl` (as `creditflow evaluate` and draft.py write
them). Prints and writes: GenEval per seed of each side, the candidate's gain over the base and
its difference to the reference (diff, ci95, separated), both per tag (the difference to the
reference per tag also with its CI, session 38), and per policy the two_object and position
images that hold both named classes and that are judged right (session 21's `composition`).
"""

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE / "stronger-base"))
import numpy as np  # noqa: E402
from gains import composition  # noqa: E402

from pipeline import layout  # noqa: E402
from pipeline import report as rep  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.geneval import TAGS  # noqa: E402
from pipeline.io import write_json  # noqa: E402
from stages.report import eval_matrix  # noqa: E402


def accuracy(cfg, folders: list[Path], test: list[dict]) -> np.ndarray:
    """(len(folders), test prompts) per-prompt accuracy of each folder's verdicts."""
    rows = [eval_matrix(cfg, [f.name], test, folder=f.resolve().parent) for f in folders]
    missing = [str(f) for f, row in zip(folders, rows, strict=True) if row is None]
    if missing:
        raise SystemExit(f"error: no complete results.jsonl in {', '.join(missing)}")
    return np.concatenate(rows)


def tag_differences(a: np.ndarray, b: np.ndarray, tags: np.ndarray) -> dict[str, dict]:
    """A minus B per tag, each with the report's bootstrap CI restricted to that tag's prompts
    (GenEval overall over one tag's prompts is that tag's accuracy). a: (S_a, P), b: (S_b, P)."""
    return {
        name: rep.difference(a[:, tags == tag_id], b[:, tags == tag_id], tags[tags == tag_id])
        for tag_id, name in enumerate(TAGS)
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--base", type=Path, required=True)
    parser.add_argument("--reference", type=Path, nargs="+", required=True)
    parser.add_argument("--candidate", type=Path, nargs="+", required=True)
    args = parser.parse_args()
    cfg = load_config(REPO / "params.yaml")
    test = layout.load_prompts(cfg, "test")
    tags = np.array([TAGS.index(m["tag"]) for m in test])
    base = accuracy(cfg, [args.base], test)
    reference = accuracy(cfg, args.reference, test)
    candidate = accuracy(cfg, args.candidate, test)
    out = {
        "base": float(rep.geneval_overall(base[0], tags)),
        "reference": {
            "folders": [str(f) for f in args.reference],
            "geneval_per_seed": rep.geneval_overall(reference, tags).round(4).tolist(),
            "gain_over_base": rep.difference(reference, base, tags),
        },
        "candidate": {
            "folders": [str(f) for f in args.candidate],
            "geneval_per_seed": rep.geneval_overall(candidate, tags).round(4).tolist(),
            "gain_over_base": rep.difference(candidate, base, tags),
            "gain_per_tag": rep.tag_gains(candidate, base, tags),
            "minus_reference": rep.difference(candidate, reference, tags),
            "minus_reference_per_tag": rep.tag_gains(candidate, reference, tags),
            "minus_reference_per_tag_ci": tag_differences(candidate, reference, tags),
        },
        "composition": {
            str(f): composition(f / "results.jsonl")
            for f in [args.base, *args.reference, *args.candidate]
        },
    }
    for side in ("reference", "candidate"):
        gain = out[side]["gain_over_base"]
        print(
            f"{side}: " + " / ".join(f"{v:.3f}" for v in out[side]["geneval_per_seed"])
            + f", gain {gain['diff']:+.3f} [{gain['ci95'][0]:+.3f}, {gain['ci95'][1]:+.3f}]"
        )  # fmt: skip
    diff = out["candidate"]["minus_reference"]
    print(
        f"candidate - reference {diff['diff']:+.3f} "
        + f"[{diff['ci95'][0]:+.3f}, {diff['ci95'][1]:+.3f}]"
        + "; per tag over the base "
        + ", ".join(f"{t} {v:+.3f}" for t, v in out["candidate"]["gain_per_tag"].items())
    )
    write_json(args.out, out)


if __name__ == "__main__":
    main()

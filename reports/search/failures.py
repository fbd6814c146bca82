"""Session 34 scratch measurement (reports/search.md, session 34): where the held-out GenEval of
any policy's evaluation goes, by the report's failure causes (`pipeline.report.failure_cause`:
the first failure a wrong verdict names — a missing class, too many, a color, a relation flipped
on its axis, another relation failure), for folders outside the default experiment too.

    python reports/search/failures.py OUT.json data/eval/base data/eval/flow_grpo-s0 ...

Each folder holds a `results.jsonl` (as `creditflow evaluate` and the search scripts write
them). Writes per folder the count of each cause per tag and the causes' shares of GenEval
overall (`failure_shares`: what those images would add if right; they sum to 1 − overall), and
prints each folder's largest shares.
"""

import argparse
import sys
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from pipeline.geneval import TAGS  # noqa: E402
from pipeline.io import write_json  # noqa: E402
from pipeline.report import failure_cause, failure_shares  # noqa: E402
from stages.report import read_verdicts  # noqa: E402


def causes(verdicts: list[dict]) -> dict:
    """{"per_tag": {tag: {"images", "right", "causes": {cause: n}}}, "shares": {cause: share}}."""
    per_tag = {}
    for tag in TAGS:
        judged = [v for v in verdicts if v["tag"] == tag]
        counted = Counter(failure_cause(v["reason"]) for v in judged if not v["correct"])
        per_tag[tag] = {
            "images": len(judged),
            "right": sum(v["correct"] for v in judged),
            "causes": dict(counted.most_common()),
        }
    shares = {cause: round(share, 4) for cause, share in failure_shares(verdicts).items()}
    return {"per_tag": per_tag, "shares": shares}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("folders", type=Path, nargs="+")
    args = parser.parse_args()
    out = {}
    for folder in args.folders:
        out[str(folder)] = causes(read_verdicts(folder / "results.jsonl"))
        top = list(out[str(folder)]["shares"].items())[:6]
        print(f"{folder}: " + ", ".join(f"{name} {v:.3f}" for name, v in top))
    write_json(args.out, out)


if __name__ == "__main__":
    main()

"""Session 38 scratch measurement (reports/search.md, session 38): per-tag differences between two
sets of evaluation verdicts with the report's bootstrap CI, the CI of `compare.py` restricted to
one tag's prompts.

    python reports/search/tag_ci.py --reference reports/search/placebo/flow_grpo-s{0..5}/eval \
        --candidate data/eval/flow_grpo-s{0,1,2} reports/search/more-seeds/flow_grpo-s{3,4,5}/eval

Each path is a folder holding `results.jsonl`; seeds are paired by position as in `compare.py`.
Prints one line per tag: candidate minus reference accuracy and its 95 % CI.
"""

import argparse
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE / "stronger-base"))
import numpy as np  # noqa: E402
from compare import accuracy  # noqa: E402

from pipeline import layout  # noqa: E402
from pipeline import report as rep  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.geneval import TAGS  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reference", type=Path, nargs="+", required=True)
    parser.add_argument("--candidate", type=Path, nargs="+", required=True)
    args = parser.parse_args()
    cfg = load_config(REPO / "params.yaml")
    test = layout.load_prompts(cfg, "test")
    tags = np.array([TAGS.index(m["tag"]) for m in test])
    reference = accuracy(cfg, args.reference, test)
    candidate = accuracy(cfg, args.candidate, test)
    for tag_id, name in enumerate(TAGS):
        # one tag's prompts alone: GenEval overall over them is that tag's accuracy
        mask = tags == tag_id
        claim = rep.difference(candidate[:, mask], reference[:, mask], tags[mask])
        low, high = claim["ci95"]
        print(f"{name}: {claim['diff']:+.3f} [{low:+.3f}, {high:+.3f}]")


if __name__ == "__main__":
    main()

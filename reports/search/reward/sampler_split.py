"""Session 27 scratch measurement (reports/search.md, session 27): the late-window GRPO runs
raise the GenEval accuracy of their own rollouts on the training prompts (last 3 rounds, against
the default run of the same seed, which drew the same prompts) but not held-out GenEval. Is that
gain tied to the prompts (training lines against test prompts) or to the sampler (the
rollout's SDE against the evaluation's ODE-20)? For each policy, GenEval overall accuracy
(`pipeline.geneval.summarize`: the mean over tags) of

- `test_rollout`: the 144 test prompts x 8, sampled as one training round of its project (its
  SDE window, shared x_T per prompt group; fixed seed, so paired across policies of one window);
- `train_eval`: every 4th training line x 4 images, under the evaluation protocol's sampler
  (fixed seeds, paired across all policies).

    OMP_NUM_THREADS=1 python reports/search/reward/sampler_split.py --run LABEL=PROJECT:RUN ...

RUN is a run under PROJECT/data/train, or `base`. Writes each label's result to
`sampler_split/<LABEL>.json` beside this file; `--table` prints them all.
"""

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))

from pipeline import layout  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.evaluation import geneval_protocol, judge  # noqa: E402
from pipeline.geneval import summarize  # noqa: E402
from pipeline.io import write_json  # noqa: E402
from pipeline.rounds import CountingVelocity, Schedule, rollout_round  # noqa: E402
from stages.evaluate import policy_backend  # noqa: E402

OUT = HERE / "sampler_split"
SEED = 1234


def measure(project: Path, run: str) -> dict:
    cfg = load_config(project / "params.yaml")
    backend = policy_backend(cfg, run)
    test = layout.load_prompts(cfg, "test")
    schedule = Schedule.from_config(cfg, kind="flow_grpo")
    rollout = rollout_round(
        backend, test, range(len(test)), schedule, cfg, method="flow_grpo", seed=SEED,
        round_index=0, run_id="split", model_version=run,
        counter=CountingVelocity(backend, cfg.sampling.guidance),
    )  # fmt: skip
    rows = [m for m in test for _ in range(cfg.rollout.group_size)]
    rollout_verdicts = judge(rollout.images, rows)
    train = layout.load_prompts(cfg, "train")[::4]
    _, _, summary = geneval_protocol(backend, train, cfg, images_per_prompt=4, desc="train")
    return {
        "project": str(project),
        "run": run,
        "window": [cfg.rollout.window_start, cfg.rollout.window_end],
        "test_rollout": summarize(rollout_verdicts)["overall"],
        "train_eval": summary["overall"],
        "train_eval_per_tag": summary["per_tag"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", action="append", default=[], help="LABEL=PROJECT:RUN")
    parser.add_argument("--table", action="store_true", help="print the stored results")
    args = parser.parse_args()
    for given in args.run:
        label, target = given.split("=", 1)
        project, run = target.rsplit(":", 1)
        result = measure(Path(project), run)
        write_json(OUT / f"{label}.json", result)
        print(label, json.dumps(result), flush=True)
    if args.table:
        print("| policy | window | test prompts, its rollout sampler | training lines, evaluation "
              "sampler |\n|---|---|---|---|")  # fmt: skip
        for path in sorted(OUT.glob("*.json")):
            r = json.loads(path.read_text())
            window = "-".join(map(str, r["window"]))
            print(f"| {path.stem} | {window} | {r['test_rollout']:.3f} | {r['train_eval']:.3f} |")


if __name__ == "__main__":
    main()

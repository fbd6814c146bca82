"""Cost of each clean-image estimator of the `score` stage relative to the rollout itself.

One round is sampled with the method's SDE, then every estimator scores the window's boundary
states of the same cached trajectories; seconds and model evaluations (NFEs, CFG counted as 2)
are reported relative to the rollout. Writes reports/scoring_cost.{json,md}.

    python benchmarks/scoring_cost.py --params params.yaml -S model.path=data/base/model
"""

from __future__ import annotations

import argparse
import json
import time

from pipeline import layout, rounds
from pipeline.config import load_config
from pipeline.io import write_json, write_text
from pipeline.layout import trajectory_metadata
from pipeline.policy import load_backend
from pipeline.rewards import RewardMix

ESTIMATORS = [("tweedie", 1), ("ode_substeps", 2), ("ode_substeps", 5), ("ode_completion", 0)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", default="params.yaml")
    parser.add_argument("-S", "--set", action="append", default=[], dest="overrides")
    args = parser.parse_args()
    cfg = load_config(args.params, args.overrides)
    backend = load_backend(cfg)
    prompts = layout.load_prompts(cfg, "train")
    schedule = rounds.Schedule.from_config(cfg)
    chosen = rounds.select_prompts(prompts, cfg.rollout.prompts_per_round, seed=0, round_index=0)
    counter = rounds.CountingVelocity(backend, cfg.sampling.guidance)
    start = time.perf_counter()
    rollout = rounds.rollout_round(
        backend, prompts, chosen, schedule, cfg, method=cfg.train.method, seed=0, round_index=0,
        run_id="bench", model_version="base", counter=counter,
    )  # fmt: skip
    rollout_s, rollout_nfe = time.perf_counter() - start, counter.nfe
    metadata = trajectory_metadata(cfg, rollout)
    mix = RewardMix(cfg, cfg.score.rewards)
    rows = []
    for estimator, substeps in ESTIMATORS:
        step_cfg = load_config(
            args.params, [*args.overrides, f"score.ode_substeps={max(substeps, 1)}"]
        )
        counter = rounds.CountingVelocity(backend, cfg.sampling.guidance)
        start = time.perf_counter()
        rounds.score_round(
            backend, rollout, metadata, mix, step_cfg, estimators=(estimator,), schedule=schedule,
            counter=counter,
        )  # fmt: skip
        seconds = time.perf_counter() - start
        rows.append(
            {
                "estimator": estimator
                if estimator != "ode_substeps"
                else f"ode_substeps T'={substeps}",
                "seconds": seconds,
                "nfe": counter.nfe,
                "time_vs_rollout": seconds / rollout_s,
                "nfe_vs_rollout": counter.nfe / rollout_nfe,
            }
        )
    result = {
        "trajectories": rollout.num_trajectories,
        "steps": rollout.num_steps,
        "window_steps": int(schedule.steps.numel()),
        "rollout_seconds": rollout_s,
        "rollout_nfe": rollout_nfe,
        "estimators": rows,
    }
    out = cfg.path(layout.REPORTS)
    write_json(out / "scoring_cost.json", result)
    table = "\n".join(
        f"| {r['estimator']} | {r['seconds']:.2f} | {r['time_vs_rollout']:.2f}x | {r['nfe']} | "
        f"{r['nfe_vs_rollout']:.2f}x |"
        for r in rows
    )
    write_text(
        out / "scoring_cost.md",
        f"# Scoring cost per estimator\n\nOne round: {result['trajectories']} trajectories, "
        f"{result['steps']} steps ({result['window_steps']} in the SDE window); the rollout took "
        f"{rollout_s:.2f} s and {rollout_nfe} NFEs. Scoring includes the reward calls.\n\n"
        "| estimator | seconds | vs rollout | NFEs | vs rollout |\n|---|---|---|---|---|\n"
        f"{table}\n",
    )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

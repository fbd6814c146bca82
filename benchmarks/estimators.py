"""Fidelity vs cost of the clean-image estimates of intermediate states.

Stepwise-Flow-GRPO rewards each intermediate state through an estimate of its clean image;
TP-GRPO through a full ODE completion. This benchmark takes the states of real cached rollouts
(a training run's `rollouts/`, each round scored with the policy that sampled it) and scores
every estimator variant the pipeline can compute against the reference, the reward of the full
guided ODE completion over the rest of the rollout's schedule:

- `tweedie`: x − σ v (= one Euler step to 0; `score.estimator=tweedie`);
- `substeps-T'`: T' uniform Euler substeps from σ to 0 (`score.ode_substeps`);
- `coarse-k`: k Euler steps over the remaining rollout schedule, evenly spaced
  (`score.estimator=ode_completion`, `score.completion_steps=k`);
- `completion`: the whole remaining schedule (`score.completion_steps=0`; the reference itself
  when guided);
each with classifier-free guidance (`/cfg`, the sampler's scale) or without (`/nocfg`). Guided
variants start from the velocity the rollout computed at the state, as the pipeline does (its
first Euler step is free: Tweedie costs no NFE). Per variant: Spearman ρ of its reward with the
reference's, per state and pooled; mean absolute reward error; the share of stepwise
(joint-normalized gain) advantages whose sign agrees with the reference's; NFEs and seconds per
state.

    python benchmarks/estimators.py --run data/train/stepwise-s0 --rounds 3

writes reports/estimators.json ({"rows": [...], "defaults": {...}}) and reports/estimators.md.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch
from scipy.stats import spearmanr

REPO = Path(__file__).resolve().parents[1]
SUBSTEPS = (2, 3, 5)
COARSE = (2, 3, 4)


def estimate(velocity, x, start: int, sigmas: torch.Tensor, variant: str, first_velocity=None):
    """The clean estimate of states x (B, ...) at schedule index `start` by `variant`, through
    the pipeline's own estimators; `first_velocity` is the velocity at x when known."""
    from pipeline import sampling

    kind, _, k = variant.partition("-")
    if kind in ("tweedie", "substeps"):
        steps = 1 if kind == "tweedie" else int(k)
        return sampling.ode_substeps(
            velocity, x, sigmas[start], steps, first_velocity=first_velocity
        )
    rows = torch.full((x.shape[0],), start, dtype=torch.long)
    return sampling.ode_complete(
        lambda x_, s_, r_: velocity(x_, s_), x, rows, sigmas,
        max_steps=0 if kind == "completion" else int(k), first_velocity=first_velocity,
    )  # fmt: skip


def pipeline_name(cfg, method: str) -> str:
    """The row of this table that `method` scores with under `cfg`'s params."""
    estimator = "ode_completion" if method == "tp_grpo" else cfg.score.estimator
    if estimator == "tweedie" or (estimator == "ode_substeps" and cfg.score.ode_substeps == 1):
        return "tweedie/cfg"
    if estimator == "ode_substeps":
        return f"substeps-{cfg.score.ode_substeps}/cfg"
    k = cfg.score.completion_steps
    return "completion/cfg" if k == 0 else f"coarse-{k}/cfg"


def variants() -> list[str]:
    kinds = ["tweedie", *(f"substeps-{k}" for k in SUBSTEPS), *(f"coarse-{k}" for k in COARSE)]
    return [f"{kind}/{g}" for kind in [*kinds, "completion"] for g in ("cfg", "nocfg")]


def score_round(cfg, run: Path, r: int, names: list[str]) -> dict[str, dict]:
    """{variant: {"rewards": (N, K), "nfe": int, "seconds": float}} for round r of `run`, plus
    "final" (N,) and the rollout's group ids."""
    from pipeline import rounds
    from pipeline.layout import trajectory_metadata
    from pipeline.policy import restore
    from pipeline.rewards import RewardMix
    from pipeline.trajectories import read_rollout

    rollout = read_rollout(run / "rollouts", r)
    backend = restore(cfg, run, before_round=r).backend
    metadata = trajectory_metadata(cfg, rollout)
    mix = RewardMix(cfg, cfg.score.rewards)
    states = rounds.Schedule.of_rollout(rollout, cfg).boundary_states[:-1].tolist()
    embeds = backend.encode_prompts(rollout.prompts)
    out = {"final": mix(rollout.images, metadata)["mix"].double(), "groups": rollout.group_ids}
    # The rollout's own guided velocity at each state (cached, or computed here once and not
    # counted): guided estimates start from it, as the pipeline's do.
    with torch.no_grad():
        rollout_velocity = {
            s: rollout.velocities[:, s] if rollout.velocities is not None
            else backend.velocity(rollout.states[:, s], rollout.sigmas[s].expand(len(embeds)),
                                  embeds, guidance=cfg.sampling.guidance)
            for s in states
        }  # fmt: skip
    for name in names:
        variant, guided = name.split("/")
        counter = rounds.CountingVelocity(backend, cfg.sampling.guidance if guided == "cfg" else 1)
        velocity = counter.bind(embeds)
        start = time.perf_counter()
        columns = []
        for s in states:
            v0 = rollout_velocity[s] if guided == "cfg" else None
            with torch.no_grad():
                x0 = estimate(velocity, rollout.states[:, s], s, rollout.sigmas, variant, v0)
                images = backend.decode(x0)
            columns.append(mix(images, metadata)["mix"].double())
        out[name] = {
            "rewards": torch.stack(columns, dim=1),  # (N, K)
            "nfe": counter.nfe,
            "seconds": time.perf_counter() - start,
            "states": rollout.num_trajectories * len(states),
        }
    return out


def fidelity(rounds_scored: list[dict], name: str, reference: str) -> dict:
    """One table row: `name` against `reference` over every scored round."""
    from pipeline.credit import stepwise_advantages

    est = torch.cat([s[name]["rewards"] for s in rounds_scored])  # (N_all, K)
    ref = torch.cat([s[reference]["rewards"] for s in rounds_scored])
    per_state = []
    for k in range(est.shape[1]):
        a, b = est[:, k].numpy(), ref[:, k].numpy()
        ok = np.ptp(a) > 0 and np.ptp(b) > 0
        per_state.append(float(spearmanr(a, b)[0]) if ok else float("nan"))
    signs = []
    for s in rounds_scored:
        group = s["groups"]
        adv = [
            stepwise_advantages(torch.cat([s[n]["rewards"], s["final"][:, None]], 1), group)
            for n in (name, reference)
        ]
        signs.append((torch.sign(adv[0]) == torch.sign(adv[1])).double().flatten())
    states = sum(s[name]["states"] for s in rounds_scored)
    return {
        "estimator": name,
        "spearman": float(spearmanr(est.flatten().numpy(), ref.flatten().numpy())[0]),
        "spearman_per_state": per_state,
        "mae": float((est - ref).abs().mean()),
        "advantage_sign_agreement": float(torch.cat(signs).mean()),
        "nfe_per_state": sum(s[name]["nfe"] for s in rounds_scored) / states,
        "seconds_per_state": sum(s[name]["seconds"] for s in rounds_scored) / states,
    }


def markdown(result: dict, command: str) -> str:
    lines = [
        "# Clean-image estimators: fidelity vs cost",
        "",
        f"`{command}`; reference: `{result['reference']}` (full guided ODE completion), "
        f"{result['trajectories']} trajectories of rounds {result['rounds']} of `{result['run']}`.",
        "",
        "| estimator | Spearman ρ (pooled) | ρ per state, noisiest first | MAE "
        "| adv. sign agreement | NFE / state | ms / state |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        per_state = " ".join(f"{v:.2f}" for v in row["spearman_per_state"])
        lines.append(
            f"| {row['estimator']} | {row['spearman']:.3f} | {per_state} | {row['mae']:.3f} | "
            f"{row['advantage_sign_agreement']:.3f} | {row['nfe_per_state']:.1f} | "
            f"{1000 * row['seconds_per_state']:.1f} |"
        )
    lines += ["", f"Pipeline defaults: {json.dumps(result['defaults'])}", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--run", type=Path, default=REPO / "data/train/stepwise-s0")
    parser.add_argument("--params", type=Path, default=REPO / "params.yaml")
    parser.add_argument("--rounds", type=int, default=3, help="newest cached rounds to use")
    parser.add_argument("--out", type=Path, default=REPO / "reports")
    args = parser.parse_args()

    from pipeline.config import load_config
    from pipeline.io import write_json, write_text
    from pipeline.trajectories import STEPS, list_rounds

    cfg = load_config(args.params)
    run = args.run.resolve()
    cached = list_rounds(run / "rollouts", STEPS)[-args.rounds :]
    if not cached:
        raise SystemExit(f"no cached rollouts under {run / 'rollouts'}")
    names = variants()
    reference = "completion/cfg"
    scored = [score_round(cfg, run, r, names) for r in cached]
    result = {
        "run": str(run.relative_to(REPO)) if run.is_relative_to(REPO) else str(run),
        "rounds": cached,
        "trajectories": sum(s["final"].numel() for s in scored),
        "reference": reference,
        "rows": [fidelity(scored, name, reference) for name in names],
        "defaults": {m: pipeline_name(cfg, m) for m in ("stepwise", "tp_grpo")},
    }
    command = "python benchmarks/estimators.py " + " ".join(
        f"--{k} {v}" for k, v in (("run", result["run"]), ("rounds", args.rounds))
    )
    write_json(args.out / "estimators.json", result)
    write_text(args.out / "estimators.md", markdown(result, command))
    print(markdown(result, command))


if __name__ == "__main__":
    main()

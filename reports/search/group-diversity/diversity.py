"""How different are the samples of one prompt group? One base-policy round per sampler setting.

Session 17 saw stepwise's round means swing far more than flow_grpo's on a fixed pool and guessed
that its DDIM-style SDE, whose std is small at the first trained steps, leaves the samples of a
group (one shared x_T) close to one image. This measures it on one round of the base policy (a
fresh LoRA) with `benchmarks/gradient_snr.base_round`: 24 evenly spaced training prompts x 8.

Per setting: the mean SDE std of each trained step; the final latents' within-group spread
(RMS distance of a sample to its group's mean latent, over the RMS distance of a sample to the
mean latent of *all* samples of the round); the GenEval partial reward's within-group std, the
share of groups whose rewards are all equal, and of groups whose verdicts are not all the same.

    OMP_NUM_THREADS=1 python reports/search/group-diversity/diversity.py [-S key=value ...]
writes reports/search/group-diversity/diversity.json and prints a markdown table.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[2]
sys.path.insert(0, str(ROOT))

from benchmarks.gradient_snr import base_round  # noqa: E402
from pipeline import credit  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.rewards import RewardMix  # noqa: E402

# name: (method whose SDE is sampled, overrides)
SETTINGS = {
    "flow_grpo (shared x_T)": ("flow_grpo", []),
    "stepwise (shared x_T)": ("stepwise", []),
    "stepwise (own x_T)": ("stepwise", ["rollout.shared_noise=false"]),
    "flow_grpo (own x_T)": ("flow_grpo", ["rollout.shared_noise=false"]),
}


def group_spread(latents: torch.Tensor, group_ids: torch.Tensor) -> float:
    """RMS distance to the group mean over RMS distance to the round mean; latents (N, ...)."""
    flat = latents.flatten(1).double()
    groups, n_groups = credit._group_index(group_ids, len(flat))
    means, _ = credit._group_moments(flat, groups, n_groups, pool_columns=False)  # (N, D)
    within = (flat - means).pow(2).sum(1).mean().sqrt()
    overall = (flat - flat.mean(0)).pow(2).sum(1).mean().sqrt()
    return (within / overall).item()


def measure(name: str, overrides: list[str]) -> dict:
    method, extra = SETTINGS[name]
    cfg = load_config(ROOT / "params.yaml", [f"train.method={method}", *overrides, *extra])
    _, _, rollout, metadata, _ = base_round(cfg, method, 24, seed=0)
    scores = RewardMix(cfg, {"geneval": 1.0})(rollout.images, metadata)
    reward = scores["geneval"].double().view(-1, cfg.rollout.group_size)  # (groups, G)
    groups = rollout.group_ids
    trained = rollout.window.nonzero().flatten()
    verdict = reward == 1.0
    return {
        "setting": name,
        "std_per_trained_step": [round(v, 4) for v in rollout.stds[:, trained].mean(0).tolist()],
        "final_latent_spread": round(group_spread(rollout.states[:, -1], groups), 4),
        "reward_mean": round(reward.mean().item(), 4),
        "reward_within_group_std": round(reward.std(1).mean().item(), 4),
        "groups_all_equal": round((reward.std(1) == 0).double().mean().item(), 4),
        "groups_mixed_verdicts": round(
            (verdict.any(1) & ~verdict.all(1)).double().mean().item(), 4
        ),
    }


def main() -> None:
    overrides = [a for flag, a in zip(sys.argv[1::2], sys.argv[2::2], strict=False) if flag == "-S"]
    rows = []
    for name in SETTINGS:
        rows.append(measure(name, overrides))
        print(json.dumps(rows[-1]), flush=True)
    (HERE / "diversity.json").write_text(
        json.dumps({"overrides": overrides, "rows": rows}, indent=2)
    )
    keys = list(rows[0])
    print("| " + " | ".join(keys) + " |\n|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(str(row[k]) for k in keys) + " |")


if __name__ == "__main__":
    main()

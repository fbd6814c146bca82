"""Session 16 scratch measurement (reports/search.md, session 16 §2): on rounds of the default
recipe's stepwise and tp_grpo (base policy), how well each trained step's advantage correlates
with the final-reward advantage when the clean estimates come from 3-Euler-step completions (the
default `score.completion_steps=3`) or from exact completions (`0`: every remaining step).

    OMP_NUM_THREADS=1 python reports/search/completion-credit/credit_vs_final.py SEED PROMPTS

writes credit_vs_final_<SEED>_<PROMPTS>.json beside this file.
"""

import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from gradient_snr import base_round  # noqa: E402

from pipeline.config import load_config  # noqa: E402
from pipeline.rewards import RewardMix  # noqa: E402
from pipeline.rounds import assign_credit, estimators_for, score_round  # noqa: E402


def correlations(method: str, seed: int, n_prompts: int) -> dict:
    out = {}
    base_cfg = load_config(REPO / "params.yaml", [f"train.method={method}"])
    backend, schedule, rollout, metadata, counter = base_round(
        base_cfg, method, n_prompts, seed=seed
    )
    for steps in (3, 0):
        cfg = load_config(
            REPO / "params.yaml", [f"train.method={method}", f"score.completion_steps={steps}"]
        )
        table = score_round(
            backend, rollout, metadata, RewardMix(cfg, cfg.score.rewards), cfg,
            estimators=estimators_for(method, cfg), schedule=schedule, counter=counter,
        ).table  # fmt: skip
        credit = assign_credit(method, table, rollout.group_ids, schedule, cfg)
        adv, fin = credit.advantages.numpy(), credit.final_advantages.numpy()  # (N, K), (N,)
        out[f"completion_steps={steps}"] = [
            float(np.corrcoef(adv[:, k], fin)[0, 1]) for k in range(adv.shape[1])
        ]
        print(method, steps, out[f"completion_steps={steps}"], flush=True)
    return out


if __name__ == "__main__":
    seed, n_prompts = int(sys.argv[1]), int(sys.argv[2])
    torch.manual_seed(seed)
    result = {m: correlations(m, seed, n_prompts) for m in ("stepwise", "tp_grpo")}
    path = Path(__file__).parent / f"credit_vs_final_{seed}_{n_prompts}.json"
    path.write_text(json.dumps(result, indent=1))

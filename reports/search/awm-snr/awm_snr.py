"""Session 16 scratch measurement (reports/search.md, "Session 16"): on one round of the default
recipe, the gradient SNR of the GRPO surrogate against advantage-weighted flow matching (AWM:
the final samples re-noised to x_t = (1 - t) x0 + t eps, loss sum_i A_i |v(x_t, t) - (eps - x0)|^2),
each as the mean pairwise cosine of 4 disjoint parts' gradients (benchmarks/gradient_snr.py).

    OMP_NUM_THREADS=2 python reports/search/awm-snr/awm_snr.py SEED PROMPTS   # 100 24, 101 96
"""

import dataclasses
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
import torch  # noqa: E402
from gradient_snr import base_round, pairwise_cosines, part_gradients, snr1_bound  # noqa: E402


def awm_part_gradients(backend, batch, groups, parts, *, guidance, t_mode, gen_seed=0):
    from pipeline.grpo import lora_parameters

    params = lora_parameters(backend.transformer)
    n, k = batch.advantages.shape
    g = torch.Generator().manual_seed(gen_seed)
    x0 = batch.states[:, -1]
    eps = torch.randn((n, k, *x0.shape[1:]), generator=g)
    if t_mode == "window":
        sig = batch.sigmas[batch.steps].expand(n, k)
    else:
        sig = torch.rand((n, k), generator=g)
    out = torch.zeros(parts, sum(p.numel() for p in params))
    traj = torch.arange(n)
    for part in range(parts):
        pick = traj[groups[traj] % parts == part]
        for p in params:
            p.grad = None
        for kk in range(k):
            s = sig[pick, kk]
            xt = (1 - s)[:, None, None, None] * x0[pick] + s[:, None, None, None] * eps[pick, kk]
            v = backend.velocity(xt, s, batch.embeds[pick], guidance=guidance)
            err = (v - (eps[pick, kk] - x0[pick])).pow(2).flatten(1).mean(1)
            (batch.advantages[pick, kk] * err).sum().backward()
        out[part] = torch.cat([p.grad.flatten() for p in params])
    return out


def main(seed):
    NP = int(sys.argv[2])
    from pipeline.config import load_config
    from pipeline.grpo import UpdateBatch
    from pipeline.rewards import RewardMix
    from pipeline.rounds import assign_credit, estimators_for, score_round, update_settings

    res = {}
    for method in ["flow_grpo", "stepwise"]:
        cfg = load_config(REPO / "params.yaml", [f"train.method={method}"])
        t0 = time.time()
        backend, schedule, rollout, metadata, counter = base_round(cfg, method, NP, seed=seed)
        rewards = RewardMix(cfg, cfg.score.rewards)
        table = score_round(
            backend,
            rollout,
            metadata,
            rewards,
            cfg,
            estimators=estimators_for(method, cfg),
            schedule=schedule,
            counter=counter,
        ).table
        credit = assign_credit(method, table, rollout.group_ids, schedule, cfg)
        batch = UpdateBatch(
            states=rollout.states,
            log_probs=rollout.log_probs,
            sigmas=rollout.sigmas,
            steps=schedule.steps,
            advantages=credit.advantages,
            embeds=backend.encode_prompts(rollout.prompts),
        )
        settings = dataclasses.replace(update_settings(cfg, schedule), kl_beta=0.0)
        print(
            method, "rollout+score", time.time() - t0, "s; N", rollout.num_trajectories, flush=True
        )
        rows = {}
        g = part_gradients(backend, batch, settings, rollout.group_ids, 4).sum(1)
        rows["ppo"] = g
        for guidance in [1.0, cfg.sampling.guidance]:
            for t_mode in ["window", "uniform"]:
                rows[f"awm g{guidance} t={t_mode}"] = awm_part_gradients(
                    backend, batch, rollout.group_ids, 4, guidance=guidance, t_mode=t_mode
                )
        for name, grads in rows.items():
            c = pairwise_cosines(grads)
            res[f"{method} {name}"] = (
                float(c.mean()),
                float(c.std()),
                snr1_bound(float(c.mean()), c, rollout.num_trajectories // 4),
            )
            print(method, name, res[f"{method} {name}"], flush=True)
        # cosine between ppo direction and awm directions (full sums)
        full = {k: v.sum(0) for k, v in rows.items()}
        for name in full:
            print(
                "  cos(ppo,",
                name,
                ")",
                float(torch.nn.functional.cosine_similarity(full["ppo"], full[name], dim=0)),
            )
    json.dump(res, open(Path(__file__).parent / f"awm_snr_{seed}_{NP}.json", "w"), indent=1)


if __name__ == "__main__":
    main(int(sys.argv[1]))

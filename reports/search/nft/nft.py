"""Session 35 scratch measurement (reports/search.md, session 35): a likelihood-free update on
GRPO's own rounds. Session 16 measured only the gradient agreement of advantage-weighted
matching on one round; this trains it. The update is DiffusionNFT's (Zheng et al. 2025,
"DiffusionNFT: Online Diffusion Reinforcement with Forward Process"), on the default recipe's
base, LoRA, prompts, guided sampler and `geneval` reward:

- a round draws `--prompts` training lines and samples `--group` images of each with the guided
  ODE (`sampling.num_steps` steps, CFG `sampling.guidance`), every image from its own x_T;
- each image's reward r is normalized in its group, A = (r - mean) / (std + 1e-4), and mapped
  to an optimality probability p = 0.5 + 0.5 clip(A / `--adv-scale`, -1, 1);
- each final latent x0 is noised `--t-draws` times, x_t = (1 - t) x0 + t eps, t ~ U(0, 1), and
  the guided velocity is trained on the forward process:
  loss = p ||v+ - (eps - x0)||^2 + (1 - p) ||v- - (eps - x0)||^2, with the implicit positive and
  negative policies v+ = (1 - b) v_old + b v_theta and v- = (1 + b) v_old - b v_theta
  (b = `--beta`; v_old: the round's sampling policy, fixed during its update). A group whose
  rewards agree (p = 1/2) only pulls v_theta back to v_old.
- session 36, `--old-decay` eta: DiffusionNFT's soft update of the sampling policy. Rounds
  sample with, and regress against, LoRA weights theta_old that follow the trained ones slowly,
  theta_old <- eta theta_old + (1 - eta) theta after each round (eta = 0, the default: the
  current policy, as in session 35). The probe and the evaluation judge theta.

No likelihood ratios and no SDE: the signal is which whole images were better, regressed from
fresh noise, so it does not pass through the D-dimensional SDE noise that limits GRPO's
estimate here (search.md, sessions 6 and 28).

    python reports/search/nft/nft.py --out reports/search/nft/NAME [options]

Cost is counted in denoiser forward evaluations, as GRPO's NFEs: a guided sample 2 per step;
per trained pair v_old 2, v_theta 2, its backward 4. Rounds run until the next would pass
`train.nfe_budget` (99 840, the default's equal-compute budget). Writes `history.json` (per
round: reward, training accuracy, loss, NFEs, seconds; the held-out probe every
`--probe-every` rounds) and the evaluation protocol's verdicts (`eval/`), as draft.py.
"""

import argparse
import sys
import time
from contextlib import contextmanager
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE.parent / "reward"))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from draft import add_run_arguments, probe, record_step, start_run, write_evaluation  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pipeline import layout, sampling  # noqa: E402
from pipeline.grpo import lora_parameters  # noqa: E402
from pipeline.rewards import RewardMix  # noqa: E402


def optimality(rewards: torch.Tensor, group: int, scale: float) -> torch.Tensor:
    """rewards (P * G,), groups contiguous -> p (P * G,) in [0, 1]: 1/2 + 1/2 clip(A / scale)
    with A the reward normalized within its group."""
    r = rewards.view(-1, group)
    advantage = (r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-4)
    return (0.5 + 0.5 * (advantage / scale).clamp(-1, 1)).flatten()


def nft_loss(v_theta, v_old, target, p, beta: float) -> torch.Tensor:
    """DiffusionNFT's loss; v_theta, v_old, target (B, C, H, W), p (B,) -> scalar."""
    positive = (1 - beta) * v_old + beta * v_theta
    negative = (1 + beta) * v_old - beta * v_theta
    per_pair_pos = (positive - target).pow(2).flatten(1).mean(1)
    per_pair_neg = (negative - target).pow(2).flatten(1).mean(1)
    return (p * per_pair_pos + (1 - p) * per_pair_neg).mean()


@contextmanager
def weights_swapped(params: list[torch.nn.Parameter], values: list[torch.Tensor]):
    """Within the block `params` hold `values`; their own values are restored after it."""
    saved = [param.detach().clone() for param in params]
    for param, value in zip(params, values, strict=True):
        param.data.copy_(value)
    try:
        yield
    finally:
        for param, value in zip(params, saved, strict=True):
            param.data.copy_(value)


def soft_update(old: list[torch.Tensor], params: list[torch.nn.Parameter], eta: float) -> None:
    """theta_old <- eta theta_old + (1 - eta) theta, in place."""
    for value, param in zip(old, params, strict=True):
        value.mul_(eta).add_(param.detach(), alpha=1 - eta)


def sample_round(backend, prompts, x_T, sigmas, guidance: float) -> torch.Tensor:
    """Guided ODE from x_T (B, C, H, W) -> final latents (B, C, H, W), no gradient."""
    embeds = backend.encode_prompts(prompts)
    window = torch.zeros(len(sigmas) - 1, dtype=torch.bool)
    with torch.no_grad():
        return sampling.sample(
            lambda x, s: backend.velocity(x, s, embeds, guidance=guidance),
            x_T, sigmas, kind="ode", eta=0.0, window=window, keep_states=False,
        ).final  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    parser.add_argument("--prompts", type=int, default=24, help="training lines per round")
    parser.add_argument("--group", type=int, default=8, help="images per line")
    parser.add_argument("--beta", type=float, default=1.0)
    parser.add_argument("--adv-scale", type=float, default=2.0)
    parser.add_argument("--t-draws", type=int, default=2, help="noised copies of each image")
    parser.add_argument("--minibatch", type=int, default=96, help="pairs per optimizer step")
    parser.add_argument("--probe-every", type=int, default=5, help="rounds")
    parser.add_argument(
        "--train-on", choices=["train", "test"], default="train",
        help="the split whose lines the rounds draw (test: the oracle diagnostic, session 35)",
    )  # fmt: skip
    parser.add_argument(
        "--old-decay",
        type=float,
        default=0.0,
        help="eta of the sampling policy's soft update (0: sample with the current policy)",
    )
    parser.add_argument("--nfe-budget", type=int, default=0, help="0: train.nfe_budget")
    args = parser.parse_args()
    cfg, policy = start_run(args)
    backend = policy.backend
    reward_fn = RewardMix(cfg, {"geneval": 1.0})
    train = layout.load_prompts(cfg, args.train_on)
    test = layout.load_prompts(cfg, "test")
    sigmas = sampling.timesteps_sigmas(cfg.sampling.num_steps, shift=cfg.sampling.shift)
    guidance = cfg.sampling.guidance
    batch = args.prompts * args.group
    pairs = batch * args.t_draws
    round_nfe = batch * cfg.sampling.num_steps * 2 + pairs * 8
    rounds = int((args.nfe_budget or cfg.train.nfe_budget) // round_nfe)
    rng = np.random.default_rng(args.seed)
    noise = torch.Generator().manual_seed(args.seed)
    history: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "rounds": [], "probes": {}}
    history["probes"]["0"] = probe(backend, cfg, test)
    params = lora_parameters(backend.transformer)
    old_weights = [param.detach().clone() for param in params]
    start = time.perf_counter()
    for round_index in tqdm(range(1, rounds + 1), desc="nft", unit="round"):
        lines = [train[i] for i in rng.choice(len(train), size=args.prompts, replace=False)]
        rows = [line for line in lines for _ in range(args.group)]
        prompts = [row["prompt"] for row in rows]
        x_T = torch.randn(batch, *backend.latent_shape, generator=noise)
        with weights_swapped(params, old_weights):
            x0 = sample_round(backend, prompts, x_T, sigmas, guidance)
        with torch.no_grad():
            rewards = reward_fn(backend.decode(x0), rows)["mix"]
        p = optimality(rewards, args.group, args.adv_scale)

        index = torch.arange(batch).repeat(args.t_draws)  # pair -> image
        t = torch.rand(pairs, generator=noise)
        eps = torch.randn(pairs, *backend.latent_shape, generator=noise)
        x_t = (1 - t)[:, None, None, None] * x0[index] + t[:, None, None, None] * eps
        target = eps - x0[index]
        embeds = backend.encode_prompts([prompts[i] for i in index.tolist()])
        with torch.no_grad(), weights_swapped(params, old_weights):
            v_old = torch.cat(
                [
                    backend.velocity(x_t[s], t[s], embeds[s], guidance=guidance)
                    for s in torch.arange(pairs).split(args.minibatch)
                ]
            )
        losses = []
        for s in torch.randperm(pairs, generator=noise).split(args.minibatch):
            v_theta = backend.velocity(x_t[s], t[s], embeds[s], guidance=guidance)
            loss = nft_loss(v_theta, v_old[s], target[s], p[index[s]], args.beta)
            policy.optimizer.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, cfg.update.max_grad_norm)
            policy.optimizer.step()
            losses.append(float(loss.detach()))
        soft_update(old_weights, params, args.old_decay)
        history["rounds"].append(
            {
                "round": round_index,
                "reward": float(rewards.mean()),
                "groups_without_variance": float(
                    (rewards.view(-1, args.group).std(1) == 0).float().mean()
                ),
                "loss": float(np.mean(losses)),
                "nfe": round_index * round_nfe,
                "seconds": time.perf_counter() - start,
            }
        )
        record_step(history, round_index, rounds, args, backend, cfg, test, unit="round")

    write_evaluation(backend, cfg, test, args.out)


if __name__ == "__main__":
    main()

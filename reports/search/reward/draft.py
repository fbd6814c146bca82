"""Session 26 scratch measurement (reports/search.md, session 26): is the policy-gradient
estimator the limit, or the model? Direct reward backpropagation (DRaFT, Clark et al. 2024,
"Directly Fine-Tuning Diffusion Models on Differentiable Rewards") on the same LoRA, base,
sampler and training prompts as the default recipe: sample with the guided ODE (the evaluation
sampler's kind, `sampling.num_steps` steps), decode, score with ShapesCLIP (differentiable),
and step AdamW on -mean(score), the gradient flowing back through the last `--truncate`
sampler steps (0: all of them). No likelihood ratios, no groups: the exact reward gradient.
If this moves held-out GenEval (the rule-based protocol: a different judge from the trained
reward) where GRPO does not, GRPO's estimator is what limits learning here; if it does not,
the model or the reward is. Session 36: `--rank` (alpha = 2 x rank) and `--train` (the LoRA,
plus the text encoder, or every weight) widen what the update may change, to tell the adapter's
capacity from the reward's agreement with the judge.

    python reports/search/reward/draft.py --out reports/search/reward/draft/NAME [options]

Writes `history.json` (per step: ShapesCLIP reward, the batch's GenEval accuracy by the rule
detector, grad norm; the held-out probe every `--probe-every` steps, 144 test prompts x 2
fixed-noise images as the training runs' probe) and, at the end, the evaluation protocol's
verdicts (`eval/results.jsonl`, 144 x 8 images, the same seeds as `creditflow evaluate`) and
`eval/metrics.json`. Cost is counted in denoiser forward evaluations (a backward counted as
two), to set beside GRPO's NFEs.
"""

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pipeline import layout, sampling  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.evaluation import geneval_protocol, judge  # noqa: E402
from pipeline.grpo import lora_parameters  # noqa: E402
from pipeline.io import write_text  # noqa: E402
from pipeline.policy import Policy  # noqa: E402
from pipeline.rewards import SHAPESCLIP_DIR  # noqa: E402
from pipeline.shapesclip import load_shapesclip  # noqa: E402


def sample_with_grad(backend, prompts, x_T, sigmas, guidance: float, truncate: int):
    """Guided Euler ODE from x_T (B, C, H, W) over `sigmas`; autograd records only the last
    `truncate` steps (all when 0). Returns the final state (B, C, H, W)."""
    num_steps = len(sigmas) - 1
    first_recorded = 0 if truncate == 0 else num_steps - truncate
    embeds = backend.encode_prompts(prompts)
    x = x_T
    for i in range(num_steps):
        with torch.set_grad_enabled(i >= first_recorded):
            sigma = sigmas[i].expand(len(prompts))
            v = backend.velocity(x, sigma, embeds, guidance=guidance)
            x = x + (sigmas[i + 1] - sigmas[i]) * v
    return x


TRAINED = ("lora", "lora+text", "all")


def add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every scratch update shares: --out, --lr, --seed, --threads, --rank."""
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--rank", type=int, default=8, help="LoRA rank (alpha = 2 x rank, the default's scale)"
    )


def add_trained_argument(parser: argparse.ArgumentParser) -> None:
    """--train: which weights the update may change (`trained_parameters`)."""
    parser.add_argument(
        "--train",
        choices=TRAINED,
        default="lora",
        help="trained weights: the denoiser's LoRA, plus the text encoder, or every weight but "
        "the autoencoder's",
    )


def start_run(args: argparse.Namespace):
    """Torch threads set, then `lora_policy(args.lr, args.seed, args.rank)`. Returns (cfg,
    policy)."""
    torch.set_num_threads(args.threads)
    return lora_policy(args.lr, args.seed, args.rank)


def lora_policy(lr: float, seed: int, rank: int = 8):
    """The default config at this lr, seed and LoRA rank (alpha 2 x rank), and a fresh policy
    whose LoRA on the denoiser is the only trained part (every other module frozen). Returns
    (cfg, policy)."""
    overrides = [f"update.lr={lr}", f"train.seed={seed}"]
    overrides += [f"update.lora_rank={rank}", f"update.lora_alpha={2.0 * rank}"]
    cfg = load_config(REPO / "params.yaml", overrides)
    policy = Policy.create(cfg)
    for module in policy.backend.modules.values():
        if module is not policy.backend.transformer:
            module.requires_grad_(False)
    return cfg, policy


def trained_parameters(backend, trained: str) -> list[torch.nn.Parameter]:
    """The weights `--train` names, made trainable (everything else stays frozen)."""
    params = lora_parameters(backend.transformer)
    if trained == "all":
        params = list(backend.transformer.parameters())
    if trained in ("lora+text", "all"):
        params += list(backend.text_encoder.parameters())
    for param in params:
        param.requires_grad_(True)
    return params


def trained_optimizer(policy, cfg, trained: str):
    """(params, optimizer): the policy's own LoRA optimizer for `--train lora`, else a fresh
    AdamW (same lr and weight decay) over `trained_parameters`."""
    params = trained_parameters(policy.backend, trained)
    if trained == "lora":
        return params, policy.optimizer
    up = cfg.update
    return params, torch.optim.AdamW(params, lr=up.lr, weight_decay=up.weight_decay)


def write_evaluation(backend, cfg, test, out: Path) -> None:
    """The evaluation protocol's verdicts and scores into `out/eval/` (results.jsonl,
    metrics.json), as `creditflow evaluate` writes them, and its summary printed."""
    with torch.no_grad():
        _, results, summary = geneval_protocol(backend, test, cfg)
    write_text(out / "eval" / "results.jsonl", "".join(json.dumps(r) + "\n" for r in results))
    metrics = {k: summary[k] for k in ("overall", "per_tag")}
    write_text(out / "eval" / "metrics.json", json.dumps(metrics, indent=1) + "\n")
    print(f"evaluation protocol: {summary['overall']:.3f} {summary['per_tag']}")


def record_step(
    history: dict, step: int, last: int, args, backend, cfg, test, unit: str = "step"
) -> None:
    """After an optimizer step (or round, `unit`): the held-out probe when due (every
    `--probe-every` and after `last`), then `history.json` rewritten, so that a stopped run keeps
    its curve."""
    if step % args.probe_every == 0 or step == last:
        history["probes"][str(step)] = probe(backend, cfg, test)
        tqdm.write(f"{unit} {step}: probe {history['probes'][str(step)]['overall']:.3f}")
    write_text(args.out / "history.json", json.dumps(history, indent=1) + "\n")


def probe(backend, cfg, test) -> dict[str, float]:
    with torch.no_grad():
        _, _, summary = geneval_protocol(
            backend, test, cfg, images_per_prompt=cfg.train.probe_images, desc="probe"
        )
    return {"overall": summary["overall"], **summary["per_tag"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    add_trained_argument(parser)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=32, help="prompts (one image each) per step")
    parser.add_argument("--truncate", type=int, default=0, help="recorded last steps (0: all)")
    parser.add_argument("--probe-every", type=int, default=25)
    args = parser.parse_args()
    cfg, policy = start_run(args)
    backend = policy.backend
    params, optimizer = trained_optimizer(policy, cfg, args.train)
    clip = load_shapesclip(REPO / SHAPESCLIP_DIR).requires_grad_(False)
    train = layout.load_prompts(cfg, "train")
    test = layout.load_prompts(cfg, "test")
    sigmas = sampling.timesteps_sigmas(cfg.sampling.num_steps, shift=cfg.sampling.shift)
    recorded = cfg.sampling.num_steps if args.truncate == 0 else args.truncate
    # forward: B x T x 2 (guidance); backward of the recorded steps: 2 forwards each
    nfe_per_step = args.batch * 2 * (cfg.sampling.num_steps + 2 * recorded)
    rng = np.random.default_rng(args.seed)
    noise = torch.Generator().manual_seed(args.seed)
    history: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "steps": [], "probes": {}}
    history["probes"]["0"] = probe(backend, cfg, test)
    start = time.perf_counter()
    for step in tqdm(range(1, args.steps + 1), desc="draft", unit="step"):
        rows = [train[i] for i in rng.choice(len(train), size=args.batch, replace=False)]
        prompts = [row["prompt"] for row in rows]
        x_T = torch.randn(args.batch, *backend.latent_shape, generator=noise)
        images = backend.decode(
            sample_with_grad(backend, prompts, x_T, sigmas, cfg.sampling.guidance, args.truncate)
        )
        reward = clip.score(images, prompts)
        optimizer.zero_grad()
        (-reward.mean()).backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.update.max_grad_norm)
        optimizer.step()
        if args.train != "lora":
            backend.clear_cache()  # prompt encodings are stale once the text encoder has moved
        verdicts = judge(images.detach(), rows)
        history["steps"].append(
            {
                "step": step,
                "reward": float(reward.detach().mean()),
                "train_accuracy": float(np.mean([v["correct"] for v in verdicts])),
                "grad_norm": float(grad_norm),
                "nfe": step * nfe_per_step,
                "seconds": time.perf_counter() - start,
            }
        )
        record_step(history, step, args.steps, args, backend, cfg, test)

    write_evaluation(backend, cfg, test, args.out)


if __name__ == "__main__":
    main()

"""Session 27 scratch measurement (reports/search.md, session 27): how closely does a GRPO
gradient point along the gradient it estimates, and how closely does the exact one?

For one prompt with its group's shared x_T, the flow_grpo SDE on the window steps W and the ODE
elsewhere, GRPO's objective is J(θ) = E_ε[R(x0)] with the window steps' transitions as the
policy's actions. Its surrogate gradient Σ_i A_i Σ_{k∈W} ∇ log p_θ(x_{k+1} | x_k) (A the
group-normalised reward) is a likelihood-ratio estimate of ∇J / std(R). With a differentiable
reward (ShapesCLIP) the same ∇J has a pathwise estimate: the noise fixed, R backpropagated
through the sampler, θ entering only at the window steps (the ODE steps carry the state's
gradient but not θ's, as GRPO treats them). Per prompt, a reference ∇J is the mean pathwise
gradient of `--reference` samples; against it are set, on independent samples, GRPO's estimate
from G samples and the pathwise estimate from G samples. The reference's own noise caps every
cosine: its split-half cosine r gives the cap sqrt(2r / (1 + r)) (Spearman-Brown). Across
prompts, the cosine of the references of two disjoint halves of the prompts says how much of ∇J
the prompts share (what held-out prompts can gain from).

    OMP_NUM_THREADS=1 python reports/search/reward/estimator_cosine.py --window 0 3
    python reports/search/reward/estimator_cosine.py --table   # every stored result, markdown

writes `estimator-cosine-w<START>-<END>[-antithetic]-s<SEED>.json` beside this file. Base policy
(fresh LoRA).
"""

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
import torch  # noqa: E402
from torch.nn.functional import cosine_similarity  # noqa: E402
from tqdm import tqdm  # noqa: E402

from pipeline import layout, sampling  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.grpo import lora_parameters  # noqa: E402
from pipeline.io import write_json  # noqa: E402
from pipeline.policy import Policy  # noqa: E402
from pipeline.rewards import SHAPESCLIP_DIR  # noqa: E402
from pipeline.shapesclip import load_shapesclip  # noqa: E402

KIND = "flow_grpo"
CHUNK = 8  # samples per backward of the pathwise estimate


class Sampler:
    """The rollout's flow_grpo SDE for one prompt, differentiable where asked."""

    def __init__(self, cfg, backend, clip, window: torch.Tensor):
        self.backend, self.clip, self.window = backend, clip, window
        self.params = lora_parameters(backend.transformer)
        self.sigmas = sampling.timesteps_sigmas(cfg.sampling.num_steps, shift=cfg.sampling.shift)
        self.guidance, self.eta = cfg.sampling.guidance, cfg.rollout.eta[KIND]

    def _step(self, x, k: int, embeds, noise=None, prev_sample=None):
        s = self.sigmas
        v = self.backend.velocity(x, s[k].expand(len(x)), embeds, guidance=self.guidance)
        kind = KIND if self.window[k] else "ode"
        return sampling.sde_step(
            x, v, float(s[k]), float(s[k + 1]), kind=kind, eta=self.eta, noise=noise,
            prev_sample=prev_sample, sigma_max=float(s[1]),
        )  # fmt: skip

    def _reward(self, x, prompt: str) -> torch.Tensor:
        return self.clip.score(self.backend.decode(x), [prompt] * len(x))

    def _flat(self, grads) -> torch.Tensor:
        return torch.cat([
            torch.zeros(p.numel()) if g is None else g.flatten()
            for p, g in zip(self.params, grads, strict=True)
        ])  # fmt: skip

    def pathwise(self, prompt: str, x_T, noise) -> tuple[torch.Tensor, torch.Tensor]:
        """Σ_i ∇_θ R_i over the rows of noise (B, T, C, H, W), θ entering at window steps only;
        returns (that gradient (P,), the rewards (B,))."""
        embeds = self.backend.encode_prompts([prompt] * len(noise))
        x = x_T.expand(len(noise), -1, -1, -1)
        try:
            for k in range(len(self.window)):
                for p in self.params:
                    p.requires_grad_(bool(self.window[k]))
                x = self._step(x, k, embeds, noise=noise[:, k]).prev_sample
        finally:
            for p in self.params:
                p.requires_grad_(True)
        reward = self._reward(x, prompt)
        grads = torch.autograd.grad(reward.sum(), self.params, allow_unused=True)
        return self._flat(grads), reward.detach()

    def likelihood_ratio(self, prompt: str, x_T, noise, sizes) -> dict[int, torch.Tensor]:
        """GRPO's surrogate gradient Σ_{i<G} A_i Σ_{k∈W} ∇ log p_θ(x_{k+1} | x_k) at the
        on-policy point, for each G in sizes (the first G rows, A normalised among them)."""
        embeds = self.backend.encode_prompts([prompt] * len(noise))
        states = [x_T.expand(len(noise), -1, -1, -1)]
        with torch.no_grad():
            for k in range(len(self.window)):
                states.append(self._step(states[-1], k, embeds, noise=noise[:, k]).prev_sample)
            reward = self._reward(states[-1], prompt)
        log_prob = sum(
            self._step(states[k], k, embeds, prev_sample=states[k + 1]).log_prob
            for k in range(len(self.window))
            if self.window[k]
        )  # (B,), per-element-mean log-probs as the update's
        out = {}
        for size in sizes:
            r = reward[:size]
            advantage = (r - r.mean()) / (r.std(correction=0) + 1e-4)
            grads = torch.autograd.grad(
                (advantage * log_prob[:size]).sum(), self.params, retain_graph=True,
                allow_unused=True,
            )  # fmt: skip
            out[size] = self._flat(grads)
        return out


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(cosine_similarity(a, b, dim=0))


def table() -> str:
    """The stored results as markdown rows: mean over prompts of each cosine with the reference."""
    lines = [
        "| window (seed) | prompts | reference samples: cap | exact gradient from 8 / 64 samples "
        "| GRPO from 8 / 16 / 32 / 64 samples | exact gradients across prompts (pairs / halves) |",
        "|---|---|---|---|---|---|",
    ]
    for path in sorted(HERE.glob("estimator-cosine-w*.json")):
        r = json.loads(path.read_text())
        seed = path.stem.rsplit("-s", 1)[1]
        lr, pw = r["likelihood_ratio_mean"], r["pathwise_mean"]
        lines.append(
            f"| {r['window'][0]}-{r['window'][1]} ({seed})"
            f"{', antithetic' if 'antithetic' in path.stem else ''} | {r['prompts']} | "
            f"{r['reference_samples']}: {r['cosine_cap_mean']:.2f} | "
            f"{pw['8']:.2f} / {pw['64']:.2f} | "
            + " / ".join(f"{lr[g]:.2f}" for g in lr)
            + f" | {r['references_pairwise_mean']:+.3f} / "
            f"{r['references_across_prompt_halves']:+.2f} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", action="store_true", help="print the stored results")
    parser.add_argument("--window", type=int, nargs=2, default=[0, 3], metavar=("START", "END"))
    parser.add_argument("--prompts", type=int, default=8, help="training prompts, evenly spaced")
    parser.add_argument("--reference", type=int, default=64, help="pathwise samples per prompt")
    parser.add_argument("--samples", type=int, default=64, help="evaluated samples per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--antithetic",
        action="store_true",
        help="evaluated samples in antithetic pairs: the second of each pair the first's noise "
        "negated (session 28)",
    )
    args = parser.parse_args()
    if args.table:
        print(table())
        return
    start, end = args.window
    cfg = load_config(
        REPO / "params.yaml", [f"rollout.window_start={start}", f"rollout.window_end={end}"]
    )
    backend = Policy.create(cfg).backend
    for module in backend.modules.values():
        if module is not backend.transformer:
            module.requires_grad_(False)
    clip = load_shapesclip(REPO / SHAPESCLIP_DIR).requires_grad_(False)
    window = sampling.sde_window(cfg.sampling.num_steps, start=start, end=end, kind=KIND)
    sampler = Sampler(cfg, backend, clip, window)
    lines = layout.load_prompts(cfg, "train")
    prompts = [lines[i]["prompt"] for i in range(0, len(lines), len(lines) // args.prompts)]
    prompts = prompts[: args.prompts]
    sizes = [g for g in (8, 16, 32, 64) if g <= args.samples]
    generator = torch.Generator().manual_seed(args.seed)
    shape = (cfg.sampling.num_steps, *backend.latent_shape)

    began = time.perf_counter()
    rows, references, stds = [], [], []
    for prompt in tqdm(prompts, desc=f"window {start}-{end}", unit="prompt"):
        x_T = torch.randn(1, *backend.latent_shape, generator=generator)
        ref_noise = torch.randn(args.reference, *shape, generator=generator)
        chunks = [sampler.pathwise(prompt, x_T, n) for n in ref_noise.split(CHUNK)]
        halves = [torch.stack([g for g, _ in part]).sum(0) for part in (chunks[::2], chunks[1::2])]
        reference = halves[0] + halves[1]
        reward = torch.cat([r for _, r in chunks])
        noise = torch.randn(args.samples, *shape, generator=generator)
        if args.antithetic:
            noise[1::2] = -noise[0::2]
        lr = sampler.likelihood_ratio(prompt, x_T, noise, sizes)
        path = [sampler.pathwise(prompt, x_T, n)[0] for n in noise.split(CHUNK)]
        split_half = cos(*halves)
        rows.append({
            "prompt": prompt,
            "reward_mean": float(reward.mean()),
            "reward_std": float(reward.std(correction=0)),
            "reference_split_half": split_half,
            "cosine_cap": (2 * max(split_half, 0) / (1 + split_half)) ** 0.5,
            "likelihood_ratio": {g: cos(lr[g], reference) for g in sizes},
            "pathwise": {g: cos(torch.stack(path[: g // CHUNK]).sum(0), reference)
                         for g in sizes},
        })  # fmt: skip
        references.append(reference / args.reference)
        stds.append(float(reward.std(correction=0)))
        tqdm.write(json.dumps(rows[-1]))

    def mean_over_prompts(key: str) -> dict:
        return {g: sum(r[key][g] for r in rows) / len(rows) for g in sizes}

    # ∇J_p / std_p: the weight GRPO's normalised advantages give each prompt
    weighted = [ref / max(s, 1e-4) for ref, s in zip(references, stds, strict=True)]
    half = len(weighted) // 2
    out = {
        "command": "python reports/search/reward/estimator_cosine.py " + " ".join(sys.argv[1:]),
        "window": [start, end],
        "prompts": len(prompts),
        "reference_samples": args.reference,
        "seconds": time.perf_counter() - began,
        "likelihood_ratio_mean": mean_over_prompts("likelihood_ratio"),
        "pathwise_mean": mean_over_prompts("pathwise"),
        "cosine_cap_mean": sum(r["cosine_cap"] for r in rows) / len(rows),
        "references_across_prompt_halves": cos(sum(weighted[:half]), sum(weighted[half:])),
        "references_pairwise_mean": sum(
            cos(weighted[i], weighted[j])
            for i in range(len(weighted))
            for j in range(i + 1, len(weighted))
        )
        / (len(weighted) * (len(weighted) - 1) / 2),  # fmt: skip
        "per_prompt": rows,
    }
    anti = "-antithetic" if args.antithetic else ""
    write_json(HERE / f"estimator-cosine-w{start}-{end}{anti}-s{args.seed}.json", out)
    print(json.dumps({k: v for k, v in out.items() if k != "per_prompt"}, indent=1))


if __name__ == "__main__":
    main()

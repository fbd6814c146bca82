"""Session 28 scratch measurement (reports/search.md, session 28): in which parameters does the
reward's exact gradient carry what different prompts share?

Session 27 found the exact gradients of different prompts nearly orthogonal in the LoRA space
(mean pairwise cosine 0.005-0.034), so what held-out prompts can gain from is about 2 % of a
prompt's gradient. This asks whether some parameters hold a larger shared part, and whether the
one x_T each prompt kept (as a GRPO group keeps it) is what made them orthogonal. Per prompt (one
x_T, or with `--fresh-x-T` a new x_T for every sample; the flow_grpo SDE on the window steps and
the ODE elsewhere as `estimator_cosine.py`, or with `--ode` the ODE everywhere: DRaFT's sampler),
the reference ∇J is the mean pathwise gradient of ShapesCLIP's score over `--samples` draws,
with respect to every weight of the text encoder and the denoiser, θ entering at the window
steps only (the prompt's text states are detached elsewhere; the unconditional "" branch of CFG
is held fixed). Its components are then grouped:
- text.tokens: the text encoder's token embeddings (one row per word of the vocabulary);
- text.rest: the rest of the text encoder (positions, layers, projection);
- unet.cross_kv: the cross-attention keys and values (they read the text states);
- unet.cross_q_out / unet.self_attn: the other attention projections (with cross_kv, the
  current LoRA targets);
- unet.rest: convolutions, norms, time and class embeddings;
- lora_targets: the three attention groups together.
Per group: each prompt's split-half cosine (is its gradient reproducible at all), and the mean
pairwise cosine of the prompts' references divided by their reward std (the weight GRPO's
normalised advantages give them), over all pairs, pairs of one tag, and pairs of two tags; and
the same divided by each pair's split-half caps √(2r/(1+r)) (the cosine of the noise-free
gradients; prompts with a cap below 0.2 left out).

    OMP_NUM_THREADS=1 python reports/search/params/shared_fraction.py --window 6 9 --seed 0
    python reports/search/params/shared_fraction.py --table

writes `shared-fraction-w<START>-<END>[-ode][-fresh]-s<SEED>.json` beside this file. Base model,
no LoRA.
"""

import argparse
import itertools
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
from pipeline.io import write_json  # noqa: E402
from pipeline.models import PromptEmbeds  # noqa: E402
from pipeline.policy import load_backend  # noqa: E402
from pipeline.rewards import SHAPESCLIP_DIR  # noqa: E402
from pipeline.shapesclip import load_shapesclip  # noqa: E402

KIND = "flow_grpo"
CHUNK = 8  # samples per backward
GROUPS = ("text.tokens", "text.rest", "unet.cross_kv", "unet.cross_q_out", "unet.self_attn",
          "unet.rest")  # fmt: skip
LORA = ("unet.cross_kv", "unet.cross_q_out", "unet.self_attn")  # the current LoRA targets


def group_of(name: str) -> str:
    """Parameter name (prefixed `text.` or `unet.`) -> its group."""
    if name.startswith("text."):
        return "text.tokens" if "token_embedding" in name else "text.rest"
    if ".attn2.to_k" in name or ".attn2.to_v" in name:
        return "unet.cross_kv"
    if ".attn2." in name:
        return "unet.cross_q_out"
    return "unet.self_attn" if ".attn1." in name else "unet.rest"


def cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(cosine_similarity(a, b, dim=0))


def cap(split_half: float) -> float:
    """Cosine of a mean of two halves with its noise-free value (Spearman-Brown), from the
    halves' cosine."""
    return (2 * max(split_half, 0.0) / (1 + split_half)) ** 0.5


class Pathwise:
    """Σ_i ∇_θ R_i for one prompt, θ (all weights) entering at the window steps only."""

    def __init__(self, cfg, backend, clip, window: torch.Tensor, kind: str = KIND):
        self.backend, self.clip, self.window, self.kind = backend, clip, window, kind
        named = [(f"text.{n}", p) for n, p in backend.text_encoder.named_parameters()]
        named += [(f"unet.{n}", p) for n, p in backend.transformer.named_parameters()]
        self.names, self.params = zip(*named, strict=True)
        self.denoiser_params = list(backend.transformer.parameters())
        self.sigmas = sampling.timesteps_sigmas(cfg.sampling.num_steps, shift=cfg.sampling.shift)
        self.guidance, self.eta = cfg.sampling.guidance, cfg.rollout.eta[KIND]
        self.uncond = backend.encode_prompts([""])  # no grad: the fixed CFG branch

    def __call__(self, prompt: str, x_T, noise) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        """noise (B, T, C, H, W) -> ({group: gradient (P_group,)}, rewards (B,))."""
        embeds = self.backend.embed_tokens(self.backend.tokenize([prompt] * len(noise)))
        fixed = PromptEmbeds(embeds.hidden.detach(), embeds.pooled.detach())  # off the window
        x = x_T.expand(len(noise), -1, -1, -1)  # x_T (1 or B, C, H, W)
        s = self.sigmas
        for k in range(len(self.window)):
            active = bool(self.window[k])
            for p in self.denoiser_params:
                p.requires_grad_(active)
            v = self.backend.velocity(
                x, s[k].expand(len(x)), embeds if active else fixed, guidance=self.guidance,
                uncond=self.uncond,
            )  # fmt: skip
            x = sampling.sde_step(
                x, v, float(s[k]), float(s[k + 1]), kind=self.kind if active else "ode",
                eta=self.eta, noise=noise[:, k], sigma_max=float(s[1]),
            ).prev_sample  # fmt: skip
        for p in self.denoiser_params:
            p.requires_grad_(True)
        reward = self.clip.score(self.backend.decode(x), [prompt] * len(x))
        grads = torch.autograd.grad(reward.sum(), self.params, allow_unused=True)
        flat = {g: [] for g in GROUPS}
        for name, p, grad in zip(self.names, self.params, grads, strict=True):
            flat[group_of(name)].append(torch.zeros(p.numel()) if grad is None else grad.flatten())
        return {g: torch.cat(v) for g, v in flat.items()}, reward.detach()


PAIRS = ("all", "same_tag", "other_tag")


def pair_means(
    vectors: list[torch.Tensor], tags: list[str], caps: list[float] | None = None
) -> dict[str, float]:
    """Mean pairwise cosine over all pairs, pairs of one tag, and pairs of two tags. With caps
    (each vector's cosine with its noise-free value, from its split half), each cosine is
    divided by cap_i * cap_j: the cosine of the noise-free vectors (pairs with a cap below
    0.2 are left out)."""
    same, other = [], []
    for i, j in itertools.combinations(range(len(vectors)), 2):
        if caps is None:
            value = cos(vectors[i], vectors[j])
        elif min(caps[i], caps[j]) >= 0.2:
            value = cos(vectors[i], vectors[j]) / (caps[i] * caps[j])
        else:
            continue
        (same if tags[i] == tags[j] else other).append(value)
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    return {"all": mean(same + other), "same_tag": mean(same), "other_tag": mean(other)}


def table() -> str:
    lines = [
        "| window (seed), x_T, sampler | group | parameters | share of the gradient's energy "
        "| split-half cosine (mean over prompts) | pairwise cosine across prompts: all / "
        "same tag / other tag | the same, noise-free |",
        "|---|---|---|---|---|---|---|",
    ]
    for path in sorted(HERE.glob("shared-fraction-w*.json")):
        r = json.loads(path.read_text())
        seed = path.stem.rsplit("-s", 1)[1]
        for g, row in r["groups"].items():
            p = row["pairwise"]
            lines.append(
                f"| {r['window'][0]}-{r['window'][1]} ({seed}), {r['x_T']}"
                f"{', ODE' if r['sampler'] == 'ode' else ''} | "
                f"{g} | {row['parameters']} | "
                f"{row['energy_share']:.3f} | {row['split_half_mean']:.2f} | "
                + " / ".join(f"{p[k]:+.3f}" for k in PAIRS) + " | "
                + " / ".join(f"{row['pairwise_noise_free'][k]:+.3f}" for k in PAIRS) + " |"
            )  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--table", action="store_true", help="print the stored results")
    parser.add_argument("--window", type=int, nargs=2, default=[6, 9], metavar=("START", "END"))
    parser.add_argument("--prompts", type=int, default=24, help="training prompts, evenly spaced")
    parser.add_argument("--samples", type=int, default=64, help="pathwise samples per prompt")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--fresh-x-T", action="store_true", help="a new x_T for every sample, not one per prompt"
    )
    parser.add_argument(
        "--ode", action="store_true", help="the ODE at every step (DRaFT's sampler): no noise"
    )
    args = parser.parse_args()
    if args.table:
        print(table())
        return
    start, end = args.window
    cfg = load_config(REPO / "params.yaml")
    backend = load_backend(cfg)
    clip = load_shapesclip(REPO / SHAPESCLIP_DIR).requires_grad_(False)
    if backend.autoencoder is not None:
        backend.autoencoder.requires_grad_(False)
    window = torch.zeros(cfg.sampling.num_steps, dtype=torch.bool)
    window[start:end] = True  # where θ enters (and, without --ode, the SDE runs)
    if not args.ode:
        window &= sampling.sde_window(cfg.sampling.num_steps, start=start, end=end, kind=KIND)
    pathwise = Pathwise(cfg, backend, clip, window, kind="ode" if args.ode else KIND)
    lines = layout.load_prompts(cfg, "train")
    picked = [lines[i] for i in range(0, len(lines), len(lines) // args.prompts)][: args.prompts]
    generator = torch.Generator().manual_seed(args.seed)
    shape = (cfg.sampling.num_steps, *backend.latent_shape)

    began = time.perf_counter()
    rows, references = [], []
    for line in tqdm(picked, desc=f"window {start}-{end}", unit="prompt"):
        x_T = torch.randn(
            args.samples if args.fresh_x_T else 1, *backend.latent_shape, generator=generator
        )
        noise = torch.randn(args.samples, *shape, generator=generator)
        starts = x_T.split(CHUNK) if args.fresh_x_T else itertools.repeat(x_T)
        chunks = [pathwise(line["prompt"], x, n) for x, n in zip(starts, noise.split(CHUNK))]  # noqa: B905
        reward = torch.cat([r for _, r in chunks])
        halves = {
            g: [sum(c[0][g] for c in part) for part in (chunks[::2], chunks[1::2])] for g in GROUPS
        }
        halves["lora_targets"] = [torch.cat([halves[g][i] for g in LORA]) for i in (0, 1)]
        std = max(float(reward.std(correction=0)), 1e-4)
        references.append({g: (h[0] + h[1]) / args.samples / std for g, h in halves.items()})
        rows.append({
            "prompt": line["prompt"], "tag": line["tag"], "reward_mean": float(reward.mean()),
            "reward_std": std, "split_half": {g: cos(*h) for g, h in halves.items()},
        })  # fmt: skip
        tqdm.write(json.dumps(rows[-1]))

    tags = [r["tag"] for r in rows]
    energy = {g: sum(float(ref[g].square().sum()) for ref in references) for g in references[0]}
    total = sum(energy[g] for g in GROUPS)
    groups = {
        g: {
            "parameters": references[0][g].numel(),
            "energy_share": energy[g] / total,
            "split_half_mean": sum(r["split_half"][g] for r in rows) / len(rows),
            "pairwise": pair_means([ref[g] for ref in references], tags),
            "pairwise_noise_free": pair_means(
                [ref[g] for ref in references], tags, [cap(r["split_half"][g]) for r in rows]
            ),
        }
        for g in references[0]
    }
    out = {
        "command": "python reports/search/params/shared_fraction.py " + " ".join(sys.argv[1:]),
        "window": [start, end],
        "prompts": len(rows),
        "samples": args.samples,
        "seconds": time.perf_counter() - began,
        "x_T": "one per sample" if args.fresh_x_T else "one per prompt",
        "sampler": "ode" if args.ode else f"{KIND} SDE on the window",
        "groups": groups,
        "per_prompt": rows,
    }
    suffix = ("-ode" if args.ode else "") + ("-fresh" if args.fresh_x_T else "")
    write_json(HERE / f"shared-fraction-w{start}-{end}{suffix}-s{args.seed}.json", out)
    print(table())


if __name__ == "__main__":
    main()

"""GenEval protocol: fixed-seed ODE samples of the test prompts, judged by the GenEval rules."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch
from torch import Tensor
from tqdm.auto import tqdm

from pipeline import sampling
from pipeline.distributed import SINGLE, Ranks, gather_objects, shard
from pipeline.geneval import summarize, verdicts
from pipeline.io import atomic_path


def generate(
    backend,
    prompts: Sequence[str],
    *,
    seeds: Sequence[int],
    num_steps: int,
    shift: float,
    guidance: float,
    batch_size: int,
    desc: str = "evaluate",
) -> Tensor:
    """Deterministic ODE samples, one per (prompt, seed) pair -> images (B, 3, H, W) in [0, 1].

    Each image's x_T comes from its own seed, so a sample does not depend on its batch.
    """
    sigmas = sampling.timesteps_sigmas(num_steps, shift=shift)
    window = torch.zeros(num_steps, dtype=torch.bool)
    images = []
    with torch.no_grad(), tqdm(total=len(prompts), unit="img", desc=desc, leave=False) as bar:
        for start in range(0, len(prompts), batch_size):
            chunk = list(prompts[start : start + batch_size])
            x_T = torch.stack(
                [
                    torch.randn(backend.latent_shape, generator=torch.Generator().manual_seed(s))
                    for s in seeds[start : start + batch_size]
                ]
            )  # (b, C, H, W)
            embeds = backend.encode_prompts(chunk)

            def velocity(x: Tensor, sigma: Tensor, embeds=embeds) -> Tensor:
                return backend.velocity(x, sigma, embeds, guidance=guidance)

            final = sampling.sample(
                velocity, x_T, sigmas, kind="ode", eta=0.0, window=window, keep_states=False
            ).final
            images.append(backend.decode(final))
            bar.update(len(chunk))
    return torch.cat(images)


def judge(images: Tensor, metadata: Sequence[dict], *, workers: int = 1) -> list[dict]:
    """GenEval verdicts: one {tag, prompt, correct, reason} per image (detector processes:
    `workers`)."""
    from pipeline.detector import detect_batch

    return verdicts(metadata, detect_batch(images, workers=workers))


def geneval_protocol(
    backend,
    metadata: Sequence[dict],
    cfg,
    *,
    images_per_prompt: int | None = None,
    desc: str = "evaluate",
    ranks: Ranks = SINGLE,
) -> tuple[Tensor, list[dict], dict]:
    """Fixed-seed evaluation-sampler images per test prompt (`evaluate.images_per_prompt` unless
    given), their verdicts and the summary. The seeds depend only on `evaluate.seed` and the
    image's place in the list, so every policy is judged on the same initial noise. Over several
    ranks each samples and judges a contiguous shard of the images, and every rank gets all."""
    per_prompt = images_per_prompt or cfg.evaluate.images_per_prompt
    everything = [meta for meta in metadata for _ in range(per_prompt)]
    mine = shard(len(everything), ranks)
    rows = everything[mine]
    seeds = [cfg.evaluate.seed * 100_003 + i for i in range(len(everything))][mine]
    images = generate(
        backend,
        [meta["prompt"] for meta in rows],
        seeds=seeds,
        num_steps=cfg.sampling.eval_num_steps,
        shift=cfg.sampling.shift,
        guidance=cfg.sampling.guidance,
        batch_size=cfg.evaluate.batch_size,
        desc=desc,
    )
    results = judge(images, rows, workers=cfg.score.reward_workers)
    if ranks.distributed:
        shards = gather_objects((images, results), ranks)
        images = torch.cat([part for part, _ in shards])
        results = [verdict for _, part in shards for verdict in part]
    return images, results, summarize(results)


def judged_grid(
    images: Tensor, results: Sequence[dict], images_per_prompt: int, path: Path, limit: int = 32
) -> None:
    """The protocol's first image of each of the first `limit` prompts, captioned with its
    prompt and ✓/✗ for the GenEval verdict; `images` and `results` as `geneval_protocol`'s."""
    first = list(range(0, len(results), images_per_prompt))[:limit]
    captions = [("✓ " if results[i]["correct"] else "✗ ") + results[i]["prompt"] for i in first]
    sample_grid(images[first], captions, path)


def sample_grid(images: Tensor, captions: Sequence[str], path: Path, *, columns: int = 8) -> None:
    """A PNG grid of images with each caption printed under its image."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = images.shape[0]
    rows = (n + columns - 1) // columns
    fig, axes = plt.subplots(rows, columns, figsize=(columns * 1.6, rows * 1.9), squeeze=False)
    for i, ax in enumerate(axes.flat):
        ax.axis("off")
        if i < n:
            ax.imshow(images[i].permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest")
            ax.set_title(_wrap(captions[i]), fontsize=5.5, y=-0.32)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def _wrap(text: str, width: int = 24) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(text.removeprefix("a photo of "), width))

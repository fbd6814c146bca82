"""Which denoiser can learn to draw ShapesWorld's shapes: a measurement, not a test.

Trains a flow model from scratch for a fixed wall-clock budget at one thread, on the scenes that
teach drawing (the world's single_object and colors lines), with the saved base model's
autoencoder and tokenizer and the `base` section's recipe (batch, lr with warmup, logit-normal
t, caption dropout; no EMA, no lr decay: the budget ends the run, not a step count). Then
"a photo of a <shape>" per class, judged by the detector (`base_quality.single_object_by_shape`:
the training sampler's ODE, fixed seeds). Equal wall clock, not equal steps, is the comparison
that matters on a CPU budget; run the denoisers side by side (one thread each) so that both
see the same machine.

    python benchmarks/denoiser_probe.py --denoiser unet --minutes 30 \
        --out reports/base/denoiser_probe

writes OUT/<denoiser>.json: settings, steps, seconds, parameters, final loss, accuracy by shape.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch
from base_quality import single_object_by_shape

from pipeline.config import load_config
from pipeline.io import atomic_path
from pipeline.models import ShapesBackend, build_denoiser, build_text_encoder
from pipeline.pretrain import (
    _batches,
    flow_step,
    lr_factor,
    pretrain_pool,
    tail_mean,
)
from pipeline.world import render_batch

REPO = Path(__file__).resolve().parents[1]
DRAWING_TAGS = ("single_object", "colors")


def probe_backend(base: ShapesBackend, denoiser: str, seed: int) -> ShapesBackend:
    """A fresh text encoder and `denoiser` (the `base` section's sizes) on `base`'s autoencoder
    and tokenizer."""
    config = dataclasses.replace(base.config, denoiser=denoiser)
    torch.manual_seed(seed)
    return ShapesBackend(
        config,
        base.tokenizer,
        build_text_encoder(config, base.tokenizer),
        build_denoiser(config),
        base.autoencoder,
    )


def train_for(backend: ShapesBackend, cfg, minutes: float, seed: int) -> tuple[int, list[float]]:
    """Flow-matching steps until the wall-clock budget is spent; returns (steps, losses)."""
    recipe = cfg.base
    pool = [m for m in pretrain_pool(cfg) if m["tag"] in DRAWING_TAGS]
    rng, noise = np.random.default_rng(seed), torch.Generator().manual_seed(seed + 1)
    draw = _batches(pool, recipe.batch_size, rng)
    trained = [backend.transformer, backend.text_encoder]
    params = [p for m in trained for p in m.parameters()]
    for module in trained:
        module.train()
    optimizer = torch.optim.AdamW(params, lr=recipe.lr, betas=(0.9, 0.99))
    losses: list[float] = []
    deadline = time.perf_counter() + 60 * minutes
    while time.perf_counter() < deadline:
        for group in optimizer.param_groups:
            group["lr"] = recipe.lr * lr_factor(len(losses), recipe.warmup)
        metas = draw()
        images = render_batch(metas, rng, cfg.world.image_size).float()
        losses.append(
            flow_step(
                backend, optimizer, params, metas, images, noise,
                caption_dropout=recipe.caption_dropout, t_mean=recipe.t_mean,
                t_std=recipe.t_std, grad_clip=recipe.grad_clip,
            )
        )  # fmt: skip
    backend.eval()
    backend.clear_cache()
    return len(losses), losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--denoiser", choices=("mmdit", "unet"), required=True)
    parser.add_argument("--minutes", type=float, default=30.0, help="training wall clock")
    parser.add_argument("--model", type=Path, default=REPO / "data/base/model")
    parser.add_argument("--params", type=Path, default=REPO / "params.yaml")
    parser.add_argument("--out", type=Path, default=REPO / "reports/base/denoiser_probe")
    parser.add_argument("--shape-images", type=int, default=64, help="images per shape class")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cfg = load_config(args.params)
    backend = probe_backend(ShapesBackend.from_pretrained(args.model), args.denoiser, args.seed)
    start = time.perf_counter()
    steps, losses = train_for(backend, cfg, args.minutes, args.seed)
    seconds = time.perf_counter() - start
    common = {"shift": cfg.sampling.shift, "guidance": cfg.sampling.guidance, "batch_size": 64}
    by_shape, _ = single_object_by_shape(backend, cfg, args.shape_images, 1234, common)
    result = {
        "denoiser": args.denoiser,
        "settings": {
            "minutes": args.minutes,
            "threads": 1,
            "tags": list(DRAWING_TAGS),
            "batch_size": cfg.base.batch_size,
            "lr": cfg.base.lr,
            "shape_images": args.shape_images,
            "sampler": f"ode, {cfg.sampling.num_steps} steps, guidance {cfg.sampling.guidance}",
        },
        "parameters": sum(p.numel() for p in backend.transformer.parameters()),
        "steps": steps,
        "train_seconds": round(seconds, 1),
        "final_loss": round(tail_mean(losses), 4),
        "single_object_by_shape": by_shape,
        "min_shape": min(by_shape.values()),
    }
    print(json.dumps(result, indent=2))
    args.out.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out / f"{args.denoiser}.json") as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Quality of a saved ShapesWorld base policy under the GenEval rules, on the held-out test prompts.

Samples ``--images-per-prompt`` fixed-seed images per test prompt with the training-time sampler
settings of ``params.yaml`` (``sampling.num_steps``, ``shift``, ``guidance``) and judges them with
the ShapesWorld detector and the GenEval rules, for three samplers:

- ``ode``: deterministic Euler over the training schedule (the headline number);
- ``sde``: Flow-GRPO's rollout SDE (``rollout.eta.flow_grpo``) on the default ``sde_window``;
- ``ode_eval``: the Euler ODE with ``sampling.eval_num_steps`` (the `evaluate` stage protocol).

Target: overall between 0.25 and 0.75 with single_object >= 0.6 for ``ode``, and every shape
class drawable: "a photo of a <shape>" judged correct >= 0.5 for every shape of the world
(``single_object_by_shape``, ODE, ``--shape-images`` images each).
Writes into ``--out``: quality.json (per-tag accuracy per sampler, settings, pretraining time),
samples.png (one ODE sample per test prompt, the prompt under each), pretrain_losses.png
(flow and autoencoder loss curves; the `base` stage owns loss.png); and logs the per-tag numbers
(``quality/<sampler>/<tag>``) with those files to an MLflow run ``base_quality`` under the
pipeline's parent run.

    python benchmarks/base_quality.py --model data/base/model --out reports/base
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np
import torch

from pipeline import sampling
from pipeline.config import load_config
from pipeline.evaluation import generate, judge, sample_grid
from pipeline.geneval import summarize
from pipeline.io import atomic_path
from pipeline.models import ShapesBackend
from pipeline.pretrain import HISTORY_FILE
from pipeline.tracking import configure_environment, log_artifact, log_metrics, stage_run
from pipeline.world import make_prompts, read_prompts, whole_world

REPO = Path(__file__).resolve().parents[1]


def test_prompts(cfg) -> list[dict]:
    """The `prompts` stage's test split if written, else the same split made from params."""
    path = cfg.path("data/prompts/test.jsonl")
    if path.is_file():
        return read_prompts(path)
    p = cfg.prompts
    world = cfg.world
    return make_prompts(
        p.n_train,
        p.n_test,
        seed=p.seed,
        shapes=world.shapes,
        colors=world.colors,
        max_count=world.max_count,
        mix=p.mix,
    )[1]


def sde_samples(backend, prompts: list[str], seeds: list[int], cfg, batch_size: int):
    """Rollout-sampler images: flow_grpo SDE (a = rollout.eta.flow_grpo) on the default window."""
    steps = cfg.sampling.num_steps
    sigmas = sampling.timesteps_sigmas(steps, shift=cfg.sampling.shift)
    window = sampling.sde_window(steps, kind="flow_grpo")
    images = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start : start + batch_size]
            gens = [torch.Generator().manual_seed(s) for s in seeds[start : start + batch_size]]
            x_T = torch.stack([torch.randn(backend.latent_shape, generator=g) for g in gens])
            embeds = backend.encode_prompts(chunk)

            def velocity(x, sigma, embeds=embeds):
                return backend.velocity(x, sigma, embeds, guidance=cfg.sampling.guidance)

            final = sampling.sample(
                velocity,
                x_T,
                sigmas,
                kind="flow_grpo",
                eta=cfg.rollout.eta["flow_grpo"],
                window=window,
                generator=torch.Generator().manual_seed(seeds[start]),
                keep_states=False,
            ).final
            images.append(backend.decode(final))
    return torch.cat(images)


def plot_losses(history: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    curves = [("flow (rectified-flow MSE)", history["flow_loss"])]
    if history.get("ae_loss"):
        curves.append(("autoencoder (weighted L1+MSE+KL)", history["ae_loss"]))
    fig, axes = plt.subplots(1, len(curves), figsize=(5 * len(curves), 3.4), squeeze=False)
    for ax, (title, losses) in zip(axes[0], curves, strict=True):
        losses = np.asarray(losses)
        window = max(len(losses) // 50, 1)
        smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
        ax.plot(losses, color="0.8", lw=0.6, label="per step")
        ax.plot(np.arange(window - 1, len(losses)), smooth, lw=1.4, label=f"mean of {window}")
        ax.set(title=title, xlabel="step", ylabel="loss", yscale="log")
        ax.legend(fontsize=7)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", type=Path, default=REPO / "data/base/model")
    parser.add_argument("--params", type=Path, default=REPO / "params.yaml")
    parser.add_argument("--out", type=Path, default=REPO / "reports/base")
    # 24 test prompts per tag: 16 images each make 384 per tag (standard error <= 0.026)
    parser.add_argument("--images-per-prompt", type=int, default=16)
    parser.add_argument("--shape-images", type=int, default=64, help="images per shape class")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: as is)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    cfg = load_config(args.params)
    backend = ShapesBackend.from_pretrained(args.model)
    metadata = test_prompts(cfg)
    rows = [m for m in metadata for _ in range(args.images_per_prompt)]
    prompts = [m["prompt"] for m in rows]
    seeds = [args.seed * 100_003 + i for i in range(len(rows))]
    common = dict(
        shift=cfg.sampling.shift, guidance=cfg.sampling.guidance, batch_size=args.batch_size
    )

    results, samplers = (
        {},
        {
            "ode": lambda: generate(
                backend, prompts, seeds=seeds, num_steps=cfg.sampling.num_steps, **common
            ),
            "sde": lambda: sde_samples(backend, prompts, seeds, cfg, args.batch_size),
            "ode_eval": lambda: generate(
                backend, prompts, seeds=seeds, num_steps=cfg.sampling.eval_num_steps, **common
            ),
        },
    )
    images = {}
    for name, draw in samplers.items():
        start = time.perf_counter()
        images[name] = draw()
        seconds = time.perf_counter() - start
        verdicts = judge(images[name], rows)
        results[name] = {**summarize(verdicts), "sample_seconds": round(seconds, 1)}
        print(f"{name:9s} overall {results[name]['overall']:.3f}  {results[name]['per_tag']}")

    by_shape, shape_grid = single_object_by_shape(
        backend, cfg, args.shape_images, args.seed, common
    )
    print("single_object by shape (ode):", by_shape)

    history_file = args.model / HISTORY_FILE
    history = json.loads(history_file.read_text()) if history_file.is_file() else None
    settings = {
        "num_steps": cfg.sampling.num_steps,
        "eval_num_steps": cfg.sampling.eval_num_steps,
        "shift": cfg.sampling.shift,
        "guidance": cfg.sampling.guidance,
        "sde": {"kind": "flow_grpo", "eta": cfg.rollout.eta["flow_grpo"], "window": "all but last"},
        "images_per_prompt": args.images_per_prompt,
        "shape_images": args.shape_images,
        "test_prompts": len(metadata),
        "seed": args.seed,
    }
    report = {
        "model": str(args.model),
        "settings": settings,
        "target": {
            "overall": [0.25, 0.75],
            "single_object_min": 0.6,
            "per_shape_min": 0.5,
            "sampler": "ode",
        },
        "meets_target": bool(
            0.25 <= results["ode"]["overall"] <= 0.75
            and results["ode"]["per_tag"].get("single_object", 0.0) >= 0.6
            and min(by_shape.values()) >= 0.5
        ),
        "samplers": results,
        "single_object_by_shape": by_shape,
    }
    if history is not None:
        report["pretraining"] = {
            "seconds": history["seconds"],
            "num_parameters": history["num_parameters"],
            "params": history["params"],
            "final_loss_mean_last_100": float(np.mean(history["flow_loss"][-100:])),
        }
    args.out.mkdir(parents=True, exist_ok=True)
    with atomic_path(args.out / "quality.json") as tmp:
        tmp.write_text(json.dumps(report, indent=2) + "\n")

    first = [i * args.images_per_prompt for i in range(len(metadata))]
    second = [i + 1 for i in first] if args.images_per_prompt > 1 else []
    pick = first + second
    written = [args.out / "quality.json", args.out / "samples.png"]
    sample_grid(images["ode"][pick], [prompts[i] for i in pick], written[-1])
    written.append(args.out / "shapes_by_class.png")
    sample_grid(*shape_grid, written[-1])
    if history is not None:
        written.append(args.out / "pretrain_losses.png")
        plot_losses(history, written[-1])
    log_to_mlflow(cfg, results, by_shape, report["meets_target"], written)


def single_object_by_shape(backend, cfg, images_per_prompt: int, seed: int, common: dict):
    """Training-sampler (ODE) accuracy on "a photo of a <shape>" for every shape of the world,
    in GenEval's wording; and (images, captions) of the first 8 samples per shape for a grid."""
    world = cfg.world
    lines = [
        m
        for m in whole_world(tuple(world.shapes), tuple(world.colors), world.max_count)
        if m["tag"] == "single_object"
    ]
    rows = [m for m in lines for _ in range(images_per_prompt)]
    images = generate(
        backend,
        [m["prompt"] for m in rows],
        seeds=[seed * 100_019 + i for i in range(len(rows))],
        num_steps=cfg.sampling.num_steps,
        **common,
    )
    accuracy = accuracy_by_shape(images, rows, lines)
    per_shape = min(8, images_per_prompt)
    shown = [i * images_per_prompt + j for i in range(len(lines)) for j in range(per_shape)]
    return accuracy, (images[shown], [rows[i]["prompt"] for i in shown])


def accuracy_by_shape(images: torch.Tensor, rows: list[dict], lines: list[dict]) -> dict:
    """{shape: share of its images judged correct} for single_object ``lines``; ``images``
    (N, 3, H, W) in [0, 1] are the samples of ``rows`` (N lines of ``lines``, repeated)."""
    verdicts = judge(images, rows)
    return {
        line["include"][0]["class"]: float(
            np.mean([v["correct"] for v in verdicts if v["prompt"] == line["prompt"]])
        )
        for line in lines
    }


def log_to_mlflow(
    cfg, results: dict, by_shape: dict, meets_target: bool, files: list[Path]
) -> None:
    configure_environment(cfg.root)
    with stage_run(cfg, "base_quality"):
        log_metrics(
            {"quality/meets_target": float(meets_target)}
            | {f"quality/single_object/{shape}": value for shape, value in by_shape.items()}
            | {
                f"quality/{sampler}/{tag}": value
                for sampler, result in results.items()
                for tag, value in [("overall", result["overall"]), *result["per_tag"].items()]
            }
        )
        for path in files:
            log_artifact(path)


if __name__ == "__main__":
    main()

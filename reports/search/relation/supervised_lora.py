"""Session 33 scratch measurement (reports/search.md, session 33 §5): is position's relation out of
reach of the policy's LoRA, or only of the reward signals? GRPO and DRaFT both left the share
of position images placed as stated where the base had it (0.55), even when trained on position
lines only. Here the same LoRA (rank 8 on the denoiser, AdamW at `update.lr`) is shown the
relation directly: the pretraining's rectified-flow loss (`pipeline.pretrain.flow_step`, its
caption dropout and timestep law) on fresh renders of the training split's position lines
(random wordings and object orders, `world.sample_metadata`). If held-out position rises, the
parameterisation can place objects as stated and the reward signals are what fail to teach it;
if not, the LoRA on this base is the limit. Session 34: `--train` widens what the loss may
change, to tell the LoRA from the text encoder (whose outputs for "X left of Y" and "X right of
Y" differ by 5 %) and from the whole denoiser; `--with-class star` trains on the lines of
every tag that name a star instead (the class most often missing, `reports/search/failures.py`).

    python reports/search/relation/supervised_lora.py --out reports/search/relation/NAME \
        [--steps 300] [--batch 64] [--probe-every 100] [--seed 0] [--lr 1e-3] \
        [--train lora|lora+text|all] [--tag position | --with-class star]

Writes `history.json` (loss per step, the held-out probe every `--probe-every` steps) and the
evaluation protocol's `eval/results.jsonl` and `eval/metrics.json`, as draft.py does. The
forward and backward of a step cost about 3 × batch denoiser evaluations (no CFG, no sampling).
"""

import argparse
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(HERE.parent / "reward"))
import numpy as np  # noqa: E402
import torch  # noqa: E402
from draft import (  # noqa: E402
    add_run_arguments,
    add_trained_argument,
    probe,
    record_step,
    start_run,
    trained_optimizer,
    write_evaluation,
)
from tqdm import tqdm  # noqa: E402

from pipeline import layout, world  # noqa: E402
from pipeline.pretrain import flow_step  # noqa: E402


def chosen(meta: dict, args) -> bool:
    """Whether a training line is one `--tag` / `--with-class` asks for."""
    if args.with_class:
        return any(clause["class"] == args.with_class for clause in meta["include"])
    return meta["tag"] == args.tag


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_run_arguments(parser)
    add_trained_argument(parser)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--probe-every", type=int, default=100)
    parser.add_argument("--tag", default="position", help="the training lines' tag")
    parser.add_argument(
        "--with-class", help="train on the lines (any tag) naming this class instead of --tag"
    )
    args = parser.parse_args()
    cfg, policy = start_run(args)
    backend = policy.backend
    lines = [m for m in layout.load_prompts(cfg, "train") if chosen(m, args)]
    test = layout.load_prompts(cfg, "test")
    rng = np.random.default_rng(args.seed)
    noise = torch.Generator().manual_seed(args.seed)
    params, optimizer = trained_optimizer(policy, cfg, args.train)
    history: dict = {"args": {k: str(v) for k, v in vars(args).items()}, "steps": [], "probes": {}}
    history["probes"]["0"] = probe(backend, cfg, test)
    start = time.perf_counter()
    for step in tqdm(range(1, args.steps + 1), desc="supervised LoRA", unit="step"):
        metas = world.sample_metadata(rng, args.batch, pool=lines)
        images = world.render_batch(metas, rng, cfg.world.image_size).float()
        backend.transformer.train()
        loss = flow_step(
            backend, optimizer, params, metas, images, noise,
            caption_dropout=cfg.base.caption_dropout, t_mean=cfg.base.t_mean,
            t_std=cfg.base.t_std, grad_clip=cfg.update.max_grad_norm,
        )  # fmt: skip
        backend.eval()
        backend.clear_cache()  # prompt encodings are stale once the text encoder has moved
        history["steps"].append(
            {"step": step, "loss": loss, "seconds": time.perf_counter() - start}
        )
        record_step(history, step, args.steps, args, backend, cfg, test)

    write_evaluation(backend, cfg, test, args.out)


if __name__ == "__main__":
    main()

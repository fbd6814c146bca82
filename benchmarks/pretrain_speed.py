"""Where the base's pretraining time goes, and what the default recipe costs at each thread count.

For each ``--threads`` value a fresh process runs ``pretrain_base`` for ``--steps`` autoencoder and
``--steps`` flow steps of the default recipe (full model size and batch, the whole world) and
reads the seconds per step of each phase from its history; the projection is
``ae_steps × ae s/step + steps × flow s/step`` of ``params.yaml``'s `base` section, against
issue 18's 30-minute budget. Then, at one thread, ``torch.profiler`` splits the flow step's
forward and backward (the model the first timed run saved: the recipe's architecture, whose
weights do not change the cost) into
convolutions, attention, matrix products and the rest.

    python benchmarks/pretrain_speed.py            # ~5 min; run it alone on the machine
    python benchmarks/pretrain_speed.py --set base.unet_channels=[32,48] --threads 2 \
        --out reports/base/<candidate>/pretrain_speed.json   # a candidate recipe
Writes reports/base/pretrain_speed.json (``--out``); ``--set`` overrides ``params.yaml`` as
``-S`` does for ``creditflow``, for the timed runs, the projection and the profile alike.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.pretrain_determinism import cpu_model  # noqa: E402
from pipeline.config import BaseParams, load_config  # noqa: E402
from pipeline.io import atomic_path  # noqa: E402

BUDGET_SECONDS = 30 * 60

TIME_PHASES = r"""
import json, sys, tempfile
import torch
torch.set_num_threads(int(sys.argv[1]))
from pipeline.config import load_config
from pipeline.pretrain import pretrain_base, pretrain_pool
cfg = load_config("params.yaml", json.loads(sys.argv[3]))
steps = int(sys.argv[2])
params = cfg.base.model_copy(update={"ae_steps": steps, "steps": steps, "refine_steps": 0})
out = tempfile.mkdtemp(prefix="pretrain_speed-")
history = pretrain_base(out, prompts=pretrain_pool(cfg), params=params,
                        image_size=cfg.world.image_size, progress=False)
print(json.dumps({"model": out, **{phase: s / steps for phase, s in history["seconds"].items()}}))
"""

# aten operators by what they compute; everything else is "other"
OP_GROUPS = {
    "convolution": ("convolution",),
    "attention": ("scaled_dot_product", "_flash_attention"),
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm"),
}


def seconds_per_step(threads: int, steps: int, overrides: list[str] = ()) -> dict:
    """Seconds per autoencoder and per flow step of the recipe (``params.yaml`` with
    ``overrides``), in a fresh process, and the directory (``model``) of the model it saved."""
    out = subprocess.run(
        [sys.executable, "-c", TIME_PHASES, str(threads), str(steps), json.dumps(list(overrides))],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(out.stdout.strip().splitlines()[-1])


def operator_shares(
    model: Path, base: BaseParams, image_size: int, repeats: int = 5
) -> dict[str, float]:
    """Share of one flow step's forward + backward self-CPU time per operator group, at one
    thread, with the `base` section's batch size and timesteps."""
    import numpy as np
    import torch
    from torch.profiler import profile

    from pipeline.models import ShapesBackend
    from pipeline.pretrain import flow_matching_loss, logit_normal_t
    from pipeline.world import render_batch, sample_metadata, whole_world

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    generator = torch.Generator().manual_seed(0)
    backend = ShapesBackend.from_pretrained(model)
    backend.transformer.train()
    backend.text_encoder.train()
    metas = sample_metadata(rng, base.batch_size, pool=list(whole_world()))
    with torch.no_grad():
        x0 = backend.encode(render_batch(metas, rng, image_size).float())
    tokens = backend.tokenize([m["prompt"] for m in metas])
    t = logit_normal_t(base.batch_size, base.t_mean, base.t_std, generator)
    noise = torch.randn(x0.shape, generator=generator)

    def step() -> None:
        flow_matching_loss(backend, x0, tokens, t, noise).backward()

    step()  # oneDNN builds its kernels on the first call
    with profile() as profiler:
        for _ in range(repeats):
            step()
    totals = dict.fromkeys([*OP_GROUPS, "other"], 0.0)
    for event in profiler.key_averages():
        group = next(
            (g for g, keys in OP_GROUPS.items() if any(k in event.key for k in keys)), "other"
        )
        totals[group] += event.self_cpu_time_total
    whole = sum(totals.values())
    return {group: round(value / whole, 3) for group, value in totals.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--steps", type=int, default=60, help="timed steps per phase")
    parser.add_argument("--out", type=Path, default=REPO / "reports/base/pretrain_speed.json")
    parser.add_argument(
        "--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
        help="override params.yaml for the recipe timed (repeatable), e.g. base.steps=2400",
    )  # fmt: skip
    args = parser.parse_args()

    cfg = load_config(REPO / "params.yaml", args.overrides)
    base = cfg.base
    rows, models = [], []
    for threads in args.threads:
        per_step = seconds_per_step(threads, args.steps, args.overrides)
        models.append(Path(per_step["model"]))
        projected = base.ae_steps * per_step["autoencoder"] + base.steps * per_step["flow"]
        rows.append(
            {
                "threads": threads,
                "autoencoder_s_per_step": round(per_step["autoencoder"], 4),
                "flow_s_per_step": round(per_step["flow"], 4),
                "projected_minutes": round(projected / 60, 1),
                "within_budget": projected <= BUDGET_SECONDS,
            }
        )
        print(rows[-1], flush=True)
    result = {
        "recipe": {"ae_steps": base.ae_steps, "steps": base.steps, "batch_size": base.batch_size},
        "overrides": args.overrides,
        "timed_steps": args.steps,
        "budget_minutes": BUDGET_SECONDS / 60,
        "machine": cpu_model(),
        "by_threads": rows,
        "flow_step_operator_shares": operator_shares(models[0], base, cfg.world.image_size),
        "command": "python benchmarks/pretrain_speed.py " + " ".join(sys.argv[1:]),
    }
    for model in models:  # the timed runs' own temporary directories
        shutil.rmtree(model, ignore_errors=True)
    print(result["flow_step_operator_shares"])
    with atomic_path(args.out) as tmp:
        tmp.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

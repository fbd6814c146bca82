"""At which noise level does a base lose a shape? SDEdit on renders, per shape class.

For each model: 64 renders of "a photo of a <shape>" per shape of the world are encoded, noised
to sigma_k of the 20-step shift-3 schedule (x = (1 - sigma) x0 + sigma eps, one eps per image,
seed 0), completed to sigma = 0 by the ODE with the model's guided velocity (guidance 4.5,
as evaluated) and judged by the ShapesWorld detector. A class that survives from high sigma is
drawn from the layout on; one lost from low sigma is redrawn wrong by the denoiser's late,
detail-refining steps.

    python reports/base/t_std/sdedit.py --threads 2 data/base/model /tmp/b2/base-s0-t2
Writes sdedit.json next to this file.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
from benchmarks.base_quality import accuracy_by_shape  # noqa: E402
from pipeline import sampling  # noqa: E402
from pipeline.models import ShapesBackend  # noqa: E402
from pipeline.world import render_batch, whole_world  # noqa: E402

IMAGES = 64
START_INDICES = (2, 4, 6, 8, 10, 12)  # of the 20-step schedule: sigma 0.96 .. 0.64
GUIDANCE = 4.5


def survival(backend: ShapesBackend, rows: list[dict], lines: list[dict]) -> dict:
    """{sigma: {shape: share of SDEdit completions from sigma judged correct}}."""
    sigmas = sampling.timesteps_sigmas(20, shift=3.0)
    renders = render_batch(rows, np.random.default_rng(0), 32).float()
    result = {}
    with torch.no_grad():
        x0 = backend.encode(renders)  # (N, C, h, w)
        eps = torch.randn(x0.shape, generator=torch.Generator().manual_seed(0))
        embeds = backend.encode_prompts([m["prompt"] for m in rows])

        def velocity(x, sigma, index):
            return backend.velocity(x, sigma, embeds[index], guidance=GUIDANCE)

        for k in START_INDICES:
            sigma = float(sigmas[k])
            start = torch.full((len(rows),), k, dtype=torch.long)
            final = sampling.ode_complete(velocity, (1 - sigma) * x0 + sigma * eps, start, sigmas)
            accuracy = accuracy_by_shape(backend.decode(final).clamp(0, 1), rows, lines)
            result[f"{sigma:.3f}"] = {shape: round(a, 3) for shape, a in accuracy.items()}
            print(sigma, result[f"{sigma:.3f}"], flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    lines = [m for m in whole_world() if m["tag"] == "single_object"]
    rows = [m for m in lines for _ in range(IMAGES)]
    result = {
        model: survival(ShapesBackend.from_pretrained(model), rows, lines) for model in args.models
    }
    result["command"] = "python reports/base/t_std/sdedit.py " + " ".join(sys.argv[1:])
    out = Path(__file__).with_name("sdedit.json")
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

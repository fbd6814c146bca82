"""Is a base's weak shape class the autoencoder's, the sampler's or the denoiser's?

For each model: "a photo of a <shape>" per shape of the world, 64 images each, judged by the
ShapesWorld detector (i) on renders passed through the model's autoencoder (encode -> decode),
(ii) on ODE samples (the evaluation's fixed seeds) at 10, 20 and 40 steps with guidance 4.5,
and at 10 steps with guidance 2.5 and 7.

    python reports/base/two-threads/square_diagnosis.py data/base/model /tmp/b2/base-s0-t2
Writes square_diagnosis.json next to this file.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
from benchmarks.base_quality import accuracy_by_shape  # noqa: E402
from pipeline.evaluation import generate  # noqa: E402
from pipeline.models import ShapesBackend  # noqa: E402
from pipeline.world import render_batch, whole_world  # noqa: E402

IMAGES = 64
SAMPLERS = [(10, 4.5), (20, 4.5), (40, 4.5), (10, 2.5), (10, 7.0)]  # (ODE steps, guidance)


def per_shape(images: torch.Tensor, rows: list[dict], lines: list[dict]) -> dict[str, float]:
    return {shape: round(a, 3) for shape, a in accuracy_by_shape(images, rows, lines).items()}


def main() -> None:
    torch.set_num_threads(2)
    lines = [m for m in whole_world() if m["tag"] == "single_object"]
    rows = [m for m in lines for _ in range(IMAGES)]
    seeds = [1234 * 100_019 + i for i in range(len(rows))]  # base_quality.py's default seed
    result = {}
    for model in sys.argv[1:]:
        backend = ShapesBackend.from_pretrained(model)
        renders = render_batch(rows, np.random.default_rng(0), 32).float()
        with torch.no_grad():
            roundtrip = backend.decode(backend.encode(renders)).clamp(0, 1)
        entry = {"autoencoder_roundtrip": per_shape(roundtrip, rows, lines), "ode": []}
        for steps, guidance in SAMPLERS:
            images = generate(
                backend, [m["prompt"] for m in rows], seeds=seeds, num_steps=steps,
                shift=3.0, guidance=guidance, batch_size=128,
            )  # fmt: skip
            accuracy = per_shape(images, rows, lines)
            entry["ode"].append({"steps": steps, "guidance": guidance, "accuracy": accuracy})
            print(model, steps, guidance, accuracy, flush=True)
        result[model] = entry
    result["command"] = "python reports/base/two-threads/square_diagnosis.py " + " ".join(
        sys.argv[1:]
    )
    out = Path(__file__).with_name("square_diagnosis.json")
    out.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()

"""Is pretraining the base reproducible bit for bit? The same short pretraining (full model
size, whole world, 10 autoencoder + 20 flow steps) runs twice per torch thread count, each in a
fresh process; the saved weights are hashed. Writes reports/base/determinism.json.

    python benchmarks/pretrain_determinism.py
"""

from __future__ import annotations

import json
import platform
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pipeline.config import BaseParams  # noqa: E402

RUN = r"""
import glob, hashlib, sys, tempfile
import torch
torch.set_num_threads(int(sys.argv[1]))
from safetensors.torch import load_file
from pipeline.config import BaseParams
from pipeline.pretrain import pretrain_base
from pipeline.world import whole_world
out = tempfile.mkdtemp()
history = pretrain_base(out, prompts=list(whole_world()),
                        params=BaseParams(steps=20, ae_steps=10, warmup=5, refine_steps=0),
                        progress=False)
digest = hashlib.sha256()
for path in sorted(glob.glob(out + "/**/*.safetensors", recursive=True)):
    for key, value in sorted(load_file(path).items()):
        digest.update(key.encode())
        digest.update(value.numpy().tobytes())
print(digest.hexdigest()[:16], history["flow_loss"][-1])
"""


def main() -> None:
    runs = []
    for threads in (2, 2, 1, 1):
        out = subprocess.run(
            [sys.executable, "-c", RUN, str(threads)], cwd=REPO, capture_output=True, text=True
        )
        digest, loss = out.stdout.split()
        runs.append({"threads": threads, "weights_sha256_16": digest, "last_loss": float(loss)})
        print(runs[-1])
    same_threads = all(
        len({r["weights_sha256_16"] for r in runs if r["threads"] == t}) == 1 for t in (1, 2)
    )
    report = {
        "what": "pretrain_base, full model size, whole world, 10 AE + 20 flow steps, fresh "
        "process per run (benchmarks/pretrain_determinism.py)",
        "denoiser": BaseParams().denoiser,
        "machine": cpu_model(),
        "runs": runs,
        "bit_identical_for_same_threads": same_threads,
    }
    path = REPO / "reports/base/determinism.json"
    path.write_text(json.dumps(report, indent=2) + "\n")


def cpu_model() -> str:
    """The CPU's model name and core count (Linux), else the platform's machine type."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine()
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return f"{names[0]}, {len(names)} cores" if names else platform.machine()


if __name__ == "__main__":
    main()

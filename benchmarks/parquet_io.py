"""Parquet trajectory cache throughput: write and read MB/s of one realistic round.

Default round: N = 64 trajectories, T = 10 steps, fp32 3x32x32 states (the ShapesWorld size).
States follow the flow-matching path x_sigma = (1 - sigma) * x0 + sigma * eps from blocky images,
so zstd sees data about as compressible as real rollouts (noise dominates early states).

    python benchmarks/parquet_io.py [--trajectories 64 --steps 10 --size 32 --repeats 5]

Writes reports/parquet_io.json. MB = 10**6 bytes. Throughputs are over uncompressed Arrow bytes:
``write``: write_rollout (tables, zstd, fsync, sha256, manifests), over the Arrow bytes of the
steps and finals tables; ``read_rollout``: the full round back as tensors, over the bytes of
the tensors returned; ``read_scoring``: only trajectory, step, sigma, x via open_dataset, as the
score stage reads, over those columns' bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import pyarrow as pa
import torch

from pipeline.trajectories import (
    FINALS,
    STEPS,
    RoundRollout,
    open_dataset,
    read_rollout,
    round_dir,
    sha256_file,
    write_rollout,
)

REPORT = Path(__file__).resolve().parents[1] / "reports" / "parquet_io.json"
SCORING_COLUMNS = ["trajectory", "step", "sigma", "x"]


def synthetic_rollout(n: int, t: int, size: int, seed: int = 0) -> RoundRollout:
    """A round shaped like the sampler's output; states on the straight path from noise to x0."""
    g = torch.Generator().manual_seed(seed)
    blocks = torch.rand(n, 3, 4, 4, generator=g) * 2 - 1  # 4x4 colour blocks in [-1, 1]
    x0 = torch.nn.functional.interpolate(blocks, size=(size, size), mode="nearest")  # (N, 3, S, S)
    eps = torch.randn(n, 3, size, size, generator=g)
    sigmas = torch.linspace(1, 0, t + 1)
    s = sigmas.view(1, t + 1, 1, 1, 1)
    states = (1 - s) * x0[:, None] + s * eps[:, None]  # (N, T+1, 3, S, S)
    means = states[:, 1:] + 0.01 * torch.randn(n, t, 3, size, size, generator=g)  # (N, T, ...)
    window = torch.ones(t, dtype=torch.bool)
    window[-1] = False
    return RoundRollout(
        run_id="bench",
        round=0,
        method="stepwise",
        sampler="stepwise",
        eta=0.7,
        model_version="base",
        states=states,
        means=means,
        stds=torch.rand(n, t, generator=g),
        log_probs=torch.randn(n, t, generator=g),
        sigmas=sigmas,
        window=window,
        images=(x0 + 1) / 2,
        prompt_ids=[f"p{i // 8}" for i in range(n)],
        prompts=[f"a photo of {i // 8} red circles" for i in range(n)],
        tags=["counting"] * n,
        group_ids=torch.arange(n) // 8,
        sample_idx=torch.arange(n) % 8,
        seeds=torch.arange(n),
    )


def _timed(fn) -> tuple[float, object]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def _tensor_bytes(rollout: RoundRollout) -> int:
    tensors = [rollout.states, rollout.means, rollout.stds, rollout.log_probs, rollout.images]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def _round_bytes(root: Path) -> dict[str, int]:
    """Uncompressed Arrow bytes and on-disk bytes of round 0 (steps + finals)."""
    tables = [open_dataset(root, name).to_table() for name in (STEPS, FINALS)]
    files = [p for name in (STEPS, FINALS) for p in round_dir(root, name, 0).glob("*.parquet")]
    scoring = open_dataset(root).to_table(columns=SCORING_COLUMNS)
    return {
        "arrow": sum(table.nbytes for table in tables),
        "disk": sum(p.stat().st_size for p in files),
        "scoring": scoring.nbytes,
        "files": len(files),
    }


def run(n: int, t: int, size: int, repeats: int) -> dict:
    rollout = synthetic_rollout(n, t, size)
    writes, full_reads, scoring_reads, verifies = [], [], [], []
    workdir = Path(tempfile.mkdtemp(prefix="parquet_io-"))
    try:
        for repeat in range(repeats):
            root = workdir / f"run{repeat}"
            writes.append(_timed(lambda root=root: write_rollout(root, rollout))[0])
            seconds, back = _timed(lambda root=root: read_rollout(root, 0))
            full_reads.append(seconds)
            assert torch.equal(back.states, rollout.states)
            scoring_reads.append(
                _timed(lambda root=root: open_dataset(root).to_table(columns=SCORING_COLUMNS))[0]
            )
            files = [
                p for name in (STEPS, FINALS) for p in round_dir(root, name, 0).glob("*.parquet")
            ]
            verifies.append(_timed(lambda files=files: [sha256_file(p) for p in files])[0])
        sizes = _round_bytes(workdir / "run0")
    finally:
        shutil.rmtree(workdir)

    mb = lambda count: count / 1e6  # noqa: E731
    write_s, read_s, scoring_s, verify_s = map(
        statistics.median, (writes, full_reads, scoring_reads, verifies)
    )
    return {
        "config": {"trajectories": n, "steps": t, "state_shape": [3, size, size], "dtype": "fp32"},
        "environment": {
            "pyarrow": pa.__version__,
            "torch": torch.__version__,
            "cpus": os.cpu_count(),
            "machine": platform.machine(),
            "load_average_1min": round(os.getloadavg()[0], 2),  # a shared machine reads slower
        },
        "repeats": repeats,
        "files_per_round": sizes["files"],
        "arrow_mb": round(mb(sizes["arrow"]), 2),
        "rollout_tensor_mb": round(mb(_tensor_bytes(rollout)), 2),
        "disk_mb": round(mb(sizes["disk"]), 2),
        "compression_ratio": round(sizes["arrow"] / sizes["disk"], 3),
        "write_s": round(write_s, 4),
        "write_mb_s": round(mb(sizes["arrow"]) / write_s, 1),
        "read_rollout_s": round(read_s, 4),
        "read_rollout_mb_s": round(mb(_tensor_bytes(rollout)) / read_s, 1),
        "read_scoring_columns_s": round(scoring_s, 4),
        "read_scoring_columns_mb_s": round(mb(sizes["scoring"]) / scoring_s, 1),
        "verify_sha256_s": round(verify_s, 4),
        "verify_share_of_read_rollout": round(verify_s / read_s, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trajectories", type=int, default=64)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--size", type=int, default=32, help="state height = width")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=REPORT)
    args = parser.parse_args()
    result = run(args.trajectories, args.steps, args.size, args.repeats)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()

"""CUDA smoke test of the SD3 backend: `make cuda-smoke` (or `python scripts/cuda_smoke.py`).

On a machine with CUDA it builds tiny random SD3 and CLIP components (pipeline/sd3_tiny.py) in a
temporary directory and
1. checks that the backend's fp32 ODE rollout on the GPU equals diffusers'
   StableDiffusion3Pipeline(..., output_type="latent") for the same latents;
2. runs one `stepwise` GRPO round (rollout -> score with clipscore and its step-wise estimates ->
   advantages -> update) with bf16 weights on the GPU, and checks that it is finite, trains
   only the fp32 LoRA weights, and starts on-policy.
It prints a JSON summary and exits 1 on a failed check. Without CUDA it prints why it skipped
and exits 0.
"""

from __future__ import annotations

import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the package, whatever the cwd

ODE_TOLERANCE = 1e-3  # fp32 on GPU: cuDNN may use TF32 convolutions in the patch embedding
RATIO_TOLERANCE = 0.05  # bf16: rollout and update batch rows differently


def ode_matches_pipeline(sd3_dir: Path) -> float:
    """Max |latents_backend - latents_pipeline| of a 4-step guided ODE rollout, fp32 on CUDA."""
    from diffusers import StableDiffusion3Pipeline

    from pipeline import sampling
    from pipeline.sd3 import SD3Backend
    from pipeline.sd3_tiny import RESOLUTION, SHIFT, T5_MAX_LENGTH

    backend = SD3Backend.from_pretrained(
        sd3_dir, device="cuda", resolution=RESOLUTION, max_sequence_length=T5_MAX_LENGTH
    )
    prompts = ["a red dog", "two blue cats"]
    x_T = torch.randn((2, *backend.latent_shape), generator=torch.Generator().manual_seed(0))
    embeds = backend.encode_prompts(prompts)
    ours = sampling.sample(
        lambda x, sigma: backend.velocity(x, sigma, embeds, guidance=4.5),
        x_T,
        sampling.timesteps_sigmas(4, shift=SHIFT),
        kind="ode",
        eta=0.0,
        window=sampling.sde_window(4, kind="ode"),
    ).final
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_dir, local_files_only=True).to("cuda")
    pipe.set_progress_bar_config(disable=True)
    reference = pipe(
        prompt=prompts,
        num_inference_steps=4,
        guidance_scale=4.5,
        latents=x_T.cuda(),
        height=RESOLUTION,
        width=RESOLUTION,
        max_sequence_length=T5_MAX_LENGTH,
        output_type="latent",
    ).images
    return float((ours - reference.cpu()).abs().max())


def grpo_round(root: Path, sd3_dir: Path, clip_dir: Path) -> dict[str, float]:
    """One stepwise round with bf16 weights on CUDA; returns its checks and metrics."""
    from pipeline.config import load_config
    from pipeline.policy import Policy, load_backend
    from pipeline.rewards import RewardMix
    from pipeline.rounds import (
        CountingVelocity,
        Schedule,
        assign_credit,
        rollout_round,
        score_round,
        update_round,
    )
    from pipeline.sd3_tiny import tiny_round_overrides

    shutil.copy(REPO / "params.yaml", root / "params.yaml")
    cfg = load_config(
        root / "params.yaml",
        [
            *tiny_round_overrides(sd3_dir, clip_dir),
            "model.device=cuda",
            "model.dtype=bfloat16",
            "train.method=stepwise",
            "rollout.group_size=4",
            "update.minibatch_size=8",
            "score.estimator=tweedie",
        ],
    )
    backend = load_backend(cfg)
    policy = Policy.create(cfg, backend)
    frozen = {k: v.clone() for k, v in backend.transformer.state_dict().items() if "lora_" not in k}
    prompts = [
        {"prompt": p, "tag": "single_object", "include": [{"class": "dog", "count": 1}]}
        for p in ("a red dog", "a dog on a bench")
    ]
    schedule = Schedule.from_config(cfg)
    counter = CountingVelocity(backend, schedule.guidance)
    seeds = {"seed": 0, "round_index": 0}
    start = time.perf_counter()
    rollout = rollout_round(
        backend, prompts, [0, 1], schedule, cfg, method="stepwise", run_id="smoke",
        model_version="base", counter=counter, **seeds,
    )  # fmt: skip
    metadata = [prompts[i] for i in (0, 1) for _ in range(cfg.rollout.group_size)]
    scores = score_round(
        backend, rollout, metadata, RewardMix(cfg, cfg.score.rewards), cfg,
        estimators=("tweedie",), schedule=schedule, counter=counter,
    )  # fmt: skip
    credit = assign_credit("stepwise", scores.table, rollout.group_ids, schedule, cfg)
    metrics = update_round(
        backend, policy.optimizer, rollout, credit.advantages, schedule, cfg, **seeds
    )
    torch.cuda.synchronize()
    after = backend.transformer.state_dict()
    lora = [p for n, p in backend.transformer.named_parameters() if "lora_" in n]
    return {
        "round_s": time.perf_counter() - start,
        "states_finite": float(torch.isfinite(rollout.states).all()),
        "advantages_finite": float(torch.isfinite(credit.advantages).all()),
        "metrics_finite": float(all(v == v and abs(v) != float("inf") for v in metrics.values())),
        "base_unchanged": float(all(torch.equal(after[k], v) for k, v in frozen.items())),
        "lora_fp32_on_cuda": float(
            all(p.dtype == torch.float32 and p.is_cuda for p in lora) and bool(lora)
        ),
        "ratio_dev_first": metrics["train/ratio_dev_first"],
        "nfe": float(counter.nfe),
        "peak_memory_mb": torch.cuda.max_memory_allocated() / 2**20,
    }


def main() -> int:
    if not torch.cuda.is_available():
        print("cuda-smoke: skipped, no CUDA device on this machine")
        return 0
    from pipeline.sd3_tiny import write_tiny_clip, write_tiny_sd3

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        sd3_dir = write_tiny_sd3(root)
        clip_dir = write_tiny_clip(root / "clip")
        summary = {"device": torch.cuda.get_device_name()}
        summary["ode_max_abs_diff"] = ode_matches_pipeline(sd3_dir)
        summary |= grpo_round(root, sd3_dir, clip_dir)
    print(json.dumps(summary, indent=2))
    flags = ("states_finite", "advantages_finite", "metrics_finite", "base_unchanged")
    failed = [key for key in (*flags, "lora_fp32_on_cuda") if summary[key] != 1.0]
    if summary["ode_max_abs_diff"] > ODE_TOLERANCE:
        failed.append("ode_max_abs_diff")
    if summary["ratio_dev_first"] > RATIO_TOLERANCE:
        failed.append("ratio_dev_first")
    if failed:
        print(f"cuda-smoke: FAILED {', '.join(failed)}")
        return 1
    print("cuda-smoke: ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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

`--processes N` (`make cuda-smoke-multi`) checks the multi-GPU path instead: two rounds of
`creditflow train` on the tiny SD3 in a temporary project, once in one process and once under
`accelerate launch` with N processes over nccl (one GPU each), must give the same LoRA weights
and per-round metrics, with a prompt group split between ranks. It skips (exit 0) with fewer
than N GPUs; `--device cpu` runs the same comparison over gloo, to check the harness on CPU.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # the package, whatever the cwd

ODE_TOLERANCE = 1e-3  # fp32 on GPU: cuDNN may use TF32 convolutions in the patch embedding
RATIO_TOLERANCE = 0.05  # bf16: rollout and update batch rows differently
# fp32 with N ranks summing the same gradients in another order (CPU: 5e-5 seen); on the GPU
# cuDNN may also use TF32 convolutions, as for ODE_TOLERANCE
MULTI_TOLERANCE = {"cpu": 1e-4, "cuda": 1e-3}
TRAIN = ("train", "--method", "stepwise", "--seed", "0")
RUN_DIR = Path("data/train/stepwise-s0")


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


def _creditflow(project: Path, processes: int, *args: str) -> float:
    """`creditflow ARGS` in `project`, in one process or under `accelerate launch`; seconds."""
    from pipeline.distributed import module_command

    command, env = module_command(processes, "stages.cli", *args)
    env |= {"PYTHONPATH": str(REPO), "CREDITFLOW_ORCHESTRATION": "inline"}
    start = time.perf_counter()
    done = subprocess.run(command, cwd=project, env=env, text=True, capture_output=True)
    if done.returncode != 0:
        raise RuntimeError(f"{processes}-process {args[0]} failed:\n{done.stderr[-3000:]}")
    return time.perf_counter() - start


def multi_process_train(root: Path, processes: int, device: str) -> dict[str, float | str]:
    """Two tiny-SD3 rounds trained by one process and by `processes` ranks; their differences."""
    import yaml
    from safetensors.torch import load_file

    from pipeline.config import apply_overrides
    from pipeline.sd3_tiny import tiny_round_overrides, write_tiny_clip, write_tiny_sd3

    sd3_dir, clip_dir = write_tiny_sd3(root), write_tiny_clip(root / "clip")
    # 12 trajectories a round, so over 2 ranks a prompt group is split; a dense reward, since
    # the tiny CLIP's near-equal scores make the advantages amplify float noise
    overrides = [
        *tiny_round_overrides(sd3_dir, clip_dir),
        f"model.device={device}",
        "prompts.n_train=60",
        "prompts.n_test=12",
        "train.rounds=2",
        "train.eval_every=0",
        "rollout.prompts_per_round=3",
        "rollout.group_size=4",
        "update.minibatch_size=5",
        "score.estimator=tweedie",
        "score.rewards={brightness: 1.0}",
    ]
    params = apply_overrides(yaml.safe_load((REPO / "params.yaml").read_text()), overrides)
    summary: dict[str, float | str] = {}
    runs = {}
    for n in (1, processes):
        project = root / f"project-{n}"
        project.mkdir()
        (project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        _creditflow(project, 1, "prompts")
        summary[f"train_s_{n}"] = _creditflow(project, n, *TRAIN)
        runs[n] = project
    rounds = [json.loads((runs[n] / "reports/train/stepwise-s0/rounds.json").read_text())
              for n in (1, processes)]  # fmt: skip
    gaps = {  # relative to max(1, |value|), as pytest.approx's rel and abs
        f"{key} (round {one['round']})": abs(float(two[key]) - float(value))
        / max(1.0, abs(float(value)))
        for one, two in zip(*rounds, strict=True)
        for key, value in one.items()
        if isinstance(value, int | float) and not key.startswith(("perf/", "time/"))
    }
    summary["worst_metric"] = max(gaps, key=gaps.get)
    summary["metric_max_rel_diff"] = gaps[summary["worst_metric"]]
    lora = [load_file(runs[n] / RUN_DIR / "checkpoints/round-0001/lora.safetensors")
            for n in (1, processes)]  # fmt: skip
    summary["lora_max_abs_diff"] = max(
        float((lora[1][name] - weight).abs().max()) for name, weight in lora[0].items()
    )
    summary["rounds"] = float(len(rounds[1]))
    return summary


def multi_gpu_main(processes: int, device: str) -> int:
    if device == "cuda" and torch.cuda.device_count() < processes:
        print(f"cuda-smoke: skipped, {processes} processes need {processes} GPUs, "
              f"this machine has {torch.cuda.device_count()}")  # fmt: skip
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        summary = multi_process_train(Path(tmp), processes, device)
    print(json.dumps(summary, indent=2))
    failed = [key for key in ("lora_max_abs_diff", "metric_max_rel_diff")
              if not summary[key] <= MULTI_TOLERANCE[device]]  # fmt: skip
    if summary["rounds"] != 2:
        failed.append("rounds")
    if failed:
        print(f"cuda-smoke: FAILED {', '.join(failed)}")
        return 1
    print(f"cuda-smoke: ok, {processes} processes train what one does")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--processes", type=int, default=1, help="> 1: the multi-GPU check")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    args = parser.parse_args()
    if args.processes > 1:
        return multi_gpu_main(args.processes, args.device)
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

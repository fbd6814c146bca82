"""Issue 19 on a lent GPU: does GRPO learn on ShapesWorld when rounds and optimizer steps are
far more than the 2-core CPU affords?

One training run in memory with the library's round functions (`pipeline.rounds`: rollout ->
score -> credit -> update), no Parquet cache, Prefect or MLflow (the GPU machine has neither),
on the committed base (`data/base/model`) with `params.yaml` plus `--set` overrides. The
ShapesWorld backend has no device of its own, so `DeviceShapes` runs its networks on `--device`
and hands CPU tensors back, as the SD3 backend does. Every `--probe-every` rounds (and at round 0)
the run's held-out probe (`geneval_protocol`, `--probe-images` fixed-seed images per test prompt)
is written to `--out` as it goes, so a run stopped at its deadline keeps what it measured; the
last policy also gets the full evaluation protocol (`evaluate.images_per_prompt`).

    python reports/search/gpu/big_rounds.py --out OUT --deadline-s 420 \
        --set rollout.prompts_per_round=96 rollout.group_size=16 update.minibatch_size=4608
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from pipeline import layout, rounds  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.evaluation import geneval_protocol  # noqa: E402
from pipeline.models import PromptEmbeds, ShapesBackend  # noqa: E402
from pipeline.policy import Policy  # noqa: E402
from pipeline.rewards import RewardMix  # noqa: E402


class DeviceShapes(ShapesBackend):
    """ShapesBackend whose networks live on `device`; every method takes and returns CPU tensors."""

    def to(self, device: str) -> DeviceShapes:
        self.device = torch.device(device)
        for module in self.modules.values():
            module.to(self.device)
        return self

    def embed_tokens(self, input_ids: torch.Tensor) -> PromptEmbeds:
        embeds = super().embed_tokens(input_ids.to(self.device))
        return PromptEmbeds(embeds.hidden.cpu(), embeds.pooled.cpu())

    def _forward(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeds) -> torch.Tensor:
        on_device = PromptEmbeds(embeds.hidden.to(self.device), embeds.pooled.to(self.device))
        return super()._forward(x.to(self.device), sigma.to(self.device), on_device).cpu()

    def decode(self, x: torch.Tensor) -> torch.Tensor:
        return super().decode(x.to(self.device)).cpu()


def probe(backend, test, cfg, images: int) -> dict:
    with torch.no_grad():
        _, _, summary = geneval_protocol(backend, test, cfg, images_per_prompt=images, desc="probe")
    return {"overall": summary["overall"], **summary["per_tag"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--deadline-s", type=float, default=420.0, help="no round starts after")
    parser.add_argument("--probe-every", type=int, default=5)
    parser.add_argument("--probe-images", type=int, default=2)
    parser.add_argument("--set", nargs="*", default=[], help="params overrides KEY=VALUE")
    args = parser.parse_args()
    start = time.perf_counter()
    cfg = load_config(REPO / "params.yaml", args.set)
    backend = DeviceShapes.from_pretrained(cfg.path(cfg.model.path)).to(args.device)
    policy = Policy.create(cfg, backend)
    train, test = layout.load_prompts(cfg, "train"), layout.load_prompts(cfg, "test")
    schedule = rounds.Schedule.from_config(cfg)
    method, seed = cfg.train.method, cfg.train.seed
    rewards = RewardMix(cfg, cfg.score.rewards)
    base_probe = probe(backend, test, cfg, args.probe_images)
    result = {"command": " ".join(sys.argv), "overrides": args.set, "device": args.device,
              "rounds": [], "probes": {"0": base_probe}}  # fmt: skip
    args.out.mkdir(parents=True, exist_ok=True)

    def save() -> None:  # after every round: a run cut at its deadline keeps what it measured
        (args.out / "result.json").write_text(json.dumps(result, indent=1) + "\n")

    nfe = 0.0
    r = 0
    while time.perf_counter() - start < args.deadline_s and r < cfg.train.rounds:
        t0 = time.perf_counter()
        counter = rounds.CountingVelocity(backend, cfg.sampling.guidance)
        chosen = rounds.select_prompts(
            train, cfg.rollout.prompts_per_round, seed=seed, round_index=r
        )
        rollout = rounds.rollout_round(
            backend, train, chosen, schedule, cfg, method=method, seed=seed, round_index=r,
            run_id="gpu", model_version=f"gpu@{r}", counter=counter,
        )  # fmt: skip
        scores = rounds.score_round(
            backend, rollout, layout.trajectory_metadata(cfg, rollout), rewards, cfg,
            estimators=rounds.estimators_for(method, cfg), schedule=schedule, counter=counter,
        )  # fmt: skip
        credit = rounds.assign_credit(method, scores.table, rollout.group_ids, schedule, cfg)
        metrics = rounds.update_round(
            backend, policy.optimizer, rollout, credit.advantages, schedule, cfg,
            seed=seed, round_index=r,
        )  # fmt: skip
        final = scores.table[(scores.table.estimator == "final") & (scores.table.reward == "mix")]
        nfe += counter.nfe + metrics["cost/update_nfe"]
        r += 1
        result["rounds"].append(
            {
                "round": r,
                "reward": float(final.value.mean()),
                "nfe": nfe,
                "seconds": time.perf_counter() - t0,
                "kl": metrics.get("train/kl"),
            }  # fmt: skip
        )
        if r % args.probe_every == 0:
            result["probes"][str(r)] = probe(backend, test, cfg, args.probe_images)
            print(r, result["rounds"][-1], result["probes"][str(r)]["overall"], flush=True)
        save()
    result["final_protocol"] = probe(backend, test, cfg, cfg.evaluate.images_per_prompt)
    result["seconds"] = time.perf_counter() - start
    save()
    print(json.dumps({k: result[k] for k in ("final_protocol", "seconds")}), flush=True)


if __name__ == "__main__":
    main()

"""One rank of the multi-process tests (tests/test_distributed.py), run under `accelerate launch`
or alone as the one-process reference: the GRPO update and the credit of a saved round, each
rank on its shard of the trajectories.

    python -m tests.distributed_worker ROUND.pt PARAMS.yaml OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd
import torch

from pipeline import distributed, rounds
from pipeline.config import load_config
from pipeline.grpo import UpdateBatch, grpo_update, lora_state_dict
from pipeline.policy import Policy


def main(saved: Path, params: Path, out: Path) -> None:
    ranks = distributed.current()
    cfg = load_config(params)
    round_ = torch.load(saved, weights_only=False)
    n = round_["advantages"].shape[0]
    rows = distributed.shard(n, ranks)
    # credit: each rank holds the score rows of its trajectories, the groups need them all
    table = round_["table"]
    held = table[(table.trajectory >= rows.start) & (table.trajectory < rows.stop)]
    gathered = distributed.gather_objects(held, ranks)
    schedule = rounds.Schedule.from_config(cfg)
    credit = rounds.assign_credit(
        round_["method"], pd.concat(gathered), round_["group_ids"], schedule, cfg
    )
    policy = Policy.create(cfg)
    batch = UpdateBatch(
        states=round_["states"][rows],
        log_probs=round_["log_probs"][rows],
        sigmas=round_["sigmas"],
        steps=schedule.steps,
        advantages=credit.advantages[rows],
        embeds=policy.backend.encode_prompts(round_["prompts"][rows]),
        first_trajectory=rows.start,
        round_trajectories=n,
    )
    metrics = grpo_update(
        policy.backend,
        policy.optimizer,
        batch,
        rounds.update_settings(cfg, schedule),
        generator=rounds.generator(0, 0, "update"),
        ranks=ranks,
    )
    out.mkdir(parents=True, exist_ok=True)
    torch.save(
        {
            "lora": lora_state_dict(policy.backend.transformer),
            "metrics": metrics,
            "advantages": credit.advantages,
            "rows": (rows.start, rows.stop),
        },
        out / f"rank{ranks.index}.pt",
    )


if __name__ == "__main__":
    main(*map(Path, sys.argv[1:4]))

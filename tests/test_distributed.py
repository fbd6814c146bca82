"""Several processes, one round (pipeline.distributed): sharding, the noise of a sharded rollout,
and — launched as 2 CPU processes over gloo by `accelerate launch` — group statistics and the
GRPO update across ranks against one process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from pipeline import distributed, sampling
from pipeline.config import apply_overrides, load_config

WORKER = "tests.distributed_worker"  # run as a module from the repo root: this checkout's code
REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize(("n", "count"), [(12, 2), (7, 3), (2, 4)])
def test_shards_cover_every_row_once_in_rank_order(n, count):
    shards = [distributed.shard(n, distributed.Ranks(i, count)) for i in range(count)]
    rows = [r for s in shards for r in range(n)[s]]
    assert rows == list(range(n))
    sizes = [len(range(n)[s]) for s in shards]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


def test_one_process_is_single_and_never_starts_torch_distributed(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    ranks = distributed.current()
    assert ranks == distributed.SINGLE and ranks.is_main and not ranks.distributed
    values = torch.tensor([1.0, 2.0])
    assert distributed.all_reduce(values, ranks) is values and values.tolist() == [1.0, 2.0]
    assert distributed.gather_objects("x", ranks) == ["x"]
    assert not torch.distributed.is_initialized()


@pytest.mark.parametrize("kind", ["flow_grpo", "stepwise"])
def test_sharded_rollout_draws_the_noise_one_process_draws(kind):
    """Each shard of a rollout (`noise_rows`) samples exactly the rows one process samples."""
    x_T = torch.randn(6, 2, 3, 3, generator=torch.Generator().manual_seed(1))
    sigmas = sampling.timesteps_sigmas(4, shift=1.0)
    window = torch.tensor([False, True, True, False])

    def velocity(x, sigma):  # row-wise, so batch composition cannot change a row's value
        return 0.5 * x - sigma.view(-1, 1, 1, 1)

    def run(x, rows=None):
        return sampling.sample(
            velocity, x, sigmas, kind=kind, eta=0.7, window=window,
            generator=torch.Generator().manual_seed(5), noise_rows=rows,
        )  # fmt: skip

    whole = run(x_T)
    for part in (slice(0, 4), slice(4, 6)):
        shard = run(x_T[part], (6, part))
        assert torch.equal(shard.states, whole.states[part])
        assert torch.equal(shard.log_probs.nan_to_num(), whole.log_probs[part].nan_to_num())
    with pytest.raises(ValueError, match="noise_rows"):
        run(x_T[:3], (6, slice(0, 4)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(processes: int, *args: Path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["OMP_NUM_THREADS"] = "1"
    if processes == 1:
        command = [sys.executable, "-m", WORKER]
    else:
        command = [
            sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu",
            "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", str(_free_port()), "--module", WORKER,
        ]  # fmt: skip
    return subprocess.run(
        [*command, *map(str, args)], env=env, capture_output=True, text=True, timeout=300,
        cwd=REPO,
    )  # fmt: skip


def _with_overrides(project: Path, *overrides: str) -> Path:
    """Rewrite `project`'s params.yaml for 12 trajectories a round (3 prompts x 4, so a group
    is split over 2 ranks), a dense reward and odd minibatches, plus `overrides`."""
    params = project / "params.yaml"
    sharded = [
        "rollout.prompts_per_round=3", "rollout.group_size=4", "update.minibatch_size=5",
        "update.lr=0.01", "score.rewards={brightness: 1.0}",
    ]  # fmt: skip
    tree = apply_overrides(yaml.safe_load(params.read_text()), [*sharded, *overrides])
    params.write_text(yaml.safe_dump(tree, sort_keys=False))
    return params


def test_multiprocess_update_and_group_credit_equal_one_process(tiny_project, tmp_path):
    """2 gloo processes, a prompt group split between them (12 trajectories of 3 groups of 4):
    both ranks compute the advantages of the whole round and take identical steps — the same
    LoRA weights and metrics as one process, to 1e-5."""
    from pipeline import layout, rounds
    from pipeline.policy import Policy
    from pipeline.rewards import RewardMix

    params = _with_overrides(
        tiny_project,
        "train.method=stepwise", "update.inner_epochs=2", "update.kl_beta=0.01",
    )  # fmt: skip
    cfg = load_config(params)
    policy = Policy.create(cfg)
    schedule = rounds.Schedule.from_config(cfg)
    prompts = layout.load_prompts(cfg, "train")
    counter = rounds.CountingVelocity(policy.backend, cfg.sampling.guidance)
    rollout = rounds.rollout_round(
        policy.backend, prompts, [0, 3, 7], schedule, cfg, method="stepwise", seed=0,
        round_index=0, run_id="t", model_version="t", counter=counter,
    )  # fmt: skip
    scores = rounds.score_round(
        policy.backend, rollout, layout.trajectory_metadata(cfg, rollout.prompts),
        RewardMix(cfg, cfg.score.rewards), cfg, estimators=rounds.estimators_for("stepwise", cfg),
        schedule=schedule, counter=counter,
    )  # fmt: skip
    saved = tmp_path / "round.pt"
    torch.save(
        {
            "method": "stepwise", "table": scores.table, "group_ids": rollout.group_ids,
            "states": rollout.states, "log_probs": rollout.log_probs, "sigmas": rollout.sigmas,
            "prompts": rollout.prompts, "advantages": torch.zeros(12, schedule.steps.numel()),
        },
        saved,
    )  # fmt: skip

    for processes in (1, 2):
        done = _launch(processes, saved, params, tmp_path / str(processes))
        assert done.returncode == 0, done.stderr[-3000:]
    one = torch.load(tmp_path / "1" / "rank0.pt", weights_only=False)
    ranks = [torch.load(tmp_path / "2" / f"rank{i}.pt", weights_only=False) for i in (0, 1)]
    assert [r["rows"] for r in ranks] == [(0, 6), (6, 12)]  # group 1 (rows 4-7) is split
    for rank in ranks:
        torch.testing.assert_close(rank["advantages"], one["advantages"], rtol=0, atol=1e-6)
        assert rank["metrics"].keys() == one["metrics"].keys()
        for key, value in one["metrics"].items():
            assert rank["metrics"][key] == pytest.approx(value, rel=1e-5, abs=1e-5), key
        for name, weight in one["lora"].items():
            torch.testing.assert_close(rank["lora"][name], weight, rtol=1e-5, atol=1e-5)
    moved = [n for n, w in one["lora"].items() if not torch.equal(w, ranks[0]["lora"][n] * 0)]
    assert moved, "the update moved no LoRA weight"
    for name, weight in ranks[0]["lora"].items():  # gradients were synchronised
        assert torch.equal(weight, ranks[1]["lora"][name]), name


def _train_command(processes: int, project: Path, *extra: str) -> subprocess.CompletedProcess:
    """`creditflow train` in `project`, alone or under `accelerate launch` (module `stages.cli`
    of this checkout)."""
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env |= {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), "CREDITFLOW_ORCHESTRATION": "inline"}
    launcher = [sys.executable, "-m"]
    if processes > 1:
        launcher += [
            "accelerate.commands.launch", "--multi_gpu", "--num_processes", str(processes),
            "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(_free_port()), "--module",
        ]  # fmt: skip
    return subprocess.run(
        [*launcher, "stages.cli", "train", "--method", "stepwise", "--seed", "0", *extra],
        env=env, capture_output=True, text=True, timeout=600, cwd=project,
    )  # fmt: skip


def test_multiprocess_training_equals_one_process(tiny_project, tmp_path):
    """`creditflow train` under `accelerate launch` with 2 gloo processes: the same rounds,
    checkpoints (LoRA weights to 1e-5) and per-round metrics as one process, one writer."""
    import json
    import shutil

    from safetensors.torch import load_file

    _with_overrides(tiny_project, "score.estimator=tweedie", "train.rounds=2", "train.eval_every=0")
    projects = {n: tmp_path / f"p{n}" for n in (1, 2)}
    for processes, project in projects.items():
        shutil.copytree(tiny_project, project)
        done = _train_command(processes, project)
        assert done.returncode == 0, done.stderr[-3000:]
    runs = {n: p / "data" / "train" / "stepwise-s0" for n, p in projects.items()}
    for r in (0, 1):
        weights = [
            load_file(runs[n] / "checkpoints" / f"round-{r:04d}" / "lora.safetensors")
            for n in (1, 2)
        ]
        assert weights[0].keys() == weights[1].keys()
        for name, weight in weights[0].items():
            torch.testing.assert_close(weights[1][name], weight, rtol=1e-5, atol=1e-5)
    curves = [json.loads((p / "reports/train/stepwise-s0/rounds.json").read_text()) for p in
              projects.values()]  # fmt: skip
    assert len(curves[0]) == len(curves[1]) == 2
    for one, two in zip(*curves, strict=True):
        for key, value in one.items():
            if key.startswith(("reward/", "credit/", "train/", "cost/")):
                assert two[key] == pytest.approx(value, rel=1e-4, abs=1e-5), key

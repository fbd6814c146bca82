"""The training flow end to end on a tiny random backend: learning, resume, failure modes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from pipeline.config import load_config
from pipeline.flows import run_stage
from pipeline.layout import train_run
from pipeline.policy import INPUTS_FILE, run_inputs
from pipeline.rewards import REWARDS
from pipeline.rounds import RoundError, most_nonmonotonic


def brightness(cfg):
    """A reward any policy can climb quickly: mean pixel value."""
    return lambda images, metadata: images.float().mean(dim=(1, 2, 3))


@pytest.fixture
def bright(monkeypatch):
    monkeypatch.setitem(REWARDS, "brightness", brightness)
    return [
        "score.rewards={brightness: 1.0}",
        "sampling.num_steps=10",  # the DDIM-style SDE explores little on short schedules
        "rollout.prompts_per_round=4",
        "rollout.group_size=8",
        "update.minibatch_size=32",
        "update.lr=0.03",
        "update.clip_range=0.2",
    ]


def train(project, overrides):
    cfg = load_config(project / "params.yaml", overrides)
    summary = run_stage("train", cfg)
    return cfg, summary


@pytest.mark.parametrize("method", ["flow_grpo", "stepwise", "tp_grpo"])
def test_each_method_raises_the_training_reward(tiny_project, bright, method):
    cfg, summary = train(tiny_project, [*bright, f"train.method={method}", "train.rounds=6"])
    rewards = [r["reward/mean"] for r in json.loads(_rounds_json(cfg).read_text())]
    assert len(rewards) == summary["rounds"] == 6
    # Fixed seeds make this deterministic; the margin is what each method reliably gains here.
    assert sum(rewards[3:]) / 3 > sum(rewards[:3]) / 3 + 0.002, rewards


def _rounds_json(cfg):
    return cfg.root / "reports/train" / train_run(cfg).name / "rounds.json"


def _lora(run):
    last = max((run / "checkpoints").iterdir())
    return load_file(last / "lora.safetensors")


def _curve(report):
    rounds = json.loads(report.read_text())
    drop = ("time/", "perf/")  # wall-clock differs between runs
    return [{k: v for k, v in r.items() if not k.startswith(drop)} for r in rounds]


def test_resumed_run_equals_uninterrupted_run(tiny_project):
    overrides = ["train.method=tp_grpo", "train.rounds=3"]
    cfg, _ = train(tiny_project, overrides)
    run = train_run(cfg)
    report = tiny_project / "reports/train/tp_grpo-s0/rounds.json"
    straight_lora, straight_curve = _lora(run), _curve(report)

    import shutil

    shutil.rmtree(run)
    train(tiny_project, ["train.method=tp_grpo", "train.rounds=1"])  # "killed" after round 0
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["round-0000"]
    train(tiny_project, overrides)  # the rerun resumes at round 1
    resumed_lora = _lora(run)
    assert resumed_lora.keys() == straight_lora.keys()
    assert all(torch.equal(resumed_lora[k], straight_lora[k]) for k in straight_lora)
    assert _curve(report) == straight_curve


def test_a_run_resumes_only_from_the_same_inputs(tiny_project, bright, recwarn):
    """DVC keeps the persist: true run directory: more rounds extend it, other params retrain."""
    first_cfg, _ = train(tiny_project, [*bright, "train.rounds=1"])
    run = train_run(first_cfg)
    round_0 = run / "checkpoints/round-0000/lora.safetensors"
    first, first_stat = load_file(round_0), round_0.stat()

    train(tiny_project, [*bright, "train.rounds=2"])  # extends: round 0 stays as it was
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["round-0000", "round-0001"]
    assert (round_0.stat().st_ino, round_0.stat().st_mtime_ns) == (
        first_stat.st_ino,
        first_stat.st_mtime_ns,
    )
    assert not [w for w in recwarn if "other inputs" in str(w.message)]

    with pytest.warns(RuntimeWarning, match=r"changed: update\.lr\)"):
        train(tiny_project, [*bright, "train.rounds=1", "update.lr=0.05"])
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["round-0000"]
    retrained = load_file(round_0)
    assert any(not torch.equal(retrained[k], first[k]) for k in first)
    assert json.loads((run / INPUTS_FILE).read_text())["update.lr"] == "0.05"


def test_run_inputs_follow_the_base_model_files_not_the_round_count(tiny_project, tmp_path):
    import shutil

    cfg = load_config(tiny_project / "params.yaml")
    model = shutil.copytree(cfg.path(cfg.model.path), tmp_path / "model")
    cfg = load_config(tiny_project / "params.yaml", [f"model.path={model}"])
    before = run_inputs(cfg)
    assert run_inputs(load_config(cfg.params_file, [f"model.path={model}", "train.rounds=99"])) == (
        before
    )
    config = next(model.rglob("config.json"))
    config.write_text(config.read_text() + " ")
    after = run_inputs(cfg)
    assert {k for k in before if before[k] != after[k]} == {"digest.base_model"}


def test_nan_reward_stops_the_round_naming_the_trajectory(tiny_project, monkeypatch):
    def broken(cfg):
        def reward(images, metadata):
            values = torch.ones(images.shape[0])
            values[3] = float("nan")
            return values

        return reward

    monkeypatch.setitem(REWARDS, "broken", broken)
    cfg = load_config(tiny_project / "params.yaml", ["score.rewards={broken: 1.0}"])
    with pytest.raises(RoundError, match="trajectory 3 is nan"):
        run_stage("train", cfg)
    assert not (train_run(cfg) / "checkpoints").exists()


def test_report_examples_are_the_most_non_monotonic_trajectories():
    estimates = torch.tensor([[0.0, 1, 2], [0, 1, 0], [2, 0, 2], [1, 1, 1]])
    final = torch.tensor([3.0, 1, 0, 1])
    # excess variation (total variation - |net change|) of [estimates, final]: 0, 2, 4, 0
    assert most_nonmonotonic(estimates, final, 2).tolist() == [1, 2]
    assert most_nonmonotonic(estimates, final, 3).tolist() == [0, 1, 2]  # tie: lower index
    assert most_nonmonotonic(estimates, final, 0).tolist() == []

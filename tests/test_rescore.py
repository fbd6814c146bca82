"""Re-scoring cached rollouts with a new reward: new score tables, rollout files untouched."""

from __future__ import annotations

import json

import pytest

from pipeline.config import ConfigError, load_config
from pipeline.layout import train_run
from pipeline.rewards import REWARDS
from pipeline.trajectories import read_scores, sha256_tree
from stages.flows import run_stage


def test_rescore_writes_new_scores_and_leaves_rollouts_byte_identical(tiny_project, monkeypatch):
    monkeypatch.setitem(REWARDS, "brightness", lambda cfg: lambda im, meta: im.mean(dim=(1, 2, 3)))
    cfg = load_config(tiny_project / "params.yaml", ["train.method=stepwise", "train.rounds=1"])
    run_stage("train", cfg)
    rollouts = train_run(cfg) / "rollouts"
    before = sha256_tree(rollouts)

    summary = run_stage(
        "rescore", cfg, rollouts=rollouts, rewards="brightness=1", out=tiny_project / "rescored"
    )

    assert sha256_tree(rollouts) == before
    new = read_scores(tiny_project / "rescored", 0)
    old = read_scores(rollouts, 0)
    assert set(new.reward) == {"brightness", "mix"}
    # The same states were scored: same (trajectory, state, estimator) keys as the original.
    keys = ["trajectory", "step", "estimator"]
    assert new[keys].drop_duplicates().equals(old[keys].drop_duplicates())
    assert 0.0 <= summary["sign_flip_share"] <= 1.0
    written = json.loads((tiny_project / "reports/rescore/summary.json").read_text())
    assert written["rewards"] == "brightness=1"
    assert (tiny_project / "reports/rescore/summary.md").is_file()


def test_rescore_rejects_an_unknown_reward(tiny_project):
    cfg = load_config(tiny_project / "params.yaml")
    with pytest.raises(ConfigError, match="--rewards: 'brightnes' is not one of"):
        run_stage("rescore", cfg, rollouts="data/none", rewards="brightnes", out="data/x")


def test_rescore_checks_everything_first_and_swaps_out_whole(tiny_project, monkeypatch):
    """Params that sample differently and a round without a manifest are refused before any
    work; a failure in a later round leaves `--out` exactly as it was (no mix of rewards)."""
    import stages.rescore as rescore_stage
    from pipeline.trajectories import MANIFEST_NAME, STEPS, round_dir

    monkeypatch.setitem(REWARDS, "brightness", lambda cfg: lambda im, meta: im.mean(dim=(1, 2, 3)))
    cfg = load_config(tiny_project / "params.yaml", ["train.rounds=2", "train.keep_rollouts=2"])
    run_stage("train", cfg)
    rollouts, out = train_run(cfg) / "rollouts", tiny_project / "rescored"
    run_stage("rescore", cfg, rollouts=rollouts, rewards="geneval=1", out=out)
    kept = sha256_tree(out)

    other = load_config(tiny_project / "params.yaml", ["sampling.num_steps=3"])
    with pytest.raises(ConfigError, match="sampling.num_steps: .* was trained with 4"):
        run_stage("rescore", other, rollouts=rollouts, rewards="brightness=1", out=out)

    real_check, calls = rescore_stage.rounds.check_finite, []

    def fail_in_round_1(table):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("disk full")
        real_check(table)

    monkeypatch.setattr(rescore_stage.rounds, "check_finite", fail_in_round_1)
    with pytest.raises(RuntimeError, match="disk full"):
        run_stage("rescore", cfg, rollouts=rollouts, rewards="brightness=1", out=out)
    assert sha256_tree(out) == kept  # round 0's new scores never replaced the old ones
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".rescored")] == []

    (round_dir(rollouts, STEPS, 1) / MANIFEST_NAME).unlink()
    with pytest.raises(ConfigError, match="round 1 .* has no manifest"):
        run_stage("rescore", cfg, rollouts=rollouts, rewards="brightness=1", out=out)
    assert sha256_tree(out) == kept

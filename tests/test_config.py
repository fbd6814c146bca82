"""params.yaml validation: defaults, overrides, and the one-line errors users see."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from pipeline.config import Config, ConfigError, apply_overrides, load_config, validate

REPO = Path(__file__).resolve().parents[1]


def test_params_yaml_matches_the_typed_defaults():
    cfg = load_config(REPO / "params.yaml")
    internal = {"root", "params_file"}
    assert cfg.model_dump(exclude=internal) == Config().model_dump(exclude=internal)
    assert cfg.root == REPO


def test_every_section_of_params_yaml_is_a_config_field():
    sections = set(yaml.safe_load((REPO / "params.yaml").read_text()))
    assert sections == set(Config.model_fields) - {"root", "params_file"}


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "train.method=stepwise_typo",
            "train.method: 'stepwise_typo' is not one of flow_grpo, stepwise, tp_grpo",
        ),  # fmt: skip
        ("train.rounds=abc", "train.rounds: input should be a valid integer"),
        ("train.roundz=3", "train.roundz: unknown key"),
        ("sampling.guidance=0.5", "sampling.guidance: input should be greater than or equal to 1"),
        ("rollout.sampler=ddim", "rollout.sampler: 'ddim' is not one of auto, flow_grpo, cps"),
        ("rollout.window_start=10", "rollout.window_start..window_end selects steps [10, 9)"),
        ("score.rewards={}", "score.rewards: needs at least one reward with a positive weight"),
        ("score.rewards={genevla: 1}", "score.rewards: 'genevla' is not one of geneval, "),
    ],
)
def test_bad_values_give_one_line_naming_the_key(override, message):
    with pytest.raises(ConfigError) as err:
        validate(apply_overrides({}, [override]))
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_overrides_parse_values_as_yaml_like_dvc():
    tree = apply_overrides({"train": {"rounds": 1}}, ["train.rounds=7", "train.seeds=[3, 4]"])
    cfg = validate(tree)
    assert (cfg.train.rounds, cfg.train.seeds) == (7, [3, 4])


def test_override_into_a_value_is_an_error():
    with pytest.raises(ConfigError, match="train.rounds: is a value, not a section"):
        apply_overrides({"train": {"rounds": 1}}, ["train.rounds.x=1"])


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="key=value"):
        apply_overrides({}, ["train.rounds"])


def test_missing_params_file_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="params: file not found"):
        load_config(tmp_path / "nope.yaml")


def test_window_end_counts_from_the_end_and_sampler_follows_method():
    cfg = validate(apply_overrides({}, ["sampling.num_steps=6", "train.method=stepwise"]))
    assert cfg.sde_window_end == 5  # all but the final step
    assert cfg.sampler == "stepwise"
    cfg = validate(apply_overrides({}, ["train.method=tp_grpo", "rollout.sampler=cps"]))
    assert cfg.sampler == "cps"


def test_paths_resolve_against_the_params_file(project):
    cfg = load_config(project / "params.yaml")
    assert cfg.path("data/prompts") == project / "data/prompts"
    assert cfg.path("/abs/x") == Path("/abs/x")


def test_cli_typo_exits_2_with_one_line_and_writes_nothing(project):
    before = sorted(p.name for p in project.iterdir())
    result = subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "train", "--method", "stepwise_typo",
         "--params", str(project / "params.yaml")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == (
        "error: train.method: 'stepwise_typo' is not one of flow_grpo, stepwise, tp_grpo\n"
    )
    assert sorted(p.name for p in project.iterdir()) == before

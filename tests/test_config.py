"""params.yaml validation: defaults, overrides, and the one-line errors users see."""

from __future__ import annotations

import os
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
        ("rollout.window_start=10", "rollout.window_start..window_end selects steps [10, 3)"),
        ("score.rewards={}", "score.rewards: needs at least one reward with a positive weight"),
        ("score.rewards={genevla: 1}", "score.rewards: 'genevla' is not one of geneval, "),
        ("base.refine_tag_weights={position: 0}", "base.refine_tag_weights: the tag weights must"),
        (
            "base.refine_tag_weights={posture: 1}",
            "base.refine_tag_weights.posture.[key]: 'posture'",
        ),
        ("prompts.mix={}", "prompts.mix: the tag weights must have a positive sum"),
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
    overrides = ["sampling.num_steps=6", "rollout.window_end=-1", "train.method=stepwise"]
    cfg = validate(apply_overrides({}, overrides))
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
        [sys.executable, "-m", "stages.cli", "train", "--method", "stepwise_typo",
         "--params", str(project / "params.yaml")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr == (
        "error: train.method: 'stepwise_typo' is not one of flow_grpo, stepwise, tp_grpo\n"
    )
    assert sorted(p.name for p in project.iterdir()) == before


@pytest.mark.parametrize(
    "text, message",
    [
        ("train:\n  rounds: 2\ntrain:\n  rounds: 3\n", "line 3, column 1: duplicate key 'train'"),
        ("update:\n  lr: 1\n  lr: 2\n", "line 3, column 3: duplicate key 'lr'"),
        ("", "is empty"),
        ("# only a comment\n", "is empty"),
        ("train:\n  rounds: [1, 2\n", "line 3, column 1: expected ',' or ']'"),
        ("rollout:\n  eta: {stepwise: 1.5}\n", "rollout.eta"),
    ],
)
def test_params_file_mistakes_are_refused_at_load_with_their_place(tmp_path, text, message):
    params = tmp_path / "params.yaml"
    params.write_text(text)
    with pytest.raises(ConfigError) as caught:
        load_config(params)
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_user_errors_are_one_line_under_prefect_and_io_errors_too(project):
    """The real CLI through Prefect: a user error (here a missing base model, raised inside the
    flow) prints no traceback; an OSError (unwritable run directory) is one line; with
    CREDITFLOW_DEBUG=1 the traceback is back."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("CREDITFLOW_")}
    command = [sys.executable, "-m", "stages.cli", "rollout", "--params",
               str(project / "params.yaml"), "-S", "model.path=missing"]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1 and errors[0].startswith("error: model.path: no ShapesWorld model")
    debug = subprocess.run(
        command, capture_output=True, text=True, check=False, env=env | {"CREDITFLOW_DEBUG": "1"}
    )
    assert debug.returncode != 0 and "Traceback" in debug.stderr


def test_an_os_error_is_one_line_naming_the_file(monkeypatch, capsys):
    import stages.cli as cli

    def full_disk():
        raise OSError(28, "No space left on device", "data/train/x/rollouts/part-0.parquet")

    monkeypatch.delenv("CREDITFLOW_DEBUG", raising=False)
    monkeypatch.setattr(cli, "app", full_disk)
    with pytest.raises(SystemExit) as exited:
        cli.main()
    assert exited.value.code == 1
    assert capsys.readouterr().err == (
        "error: No space left on device: data/train/x/rollouts/part-0.parquet\n"
    )

"""The command line: every stage is a subcommand with --help."""

from __future__ import annotations

import pytest
from typer.testing import CliRunner

from stages import STAGES
from stages.cli import app

runner = CliRunner()


def test_help_lists_every_stage():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for stage in STAGES:
        assert stage in result.output


@pytest.mark.parametrize("stage", STAGES)
def test_every_stage_has_help_with_params_and_overrides(stage):
    result = runner.invoke(app, [stage, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0
    assert "--params" in result.output
    assert "--set" in result.output

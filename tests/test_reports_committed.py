"""The committed results render: every training curve in `reports/train` has uniform rows (a
file whose rows differ in keys makes `dvc plots show` drop the whole plot, overlays included),
and every run the all-runs overlays name has its curves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
CURVES = sorted(REPO.glob("reports/train/*/*.json"))


@pytest.mark.parametrize("path", CURVES, ids=[str(p.relative_to(REPO)) for p in CURVES])
def test_committed_training_curves_have_uniform_rows(path):
    rows = json.loads(path.read_text())
    if path.name == "metrics.json":  # a flat summary, not a curve
        assert isinstance(rows, dict)
        return
    assert rows and all(set(row) == set(rows[0]) for row in rows), path


def test_every_curve_of_the_overlays_is_committed():
    for plot in yaml.safe_load((REPO / "dvc.yaml").read_text())["plots"]:
        ((name, spec),) = plot.items()
        missing = [f for f in spec["y"] if not (REPO / f).is_file()]
        assert not missing, f"{name}: {missing}"


def test_train_on_test_4_is_the_pool_of_the_committed_credit_experiments():
    """`rollout.train_on_test=4` on the default test split trains on exactly the 24 lines of
    `reports/search/oracle/pool24/prompts.jsonl` (sessions 42-50), so `dvc exp run -S
    rollout.train_on_test=4` reruns those experiments."""
    from pipeline import world
    from pipeline.config import load_config
    from pipeline.layout import trained_test_lines

    cfg = load_config(REPO / "params.yaml", ["rollout.train_on_test=4"])
    _, test = world.make_prompts(
        cfg.prompts.n_train, cfg.prompts.n_test, seed=cfg.prompts.seed,
        shapes=tuple(cfg.world.shapes), colors=tuple(cfg.world.colors),
        max_count=cfg.world.max_count, mix=cfg.prompts.mix,
    )  # fmt: skip
    pool = world.read_prompts(REPO / "reports/search/oracle/pool24/prompts.jsonl")
    assert [test[i] for i in trained_test_lines(cfg, test)] == pool

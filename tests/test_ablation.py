"""An ablation run in another project is kept in reports/ablations/<name> and read by the report's
joint_vs_per_step claim (default stepwise minus the per-step-normalization runs)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import layout
from pipeline.ablation import import_ablation, param_differences
from pipeline.config import CreditflowError, load_config
from pipeline.io import write_json
from pipeline.world import write_prompts
from stages.report import claims_summary

REPO = Path(__file__).resolve().parents[1]

TEST_PROMPTS = [
    {"tag": "single_object", "prompt": f"a photo of a {shape}",
     "include": [{"class": shape, "count": 1}], "exclude": []}
    for shape in ("circle", "square")
] + [
    {"tag": "colors", "prompt": f"a photo of a {color} circle",
     "include": [{"class": "circle", "count": 1, "color": color}], "exclude": []}
    for color in ("red", "blue")
]  # fmt: skip


def write_run(root, run: str, correct: list[int], nfe: float) -> None:
    """One image per test prompt, judged `correct`; a two-round rounds.json of `nfe` NFEs."""
    lines = [
        {"prompt": p["prompt"], "correct": bool(c)}
        for p, c in zip(TEST_PROMPTS, correct, strict=True)
    ]
    (root / layout.EVAL / run).mkdir(parents=True, exist_ok=True)
    (root / layout.EVAL / run / "results.jsonl").write_text(
        "".join(json.dumps(line) + "\n" for line in lines)
    )
    rounds = [{"round": r, "cost/round_nfe": nfe / 2, "reward/mean": 0.5} for r in range(2)]
    write_json(root / "reports/train" / run / "rounds.json", rounds)
    write_json(root / "reports/eval" / run / "metrics.json", {"overall": sum(correct) / 4})


@pytest.fixture
def ablated(project, tmp_path):
    """The project with evaluated default stepwise runs, and a copy of it run per step."""
    write_prompts(project / "data/prompts/test.jsonl", TEST_PROMPTS)
    write_run(project, "stepwise-s0", [1, 1, 0, 0], 1000.0)
    write_run(project, "stepwise-s1", [1, 0, 1, 0], 1000.0)
    other = tmp_path / "per_step"
    other.mkdir()
    params = (project / "params.yaml").read_text()
    (other / "params.yaml").write_text(
        params.replace("normalization: joint", "normalization: per_step")
    )
    write_run(other, "stepwise-s0", [0, 0, 0, 0], 1200.0)
    write_run(other, "stepwise-s1", [1, 0, 0, 0], 1200.0)
    return project, other


def test_param_differences_name_the_override_and_ignore_the_same_path_spelled_otherwise(ablated):
    project, other = ablated
    theirs = load_config(other / "params.yaml", [f"model.path={project / 'data/base/model'}"])
    assert param_differences(load_config(project / "params.yaml"), theirs) == {
        "advantages.normalization": ["joint", "per_step"]
    }


def test_import_keeps_the_runs_and_the_report_measures_joint_vs_per_step(ablated):
    project, other = ablated
    cfg = load_config(project / "params.yaml", ["train.methods=[stepwise]", "train.seeds=[0,1]"])
    folder = import_ablation(cfg, "per_step", other, "stepwise")
    assert folder == project / "reports/ablations/per_step"
    kept = json.loads((folder / "ablation.json").read_text())
    assert kept["runs"] == ["stepwise-s0", "stepwise-s1"]
    assert kept["params"] == {"advantages.normalization": ["joint", "per_step"]}
    assert (folder / "train/stepwise-s1/rounds.json").is_file()
    assert json.loads((folder / "eval/stepwise-s1/metrics.json").read_text()) == {"overall": 0.25}

    from pipeline.bench import read_training_runs

    runs = read_training_runs(project / "reports", ["stepwise"], [0, 1])
    missing: list[str] = []
    claim = claims_summary(cfg, runs, missing)["claims"]["joint_vs_per_step"]
    # joint: per-prompt means [1, .5, .5, 0] -> tags .75, .25 -> .5; per step: [.5, 0, 0, 0] ->
    # .25, 0 -> .125
    assert claim["diff"] == pytest.approx(0.375)
    assert claim["ci95"][0] <= 0.375 <= claim["ci95"][1]
    assert claim["nfe"] == 1200.0 and claim["nfe_ratio"] == pytest.approx(1000 / 1200)
    assert not any("joint_vs_per_step" in line for line in missing)
    shutil.rmtree(folder / "train")  # verdicts without curves: the claim stands, its NFEs unknown
    claim = claims_summary(cfg, runs, [])["claims"]["joint_vs_per_step"]
    assert claim["diff"] == pytest.approx(0.375)
    assert claim["nfe"] == 1000.0 and claim["nfe_ratio"] is None


def test_import_refuses_to_overwrite_same_params_or_nothing_evaluated(ablated):
    project, other = ablated
    cfg = load_config(project / "params.yaml")
    import_ablation(cfg, "per_step", other, "stepwise")
    before = (project / "reports/ablations/per_step/ablation.json").read_text()
    with pytest.raises(CreditflowError, match="never overwritten"):
        import_ablation(cfg, "per_step", other, "stepwise")
    assert (project / "reports/ablations/per_step/ablation.json").read_text() == before
    with pytest.raises(CreditflowError, match="same params"):
        import_ablation(cfg, "itself", project, "stepwise")
    with pytest.raises(CreditflowError, match="no evaluated tp_grpo run"):
        import_ablation(cfg, "tp", other, "tp_grpo")


def test_claim_is_missing_without_the_ablation_or_on_other_test_prompts(ablated):
    project, other = ablated
    cfg = load_config(project / "params.yaml", ["train.methods=[stepwise]", "train.seeds=[0,1]"])
    missing: list[str] = []
    assert claims_summary(cfg, {}, missing)["claims"]["joint_vs_per_step"] is None
    assert any(line.startswith("claim joint_vs_per_step") for line in missing)
    import_ablation(cfg, "per_step", other, "stepwise")
    green = json.loads(json.dumps(TEST_PROMPTS[3]).replace("blue", "green"))
    write_prompts(project / "data/prompts/test.jsonl", [*TEST_PROMPTS, green])
    for seed in (0, 1):  # the default runs evaluated on the grown split
        lines = (project / f"data/eval/stepwise-s{seed}/results.jsonl").read_text()
        line = json.dumps({"prompt": green["prompt"], "correct": True}) + "\n"
        (project / f"data/eval/stepwise-s{seed}/results.jsonl").write_text(lines + line)
    from pipeline.bench import read_training_runs

    runs = read_training_runs(project / "reports", ["stepwise"], [0, 1])
    assert claims_summary(cfg, runs, [])["methods"]["stepwise"]["geneval"] > 0
    # the kept verdicts lack a prompt of today's test split: no claim rather than a wrong one
    assert claims_summary(cfg, runs, [])["claims"]["joint_vs_per_step"] is None


def test_import_ablation_command_keeps_the_runs_and_refuses_a_second_time_in_one_line(ablated):
    project, other = ablated
    command = [sys.executable, "-m", "stages.cli", "import-ablation", "--name", "per_step",
               "--from", str(other), "--params", str(project / "params.yaml")]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "kept stepwise runs of" in done.stdout
    again = subprocess.run(command, capture_output=True, text=True, cwd=REPO)
    assert again.returncode != 0
    assert again.stderr.strip().count("\n") == 0
    assert again.stderr.startswith("error: ") and "never overwritten" in again.stderr


def test_under_train_on_test_each_claim_is_also_read_on_the_trained_and_the_other_lines(ablated):
    """`rollout.train_on_test=1` trains on the first test line of each tag (here the plain circle
    and the red one): experiment.json keeps every claim over all test lines and adds them on
    those lines and on the held-out others."""
    from pipeline.bench import read_training_runs

    project, other = ablated
    import_ablation(load_config(project / "params.yaml"), "per_step", other, "stepwise")
    runs = read_training_runs(project / "reports", ["stepwise"], [0, 1])
    overrides = ["train.methods=[stepwise]", "train.seeds=[0,1]"]
    plain = claims_summary(load_config(project / "params.yaml", overrides), runs, [])
    assert "by_test_lines" not in plain
    cfg = load_config(project / "params.yaml", [*overrides, "rollout.train_on_test=1"])
    out = claims_summary(cfg, runs, [])
    assert out["claims"] == plain["claims"]
    trained, held_out = out["by_test_lines"]["trained"], out["by_test_lines"]["held_out"]
    assert trained["prompts"] == held_out["prompts"] == 2
    # per seed: s0 judged [1, 1, 0, 0], s1 [1, 0, 1, 0]; lines 0 and 2 trained
    assert trained["methods"]["stepwise"]["geneval_per_seed"] == pytest.approx([0.5, 1.0])
    assert held_out["methods"]["stepwise"]["geneval_per_seed"] == pytest.approx([0.5, 0.0])
    # per step [0, 0, 0, 0] and [1, 0, 0, 0]: trained lines .5 - .25, held out .25 - 0
    assert trained["claims"]["joint_vs_per_step"]["diff"] == pytest.approx(0.5)
    assert held_out["claims"]["joint_vs_per_step"]["diff"] == pytest.approx(0.25)
    assert trained["claims"]["stepwise_vs_flow_grpo"] is None  # no flow_grpo run

"""The sample-efficiency benchmark on hand-made reward curves, and the `bench` stage's files."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

from pipeline.bench import benchmark, first_reaching, read_training_runs, running_mean
from pipeline.config import load_config
from pipeline.io import write_json
from stages.bench import HEADLINE, bench

# With a 3-round trailing mean these reach 0.6 at rounds 9 (flow_grpo) and 3 (stepwise).
FLOW = [0.0] * 7 + [0.6] * 5
STEPWISE = [0.0] + [0.6] * 11
NEVER = [0.0] + [0.3] * 11


def rounds_rows(rewards, seconds: float, nfe: float, **extra) -> list[dict]:
    """A rounds.json as `train` writes it: rollout/score/update split 50/30/20 of the round."""
    return [
        {
            "round": r,
            "reward/mean": reward,
            "train/accuracy": reward / 2,
            "time/round_s": seconds,
            "time/rollout_s": 0.5 * seconds,
            "time/score_s": 0.3 * seconds,
            "time/update_s": 0.2 * seconds,
            "cost/round_nfe": nfe,
            "cost/rollout_nfe": 0.5 * nfe,
            "cost/score_nfe": 0.3 * nfe,
            "cost/update_nfe": 0.2 * nfe,
        }
        | extra
        for r, reward in enumerate(rewards)
    ]


def write_runs(root: Path, curves: dict[str, tuple[list[float], float, float]], seeds=(0, 1)):
    for method, (rewards, seconds, nfe) in curves.items():
        for seed in seeds:
            path = root / "reports" / "train" / f"{method}-s{seed}" / "rounds.json"
            write_json(path, rounds_rows(rewards, seconds, nfe))


CURVES = {
    "flow_grpo": (FLOW, 10.0, 100.0),
    "stepwise": (STEPWISE, 20.0, 300.0),
    "tp_grpo": (NEVER, 30.0, 500.0),
}


def test_running_mean_is_trailing_and_shorter_at_the_start():
    assert np.allclose(running_mean(np.array([1.0, 2, 3, 4, 8]), 3), [1, 1.5, 2, 3, 5])
    assert np.allclose(running_mean(np.array([[1.0, 3], [2, 2]]), 3), [[1, 2], [2, 2]])


def test_first_reaching_returns_the_first_index_or_none():
    assert first_reaching(np.array([0.1, 0.5, 0.4, 0.6]), 0.5) == 1
    assert first_reaching(np.array([0.1, 0.2]), 0.5) is None


def test_ratios_on_hand_made_curves(tmp_path):
    write_runs(tmp_path, CURVES)
    runs = read_training_runs(tmp_path / "reports", list(CURVES), [0, 1])
    result = benchmark(runs)
    assert result["target_reward"] == pytest.approx(0.6)
    flow, step = result["methods"]["flow_grpo"], result["methods"]["stepwise"]
    assert flow["rounds_to_target"] == 9 and step["rounds_to_target"] == 3
    assert result["rounds_ratio"]["stepwise"] == pytest.approx(1 / 3)
    assert result["met"]["rounds_ratio"]["stepwise"] is True  # 3 of 9 rounds is the 0.33 target
    # Seconds of the rounds before the target round: 9 x 10 s vs 3 x 20 s.
    assert flow["seconds_to_target"] == pytest.approx(90) and step["seconds_to_target"] == 60
    assert result["wallclock_ratio"]["stepwise"] == pytest.approx(60 / 90)
    assert result["met"]["wallclock_ratio"]["stepwise"] is False
    assert result["round_cost_ratio"] == {"stepwise": 2.0, "tp_grpo": 3.0}
    assert result["round_nfe_ratio"] == {"stepwise": 3.0, "tp_grpo": 5.0}
    assert result["met"]["round_cost_ratio"] == {"stepwise": False, "tp_grpo": False}
    assert step["nfe_per_round_by_phase"] == pytest.approx(
        {"rollout": 150, "score": 90, "update": 60}
    )
    # tp_grpo never gets past a smoothed 0.3: not reached, no ratio, and a note saying so.
    assert result["rounds_ratio"]["tp_grpo"] is None
    assert result["wallclock_ratio"]["tp_grpo"] is None
    assert result["met"]["rounds_ratio"]["tp_grpo"] is False  # never reaching misses the goal
    assert any("tp_grpo did not reach" in note for note in result["notes"])


def test_curves_are_averaged_over_seeds_after_smoothing(tmp_path):
    write_json(tmp_path / "reports/train/flow_grpo-s0/rounds.json", rounds_rows([0, 0, 0.9], 1, 1))
    write_json(
        tmp_path / "reports/train/flow_grpo-s1/rounds.json", rounds_rows([0, 0.3, 0.3], 1, 1)
    )
    write_json(tmp_path / "reports/train/stepwise-s0/rounds.json", rounds_rows([0, 0.6, 0.6], 1, 1))
    runs = read_training_runs(tmp_path / "reports", ["flow_grpo", "stepwise"], [0, 1])
    result = benchmark(runs)
    # Smoothed: s0 [0, 0, 0.3], s1 [0, 0.15, 0.2] -> mean [0, 0.075, 0.25].
    assert result["methods"]["flow_grpo"]["curve"] == pytest.approx([0, 0.075, 0.25])
    assert result["target_reward"] == pytest.approx(0.25)
    assert result["methods"]["flow_grpo"]["rounds_to_target_per_seed"] == [2, None]
    assert result["methods"]["stepwise"]["rounds_to_target"] == 1  # [0, 0.3, 0.4]
    assert result["rounds_ratio"]["stepwise"] == pytest.approx(0.5)


def test_missing_baseline_or_a_flat_baseline_gives_no_ratios(tmp_path):
    write_runs(tmp_path, {"stepwise": CURVES["stepwise"]})
    result = benchmark(read_training_runs(tmp_path / "reports", list(CURVES), [0, 1]))
    assert result["target_reward"] is None
    assert result["rounds_ratio"] == {"stepwise": None, "tp_grpo": None}
    assert any("flow_grpo has no training run" in n for n in result["notes"])

    write_runs(tmp_path, {"flow_grpo": ([0.5] * 6, 1.0, 1.0)})
    result = benchmark(read_training_runs(tmp_path / "reports", list(CURVES), [0, 1]))
    assert result["methods"]["flow_grpo"]["rounds_to_target"] == 0
    assert result["rounds_ratio"]["stepwise"] is None
    assert result["round_cost_ratio"]["stepwise"] == pytest.approx(20.0)
    assert any("did not improve" in n for n in result["notes"])


def test_bench_stage_writes_json_and_markdown(tiny_project):
    write_runs(tiny_project, CURVES)
    # seconds, not minutes, on a shared CPU
    cfg = load_config(tiny_project / "params.yaml", ["bench.repeats=2", "bench.round_repeats=1"])
    bench.fn(cfg)
    result = json.loads((tiny_project / "reports/benchmark.json").read_text())
    for key in ("rounds_ratio", "wallclock_ratio", "round_cost_ratio", "round_cost_ratio_runs"):
        assert set(result[key]) == {"stepwise", "tp_grpo"}
    # the DVC metrics file holds the headline ratios alone, the same numbers
    headline = json.loads((tiny_project / "reports/bench_metrics.json").read_text())
    assert set(headline) == {*HEADLINE, "rollout_efficiency"}
    assert headline["round_cost_ratio"] == result["round_cost_ratio"]
    assert result["rounds_ratio"]["stepwise"] == pytest.approx(1 / 3)
    assert result["rounds_ratio"]["tp_grpo"] is None
    # Round costs: the training runs' ratios are kept; the verdict's come from rounds timed
    # side by side here.
    assert result["round_cost_ratio_runs"] == {"stepwise": 2.0, "tp_grpo": 3.0}
    timed = result["round_cost"]["methods"]
    for method in ("stepwise", "tp_grpo"):
        assert result["round_cost_ratio"][method] == pytest.approx(
            timed[method]["round_s"] / timed["flow_grpo"]["round_s"]
        )
    # NFEs by hand (8 trajectories, T = 4, trained steps 0-2 or 1-2, CFG: 2 per call).
    assert timed["flow_grpo"]["nfe_by_phase"] == {
        "rollout": 8 * 4 * 2,
        "score": 0,
        "update": 8 * 3 * 4,
    }
    assert timed["flow_grpo"]["efficiency"]["score"] is None  # no network calls to compare
    # tp_grpo completes from states 0, 1, 2 in min(3, 4 - s) steps, the first one reused.
    assert timed["tp_grpo"]["nfe_by_phase"]["score"] == 8 * 2 * ((3 - 1) + (3 - 1) + (2 - 1))
    assert all(v > 0 for v in timed["tp_grpo"]["efficiency"].values())
    # Both samplers in use (flow_grpo's for flow_grpo and tp_grpo, stepwise's) are timed.
    assert [r["sampler"] for r in result["rollout"]] == ["flow_grpo", "stepwise"]
    assert result["rollout"][0]["batch"] == 8 and result["rollout"][0]["steps"] == 4
    efficiency = result["rollout_efficiency"]
    assert isinstance(efficiency, float) and efficiency > 0  # its size is the machine's business
    assert efficiency == min(r["efficiency"] for r in result["rollout"])
    for timed in result["rollout"]:  # median of adjacent raw / rollout pairs, 2 repeats
        pairs = zip(timed["raw_runs_s"], timed["rollout_runs_s"], strict=True)
        assert len(timed["raw_runs_s"]) == 2
        assert timed["efficiency"] == pytest.approx(statistics.median(a / b for a, b in pairs))
    text = (tiny_project / "reports/benchmark.md").read_text()
    assert "| rounds to target | stepwise | 0.33 | ≤ 0.33 | met |" in text
    assert "| rounds to target | tp_grpo | not reached in 12 rounds | ≤ 0.33 | not met |" in text
    ratio = result["round_cost_ratio"]["stepwise"]
    verdict = "met" if ratio <= 1.5 else "not met"
    assert f"| seconds per round | stepwise | {ratio:.2f} | ≤ 1.50 | {verdict} |" in text
    assert "One round of each method, side by side" in text


def test_bench_without_a_base_model_still_reports_the_ratios(project):
    write_runs(project, CURVES)
    bench.fn(load_config(project / "params.yaml"))
    result = json.loads((project / "reports/benchmark.json").read_text())
    assert result["rollout_efficiency"] is None
    assert result["round_cost_ratio"]["stepwise"] == pytest.approx(2.0)
    assert any("rollout efficiency and round costs not measured" in n for n in result["notes"])

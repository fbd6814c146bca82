"""The report: tables against hand-computed numbers, graceful gaps, and every file produced."""

from __future__ import annotations

import json

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch

from pipeline import layout
from pipeline import report as rep
from pipeline.config import load_config
from pipeline.geneval import TAGS, Detection, evaluate
from pipeline.io import write_json
from pipeline.report import (
    Spread,
    compare,
    credit_profile,
    early_late_ratio,
    geneval_markdown,
    geneval_table,
    trajectory_examples,
)
from pipeline.tracking import EXPERIMENT, STAGE_TAG, tracking_uri
from pipeline.trajectories import write_estimate_images, write_scores
from stages.flows import run_stage
from stages.report import report
from tests.test_bench import CURVES, rounds_rows

FIGURES = (
    "geneval.png",
    "learning_curves.png",
    "probe_curves.png",
    "credit.png",
    "nonmonotonic.png",
)


def test_spread_text_and_comparison():
    two = Spread.of([0.5, 0.7])
    assert (two.mean, two.low, two.high, two.n) == (pytest.approx(0.6), 0.5, 0.7, 2)
    assert two.text() == "0.60 (0.50–0.70)"
    assert Spread.of([0.25]).text(3) == "0.250"
    assert Spread.of([None, float("nan")]) is None
    assert compare(Spread.of([0.8, 0.9]), two, "b") == "higher than b beyond seed spread"
    assert compare(Spread.of([0.65, 0.9]), two, "b") == "within seed spread of b"
    assert compare(Spread.of([0.1, 0.2]), two, "b") == "lower than b beyond seed spread"
    assert compare(Spread.of([0.9]), two, "b") == "higher than b (one seed)"


def test_geneval_table_averages_seeds_and_shows_gaps():
    evals = {
        "base": [{"overall": 0.4, "per_tag": {"counting": 0.25}}],
        "flow_grpo": [
            {"overall": 0.5, "per_tag": {"counting": 0.5, "colors": 1.0}},
            {"overall": 0.7, "per_tag": {"counting": 0.75}},
        ],
        "tp_grpo": [],
    }
    table = geneval_table(evals)
    assert table["flow_grpo"]["counting"] == Spread(0.625, 0.5, 0.75, 2)
    assert table["flow_grpo"]["colors"] == Spread(1.0, 1.0, 1.0, 1)  # one seed has the tag
    assert table["base"]["position"] is None
    lines = geneval_markdown(table).splitlines()
    assert lines[0] == (
        "| policy | seeds | overall | single_object | two_object | counting | colors | position "
        "| color_attr |"
    )
    assert lines[2] == "| base | 1 | **0.40** | — | — | 0.25 | — | — | — |"
    assert (
        lines[3]
        == "| flow_grpo | 2 | **0.60 (0.50–0.70)** | — | — | 0.62 (0.50–0.75) | 1.00 | — | — |"
    )
    assert lines[4] == "| tp_grpo | 0 | — | — | — | — | — | — | — |"


def advantage_rows() -> pd.DataFrame:
    """Two trajectories x steps 0..2: |step reward| per step [0.2, 0.1, 0.1]; the advantage sign
    differs from the final-reward advantage at step 1 only; turning points at step 2 of one."""
    return pd.DataFrame(
        {
            "trajectory": [0, 0, 0, 1, 1, 1],
            "step": [0, 1, 2, 0, 1, 2],
            "step_reward": [0.3, -0.1, 0.0, 0.1, 0.1, -0.2],
            "turning_point": [False, False, True, False, False, False],
            "advantage": [1.0, -1.0, 0.5, -1.0, 1.0, -2.0],
            "final_advantage": [1.0, 1.0, 1.0, -1.0, -1.0, -1.0],
        }
    )


def test_credit_profile_per_step():
    profile = credit_profile(advantage_rows())
    assert profile.index.tolist() == [0, 1, 2]
    assert profile.abs_signal.tolist() == pytest.approx([0.2, 0.1, 0.1])
    assert profile.sign_differs.tolist() == [0.0, 1.0, 0.0]
    assert profile.turning_point_rate.tolist() == [0.0, 0.0, 0.5]
    assert early_late_ratio(profile) == pytest.approx(2.0)  # step 0 over step 2; 1 is the middle
    assert early_late_ratio(profile.iloc[:1]) is None


def estimates(trajectory_rewards: dict[int, tuple[list[float], float]]):
    """Score table, keys and images of estimates at states 0..2 (estimator ode_substeps); every
    image is filled with its key row's index / 10, so the row-to-image mapping is checkable."""
    keys, scores = [], []
    for trajectory, (rewards, final) in trajectory_rewards.items():
        for step, reward in enumerate(rewards):
            keys.append((trajectory, step, "ode_substeps"))
            scores += [(trajectory, step, "ode_substeps", "mix", reward)]
            scores += [(trajectory, step, "ode_substeps", "geneval", 1.0 - reward)]
        scores.append((trajectory, 3, "final", "mix", final))
    keys = pd.DataFrame(keys, columns=["trajectory", "step", "estimator"])
    scores = pd.DataFrame(scores, columns=["trajectory", "step", "estimator", "reward", "value"])
    images = torch.arange(len(keys), dtype=torch.float32).div(10)[:, None, None, None]
    return keys, images.expand(-1, 3, 4, 4).contiguous(), scores


def test_examples_rank_the_most_non_monotonic_first():
    keys, images, scores = estimates(
        {0: ([0.1, 0.2, 0.3], 0.4), 1: ([0.1, 0.5, 0.2], 0.6), 2: ([0.5, 0.4, 0.45], 0.45)}
    )
    examples = trajectory_examples(keys, images, scores, limit=2, prefix="stepwise-s0 · ")
    assert [e.title for e in examples] == [
        "stepwise-s0 · traj 1 · ode_substeps",  # up, down, up: 2 turns
        "stepwise-s0 · traj 2 · ode_substeps",  # down, up, flat: 1 turn
    ]
    first = examples[0]
    assert (first.steps, first.rewards, first.final_reward) == ([0, 1, 2], [0.1, 0.5, 0.2], 0.6)
    assert (first.turns, first.excess_variation) == (2, pytest.approx(1.1 - 0.5))
    assert first.images[:, 0, 0, 0].tolist() == pytest.approx([0.3, 0.4, 0.5])  # key rows 3..5


def write_inputs(root, cfg):
    """Two seeds of every method, GenEval of some policies, credit caches of stepwise-s0."""
    for method, (rewards, seconds, nfe) in CURVES.items():
        for seed, sign_flips in ((0, 0.2), (1, 0.4)):
            rows = rounds_rows(rewards, seconds, nfe, **{
                "credit/sign_differs_from_final": sign_flips,
                "credit/turning_point_rate": 0.1 if method == "tp_grpo" else 0.0,
            })  # fmt: skip
            write_json(root / f"reports/train/{method}-s{seed}/rounds.json", rows)
    for policy, overall in (("base", 0.4), ("flow_grpo-s0", 0.5), ("flow_grpo-s1", 0.7)):
        write_json(root / f"reports/eval/{policy}/metrics.json",
                   {"overall": overall, "per_tag": {"counting": overall}})  # fmt: skip
    # verdicts: the base misses 3 of 4 counting images for too few stars, flow_grpo-s0 one
    for policy, wrong in (("base", 3), ("flow_grpo-s0", 1)):
        verdicts = [{"tag": "counting", "prompt": "three stars", "correct": i >= wrong,
                     "reason": "expected star>=3, found 2" if i < wrong else ""}
                    for i in range(4)]  # fmt: skip
        path = root / layout.EVAL / policy / "results.jsonl"
        path.parent.mkdir(parents=True)
        path.write_text("".join(json.dumps(v) + "\n" for v in verdicts))
    write_json(root / "reports/eval/stepwise-s0/metrics.json", {"overall": 0.8, "per_tag": {}})
    run = layout.train_run(cfg, "stepwise", 0)
    (run / "advantages").mkdir(parents=True)
    advantage_rows().to_parquet(run / "advantages" / "round=0.parquet")
    keys, images, scores = estimates({0: ([0.1, 0.5, 0.2], 0.6), 1: ([0.1, 0.2, 0.3], 0.4)})
    write_scores(run / "rollouts", 1, scores)
    write_estimate_images(run / "rollouts", 1, images, keys)


def test_report_stage_writes_readme_and_figures(project):
    cfg = load_config(project / "params.yaml")
    write_inputs(project, cfg)
    run_stage("report", cfg)
    for name in FIGURES:
        assert (project / "reports/figures" / name).stat().st_size > 1000
    text = (project / "reports/README.md").read_text()
    assert "| flow_grpo | 2 | **0.60 (0.50–0.70)** | — | — | 0.60 (0.50–0.70) |" in text
    assert "| stepwise | 1 | **0.80** |" in text
    assert "| tp_grpo | 0 | — |" in text
    assert "- GenEval metrics of `stepwise-s1` (reports/eval/stepwise-s1)" in text
    assert "- cached advantages of `tp_grpo` (data/train/tp_grpo-s*/advantages)" in text
    # Cost: flow_grpo 10 s and 100 NFEs per round split 50/30/20; stepwise twice / thrice that.
    assert "| flow_grpo | 5.00 | 3.00 | 2.00 | 10.00 | 1.00× | 50 | 30 | 20 | 100 | 1.00× |" in text
    assert (
        "| stepwise | 10.00 | 6.00 | 4.00 | 20.00 | 2.00× | 150 | 90 | 60 | 300 | 3.00× |" in text
    )
    # Credit: sign flips 0.2 / 0.4 over the seeds; |signal| early/late 0.2 / 0.1.
    assert "| stepwise | 0.30 (0.20–0.40) | 0.00 (0.00–0.00) | 2.00 |" in text
    assert "| tp_grpo | 0.30 (0.20–0.40) | 0.10 (0.10–0.10) | — |" in text
    # Verdict, from the same numbers as the benchmark.
    assert "stepwise 3 = 0.33× (target ≤ 0.33: met)" in text
    assert "tp_grpo not reached in 12 rounds (target ≤ 0.33: not met)" in text
    assert "stepwise 0.80, higher than flow_grpo (one seed)" in text
    assert "**Early steps worth more?** stepwise yes (mean |step signal| of the first" in text
    # who beat the baseline is read from held-out claims, none measured here: the rounds to the
    # training reward stay a diagnostic, not the answer
    assert "Did step-wise credit beat" not in text
    assert "- Diagnostic — **Rounds to flow_grpo's final reward" in text
    assert "[flow_grpo-s0](eval/flow_grpo-s0/samples.png)" not in text  # no grid written
    # Where the misses go: one tag, so a wrong image of 4 weighs 0.25; groups without verdicts
    # (stepwise, tp_grpo) get no column
    assert "| cause | base | flow_grpo |\n|---|---|---|\n| missing star | 0.750 | 0.250 |" in text
    assert "| all misses (1 − overall) | **0.750** | **0.250** |" in text
    # both drew the one prompt right at least once: pass@4 1 for each group with verdicts
    assert "the room sharpening has): base 1.000 · flow_grpo 1.000." in text
    # The stage's MLflow child run holds the README, the figures and the headline numbers.
    client = mlflow.tracking.MlflowClient(tracking_uri(project))
    experiment = client.get_experiment_by_name(EXPERIMENT).experiment_id
    (run,) = client.search_runs([experiment], filter_string=f"tags.`{STAGE_TAG}` = 'report'")
    assert run.data.metrics["report/geneval_overall/flow_grpo"] == pytest.approx(0.6)
    assert run.data.metrics["report/final_reward/stepwise"] == pytest.approx(0.6)
    parent = client.get_run(run.data.tags["mlflow.parentRunId"])  # the pipeline run holds them too
    assert parent.data.metrics["report/geneval_overall/flow_grpo"] == pytest.approx(0.6)
    logged = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    assert logged == {"README.md", *FIGURES}


def box(x: float, y: float) -> Detection:
    """A 4-pixel detection centred at (x, y)."""
    return Detection(box=(x - 2, y - 2, x + 2, y + 2), score=0.9, color="red")


def test_failure_cause_reads_each_reason_the_judge_writes():
    star_and_cross = {"include": [{"class": "star", "count": 1}, {"class": "cross", "count": 1}]}
    blue_star = {"include": [{"class": "star", "count": 1, "color": "blue"}]}
    two_circles = {
        "include": [{"class": "circle", "count": 2}],
        "exclude": [{"class": "circle", "count": 3}],
    }
    cross_left_of_square = {
        "include": [
            {"class": "square", "count": 1},
            {"class": "cross", "count": 1, "position": ["left of", 0]},
        ]
    }
    cases = [
        (star_and_cross, {"cross": [box(8, 8)]}, "missing star"),
        (star_and_cross, {"star": [box(8, 8)]}, "missing cross"),
        (blue_star, {"star": [box(8, 8)]}, "color"),
        (two_circles, {"circle": [box(4, 4), box(14, 4), box(24, 4)]}, "too many circle"),
        (
            cross_left_of_square,
            {"square": [box(8, 16)], "cross": [box(24, 16)]},
            "horizontal flipped",
        ),
        (cross_left_of_square, {"square": [box(16, 24)], "cross": [box(16, 8)]}, "relation other"),
        (cross_left_of_square, {"cross": [box(8, 16)]}, "missing square"),  # the target first
    ]
    for meta, detections, cause in cases:
        correct, reason = evaluate(meta, detections)
        assert not correct and rep.failure_cause(reason) == cause, reason
    assert evaluate(cross_left_of_square, {"square": [box(24, 16)], "cross": [box(8, 16)]})[0]
    vertical = evaluate(
        {"include": [{"class": "square", "count": 1},
                     {"class": "cross", "count": 1, "position": ["above", 0]}]},
        {"square": [box(16, 8)], "cross": [box(16, 24)]},
    )[1]  # fmt: skip
    assert rep.failure_cause(vertical) == "vertical flipped"


def test_failure_shares_weigh_an_image_by_its_tags_size():
    def verdict(tag, reason=""):
        return {"tag": tag, "correct": not reason, "reason": reason}

    star = "expected star>=1, found 0"
    flipped = "expected cross left of target, found right of target"
    # tag a: 2 images, one missing a star; tag b: 4 images, one flipped, one missing a star
    verdicts = [verdict("a", star), verdict("a"), verdict("b", flipped), verdict("b", star),
                verdict("b"), verdict("b")]  # fmt: skip
    shares = rep.failure_shares(verdicts)
    assert list(shares) == ["missing star", "horizontal flipped"]
    assert shares["missing star"] == pytest.approx(1 / (2 * 2) + 1 / (2 * 4))
    assert shares["horizontal flipped"] == pytest.approx(1 / (2 * 4))
    overall = (1 / 2 + 2 / 4) / 2  # the mean of the tags' accuracies
    assert sum(shares.values()) == pytest.approx(1 - overall)
    assert rep.failure_shares([verdict("a")]) == {}


def test_failures_markdown_averages_seeds_and_folds_small_causes():
    shares = {
        "base": [{"missing star": 0.2, "too many circle": 0.002}],
        "flow_grpo": [{"missing star": 0.1, "color": 0.004}, {"missing star": 0.3}],
        "tp_grpo": [],
    }
    assert rep.failures_markdown(shares).splitlines() == [
        "| cause | base | flow_grpo |",
        "|---|---|---|",
        "| missing star | 0.200 | 0.200 |",
        "| other causes | 0.002 | 0.002 |",
        "| all misses (1 − overall) | **0.202** | **0.202** |",
    ]
    assert rep.failures_markdown({"base": []}).startswith("No GenEval verdicts yet")


def test_failures_markdown_orders_equal_shares_by_name():
    names = [f"missing {c}" for c in "zyxwvutsrq"]  # a set of these has no fixed order
    table = rep.failures_markdown({"base": [dict.fromkeys(names, 0.01)]}).splitlines()
    assert [row.split(" | ")[0][2:] for row in table[2:-1]] == sorted(names)


def test_pass_at_k_counts_a_prompt_right_when_any_image_is():
    def verdict(tag, prompt, correct):
        return {"tag": tag, "prompt": prompt, "correct": correct, "reason": ""}

    a, b = "counting", "position"
    # tag a: prompt p right in 1 of 2 images, q in none; tag b: r right in both
    verdicts = [verdict(a, "p", False), verdict(a, "p", True), verdict(a, "q", False),
                verdict(a, "q", False), verdict(b, "r", True), verdict(b, "r", True)]  # fmt: skip
    assert rep.pass_at_k(verdicts) == pytest.approx((1 / 2 + 1) / 2)
    # the same prompt text under two tags is two prompts
    assert rep.pass_at_k([verdict(a, "p", True), verdict(b, "p", False)]) == 0.5


def test_reach_markdown_averages_seeds_and_skips_groups_without_verdicts():
    line = rep.reach_markdown({"base": [0.9], "flow_grpo": [0.8, 1.0], "tp_grpo": []})
    assert line.endswith("the room sharpening has): base 0.900 · flow_grpo 0.900.")
    assert rep.reach_markdown({"base": []}) == ""


def test_tag_means_group_prompts_by_tag_and_keep_leading_axes():
    accuracy = np.array([[1.0, 0.0, 0.5, 0.25], [0.0, 0.0, 1.0, 1.0]])
    means = rep.tag_means(accuracy, np.array([3, 0, 3, 0]))
    assert list(means) == [0, 3]
    assert means[0] == pytest.approx([0.125, 0.5])
    assert means[3] == pytest.approx([0.75, 0.5])


def test_geneval_overall_is_the_mean_over_tags_of_prompt_means():
    accuracy = np.array([1.0, 0.0, 0.5, 0.25])  # tag 0 holds prompts 0-2, tag 1 prompt 3
    tags = np.array([0, 0, 0, 1])
    assert rep.geneval_overall(accuracy, tags) == pytest.approx((0.5 + 0.25) / 2)
    both = np.stack([accuracy, 1 - accuracy])  # leading axes are kept
    assert rep.geneval_overall(both, tags) == pytest.approx([0.375, 0.625])


def test_bootstrap_difference_hand_cases():
    tags = np.repeat([0, 1, 2], 4)
    rng = np.random.default_rng(0)
    b = np.tile(rng.uniform(size=12), (3, 1))  # three seeds that agree
    # A uniform shift of every seed and prompt: no variation left, the CI is the point
    diff, (low, high) = rep.bootstrap_difference(b + 0.1, b, tags)
    assert diff == pytest.approx(0.1) and low == pytest.approx(0.1) and high == pytest.approx(0.1)
    # identical inputs: exactly zero, and the CI covers it
    seeds = rng.uniform(size=(3, 12))
    diff, (low, high) = rep.bootstrap_difference(seeds, seeds, tags)
    assert diff == 0.0 and low <= 0.0 <= high
    # seed spread only: A's seeds sit at 0.2 and 0.4 on every prompt, B at 0 -> diff 0.3, and
    # the CI spans the seed means a redraw of two seeds can give (0.2 ... 0.4)
    a = np.repeat([[0.2], [0.4]], 12, axis=1)
    diff, (low, high) = rep.bootstrap_difference(a, np.zeros((2, 12)), tags, n_boot=4000)
    assert diff == pytest.approx(0.3)
    assert low == pytest.approx(0.2) and high == pytest.approx(0.4)
    # prompt spread only: the CI widens with the prompts' disagreement, and is reproducible
    noisy = b + rng.normal(0, 0.2, size=(1, 12))
    first = rep.bootstrap_difference(noisy, b, tags, seed=5)
    assert first == rep.bootstrap_difference(noisy, b, tags, seed=5)
    assert first[1][0] < first[0] < first[1][1]


def test_bootstrap_contrast_splits_a_factorial_into_its_effects():
    tags = np.repeat([0, 1, 2], 4)
    base = np.random.default_rng(1).uniform(0.2, 0.6, size=12)
    # 2x2 cells with additive effects (credit +0.1, SDE -0.05) and seeds that agree: each main
    # effect is exact, the interaction is 0, and no resampling can move either
    cells = [np.tile(base + credit + sde, (3, 1)) for credit in (0.0, 0.1) for sde in (0.0, -0.05)]
    credit, (low, high) = rep.bootstrap_contrast(cells, (-0.5, -0.5, 0.5, 0.5), tags)
    assert credit == pytest.approx(0.1) and (low, high) == pytest.approx((0.1, 0.1))
    sde, _ = rep.bootstrap_contrast(cells, (-0.5, 0.5, -0.5, 0.5), tags)
    assert sde == pytest.approx(-0.05)
    interaction, (low, high) = rep.bootstrap_contrast(cells, (1, -1, -1, 1), tags)
    assert interaction == pytest.approx(0.0, abs=1e-12)
    assert (low, high) == pytest.approx((0.0, 0.0), abs=1e-12)
    # one cell with weight 1 is that policy's GenEval overall; its seeds 0.2 and 0.4 on every
    # prompt bound what a redraw of two seeds can give
    single = np.repeat([[0.2], [0.4]], 12, axis=1)
    overall, (low, high) = rep.bootstrap_contrast([single], (1.0,), tags, n_boot=4000)
    assert overall == pytest.approx(0.3) and (low, high) == pytest.approx((0.2, 0.4))
    claim = rep.contrast(cells, (-0.5, -0.5, 0.5, 0.5), tags)
    assert claim["diff"] == pytest.approx(0.1) and claim["separated"]
    with pytest.raises(ValueError, match="3 weights for 4 cells"):
        rep.bootstrap_contrast(cells, (1, -1, 1), tags)


def test_claim_text():
    claim = {"diff": 0.031, "ci95": [-0.01, 0.07], "separated": False}
    assert rep.claim_text("stepwise_vs_flow_grpo", claim) == (
        "stepwise_vs_flow_grpo: +0.031 (95 % CI -0.010 to +0.070), not separated (the CI covers 0)"
    )
    assert rep.claim_text("x", None) == "x: not measured"
    at_nfe = rep.claim_text("c", claim | {"nfe": 104448.0, "nfe_ratio": 1.0461})
    assert at_nfe.endswith("covers 0); 104,448 training NFEs, 1.05× the baseline's")


def test_report_with_nothing_to_report_still_writes_every_file(project):
    report.fn(load_config(project / "params.yaml"))
    for name in FIGURES:
        assert (project / "reports/figures" / name).is_file()
    text = (project / "reports/README.md").read_text()
    assert "No GenEval metrics yet" in text
    assert "No flow_grpo run" in text
    assert "- training run `tp_grpo-s1` (no rounds.json)" in text


def brightness(cfg):
    return lambda images, metadata: images.float().mean(dim=(1, 2, 3))


def test_report_and_bench_after_real_tiny_runs(tiny_project, monkeypatch):
    """Real rounds.json, eval metrics, advantages and estimate images, as the stages write them."""
    from pipeline.rewards import REWARDS
    from stages.bench import bench
    from stages.evaluate import evaluate
    from stages.flows import train

    monkeypatch.setitem(REWARDS, "brightness", brightness)
    overrides = ["score.rewards={brightness: 1.0}", "train.seeds=[0]", "train.rounds=2"]
    overrides += ["bench.repeats=1"]
    for method in ("flow_grpo", "stepwise", "tp_grpo"):
        train(load_config(tiny_project / "params.yaml", [*overrides, f"train.method={method}"]))
    cfg = load_config(tiny_project / "params.yaml", overrides)
    evaluate.fn(cfg, policy="base")
    for method in ("flow_grpo", "tp_grpo"):
        evaluate.fn(cfg, policy=f"{method}-s0")
    report.fn(cfg)
    experiment = json.loads((tiny_project / "reports/experiment.json").read_text())
    assert experiment["seeds"] == [0] and 0 <= experiment["base"]["geneval"] <= 1
    assert set(experiment["methods"]) == {"flow_grpo", "tp_grpo"}  # stepwise: not evaluated
    flow = experiment["methods"]["flow_grpo"]
    assert flow["geneval_per_seed"] == [flow["geneval"]] and flow["nfe"] > 0
    gain = flow["gain_over_base"]  # one seed each side: the base's and the run's own verdicts
    assert gain["diff"] == pytest.approx(flow["geneval"] - experiment["base"]["geneval"])
    assert set(gain["per_tag"]) <= set(TAGS) and gain["ci95"][0] <= gain["diff"] <= gain["ci95"][1]
    assert "**Against the targets**" in (tiny_project / "reports/README.md").read_text()
    claim = experiment["claims"]["tp_grpo_vs_flow_grpo"]
    assert set(claim) == {"diff", "ci95", "separated", "nfe", "nfe_ratio"}
    assert claim["ci95"][0] <= claim["diff"] <= claim["ci95"][1]
    assert experiment["claims"]["stepwise_vs_flow_grpo"] is None
    assert experiment["claims"]["joint_vs_per_step"] is None
    result = bench.fn(cfg)
    text = (tiny_project / "reports/README.md").read_text()
    assert "| base | 1 | **" in text and "[base](eval/base/samples.png)" in text
    assert "- GenEval metrics of `stepwise-s0` (reports/eval/stepwise-s0)" in text
    assert "Diagnostic — **Rounds to flow_grpo's final reward" in text
    for method in ("flow_grpo", "stepwise", "tp_grpo"):
        assert f"| {method} | " in text.split("## Cost per round")[1]
        assert f"cached advantages of `{method}`" not in text
    assert "stored estimate images" not in text  # both step-wise methods kept some
    assert all((tiny_project / "reports/figures" / name).stat().st_size > 1000 for name in FIGURES)
    assert (tiny_project / "reports/benchmark.md").is_file()
    assert result["methods"]["stepwise"]["rounds"] == 2
    assert np.isfinite(result["rollout_efficiency"])


def test_runs_table_lists_each_run_and_each_methods_mean_with_its_t_interval():
    def evaluation(policy, method, seed, overall, counting=None):
        metrics = {"geneval/overall": overall} | (
            {"geneval/counting": counting} if counting is not None else {}
        )
        return {"policy": policy, "method": method, "seed": seed, "metrics": metrics}

    header, rows = rep.runs_table(
        [
            evaluation("base", "base", None, 0.3, 0.1),
            evaluation("flow_grpo-s0", "flow_grpo", 0, 0.4, 0.2),
            evaluation("flow_grpo-s1", "flow_grpo", 1, 0.5, 0.2),
            evaluation("flow_grpo-s2", "flow_grpo", 2, 0.6, 0.2),
            evaluation("tp_grpo-s0", "tp_grpo", 0, 0.7),  # one seed: no CI row
        ]
    )
    assert header == ["run", "seeds", "overall", "counting"]
    assert rows[0] == ["base", "1", "0.300", "0.100"]
    assert rows[4] == ["tp_grpo-s0", "1", "0.700", "—"]
    # mean 0.5, s = 0.1, t(0.975, 2) = 4.303: half-width 4.303 * 0.1 / sqrt(3) = 0.248
    assert rows[5] == ["flow_grpo (mean, 95 % CI)", "3", "0.500 [0.252, 0.748]",
                       "0.200 [0.200, 0.200]"]  # fmt: skip
    assert len(rows) == 6


def probe_frame(nfe: list[float], geneval: list[float]) -> pd.DataFrame:
    return pd.DataFrame({"rounds": range(len(nfe)), "nfe": nfe, "probe/geneval": geneval})


def test_probe_at_nfe_reads_every_curve_at_the_nfe_all_runs_reached():
    probes = {
        "flow_grpo": {
            0: probe_frame([0, 100, 200], [0.4, 0.5, 0.6]),
            1: probe_frame([0, 100, 200], [0.4, 0.4, 0.5]),
        },
        "stepwise": {0: probe_frame([0, 120, 240], [0.4, 0.52, 0.64])},  # overshoots to 240
    }
    read = rep.probe_at_nfe(probes)
    assert read["nfe"] == 200 and read["base"] == pytest.approx(0.4)
    assert read["methods"]["flow_grpo"] == pytest.approx([0.6, 0.5])
    assert read["methods"]["stepwise"] == pytest.approx([0.52 + 80 / 120 * 0.12])
    assert rep.probe_at_nfe({}) is None


def test_welch_interval_hand_case():
    # mean difference 2, standard error sqrt(2 / 2) = 1 with df = 1: t_0.975,1 = 12.706
    low, high = rep.welch_interval([1.0, 3.0], [0.0, 0.0, 0.0])
    assert (low, high) == pytest.approx((2 - 12.7062, 2 + 12.7062), abs=1e-3)
    assert rep.welch_interval([1.0], [0.0, 1.0]) is None


def test_verdict_puts_held_out_numbers_and_claims_before_the_training_reward():
    bench = {"methods": {}, "target_reward": None, "notes": []}
    probes = {
        "flow_grpo": {s: probe_frame([0, 100], [0.4, v]) for s, v in enumerate([0.5, 0.6])},
        "stepwise": {s: probe_frame([0, 100], [0.4, v]) for s, v in enumerate([0.4, 0.5])},
    }
    claims = {
        "stepwise_vs_flow_grpo": {"diff": -0.05, "ci95": [-0.09, -0.01], "separated": True},
        "tp_grpo_vs_flow_grpo": {"diff": 0.01, "ci95": [-0.02, 0.04], "separated": False},
        "joint_vs_per_step": None,
    }
    lines = rep.verdict({}, bench, {}, {}, probes, {"claims": claims})
    assert lines[1].startswith("**Held-out probe at equal compute** (100 training NFEs")
    assert "flow_grpo 0.550 (0.500–0.600) (+0.150)" in lines[1]
    assert "stepwise 0.450 (0.400–0.500) (+0.050), -0.100 vs flow_grpo, 95 % CI" in lines[1]
    assert lines[2].startswith("stepwise_vs_flow_grpo: -0.050")
    assert lines[4] == "joint_vs_per_step: not measured"
    assert "stepwise **no, worse** (-0.050" in lines[5]
    assert "tp_grpo **not separated** (+0.010" in lines[5]
    assert not any("split by test line" in line for line in lines)
    by_lines = {
        part: {"prompts": n, "claims": claims} for part, n in (("trained", 2), ("held_out", 4))
    }
    lines = rep.verdict({}, bench, {}, {}, probes, {"claims": claims, "by_test_lines": by_lines})
    assert lines[6].startswith("**The claims split by test line** (`rollout.train_on_test`")
    assert "on the trained lines (2): stepwise_vs_flow_grpo: -0.050" in lines[6]
    assert "— on the held-out lines (4): stepwise_vs_flow_grpo: -0.050" in lines[6]


def test_tag_gains_average_seeds_then_prompts_of_each_tag():
    tags = np.array([0, 0, 3])  # two single_object prompts, one counting
    a = np.array([[1.0, 0.0, 0.5], [1.0, 1.0, 0.0]])  # seed means 1, 0.5, 0.25
    b = np.array([[0.5, 0.5, 0.5]])
    assert rep.tag_gains(a, b, tags) == {TAGS[0]: pytest.approx(0.25), TAGS[3]: -0.25}


def test_targets_verdict_reads_each_gain_and_the_best_methods_seeds():
    def gain(diff, counting, position):
        per_tag = {"counting": counting, "position": position, "colors": 0.5}
        return {"diff": diff, "ci95": [diff - 0.05, diff + 0.05], "per_tag": per_tag}

    def targets_line(experiment):
        bench = {"methods": {}, "target_reward": None, "notes": []}
        lines = rep.verdict({}, bench, {}, {}, experiment=experiment)
        return next((line for line in lines if line.startswith("**Against the targets**")), None)

    flow = {"geneval_per_seed": [0.55, 0.56], "gain_over_base": gain(0.155, 0.2, 0.1)}
    tp = {"geneval_per_seed": [0.75, 0.39], "gain_over_base": gain(0.17, 0.3, -0.1)}
    experiment = {"base": {"geneval": 0.40}, "methods": {"flow_grpo": flow, "tp_grpo": tp}}
    line = targets_line(experiment)
    assert (
        "flow_grpo +0.155 (CI +0.105 to +0.205, target ≥ +0.15: met; counting +0.200, "
        "position +0.100)" in line
    )
    assert "tp_grpo +0.170 (CI +0.120 to +0.220; counting +0.300, position -0.100)" in line
    # the best gain is under +0.25 and one of its seeds is below the base
    assert line.endswith(
        "Best: tp_grpo, above the base on 1 of 2 seeds (target ≥ +0.25 with every seed above "
        "the base: not met)."
    )
    tp |= {"geneval_per_seed": [0.7, 0.66], "gain_over_base": gain(0.28, 0.3, 0.2)}
    assert targets_line(experiment).endswith("2 of 2 seeds (target ≥ +0.25 with every seed "
                                             "above the base: met).")  # fmt: skip
    flow["gain_over_base"]["diff"] = 0.149
    assert "target ≥ +0.15: not met" in targets_line(experiment)
    assert targets_line({"base": {"geneval": None}, "methods": {"tp_grpo": tp}}) is None


def test_line_colors_keep_the_methods_and_give_other_groups_colours_no_method_has():
    colors = rep.line_colors(["flow_grpo", "hybrid", "stepwise", "tweedie", "per_step"])
    assert colors["flow_grpo"] == rep.COLORS["flow_grpo"]
    assert colors["stepwise"] == rep.COLORS["stepwise"]
    others = [colors[name] for name in ("hybrid", "tweedie", "per_step")]
    assert len(set(others)) == 3 and not set(others) & set(rep.COLORS.values())

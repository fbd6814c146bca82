"""GenEval rules against hand-computed outcomes."""

import numpy as np
import pytest

from pipeline.geneval import (
    Detection,
    evaluate,
    partial_score,
    relative_position,
    summarize,
    verdicts,
)


def det(box, score=0.9, color=None):
    return Detection(box=box, score=score, color=color)


# ----------------------------------------------------------------------------- relative_position


def test_far_left_is_left_only():
    # centres (1, 1) and (11, 1): offset (-10, 0), shrink 0.1 * 4 -> dx = -9.6 / 10
    assert relative_position((0, 0, 2, 2), (10, 0, 12, 2)) == {"left of"}
    assert relative_position((10, 0, 12, 2), (0, 0, 2, 2)) == {"right of"}


def test_y_grows_downward():
    assert relative_position((0, 0, 2, 2), (0, 10, 2, 12)) == {"above"}
    assert relative_position((0, 10, 2, 12), (0, 0, 2, 2)) == {"below"}


def test_box_size_shrink_decides_diagonal():
    # offset (-4, -3), |offset| = 5. Short boxes: shrink 0.4 each axis -> (-0.72, -0.52): both.
    assert relative_position((0, 4, 2, 6), (4, 7, 6, 9)) == {"left of", "above"}
    # Tall boxes (height 10): y shrink 0.1 * 20 = 2 -> dy = -1 / 5 = -0.2: only left of.
    assert relative_position((0, 0, 2, 10), (4, 3, 6, 13)) == {"left of"}


def test_direction_cut_is_strict():
    # widths 12.5 + 12.5 -> shrink 2.5; offset -5 -> dx = -2.5 / 5 = -0.5, not < -0.5
    assert relative_position((0, 0, 12.5, 1), (5, 0, 17.5, 1)) == set()
    # one more pixel of offset: dx = -3.5 / 6 < -0.5
    assert relative_position((0, 0, 12.5, 1), (6, 0, 18.5, 1)) == {"left of"}


def test_offset_swallowed_by_shrink_gives_no_relation():
    # offset (-1, 0) < shrink 0.1 * 20 = 2
    assert relative_position((0, 0, 10, 10), (1, 0, 11, 10)) == set()
    assert relative_position((0, 0, 4, 4), (0, 0, 4, 4)) == set()


# ----------------------------------------------------------------------------- evaluate

COUNTING = {
    "tag": "counting",
    "include": [{"class": "circle", "count": 2}],
    "exclude": [{"class": "circle", "count": 3}],
}
POSITION = {
    "tag": "position",
    "include": [
        {"class": "square", "count": 1},
        {"class": "circle", "count": 1, "position": ["left of", 0]},
    ],
}
LEFT, MIDDLE, RIGHT = (0, 0, 4, 4), (12, 0, 16, 4), (24, 0, 28, 4)


def test_count_and_exclude():
    two = [det(LEFT), det(RIGHT)]
    assert evaluate(COUNTING, {"circle": two}) == (True, "")
    assert evaluate(COUNTING, {"circle": two[:1]}) == (False, "expected circle>=2, found 1")
    three = [*two, det(MIDDLE, 0.4)]
    assert evaluate(COUNTING, {"circle": three}) == (False, "expected circle<3, found 3")
    assert evaluate(COUNTING, {}) == (False, "expected circle>=2, found 0")


def test_color_checks_only_top_count_by_score():
    meta = {"tag": "colors", "include": [{"class": "circle", "count": 1, "color": "red"}]}
    top_blue = [det(LEFT, 0.9, "blue"), det(RIGHT, 0.8, "red")]
    ok, reason = evaluate(meta, {"circle": top_blue})
    assert not ok
    assert reason == "expected red circle>=1, found 0 red; and 1 blue"
    top_red = [det(LEFT, 0.9, "red"), det(RIGHT, 0.8, "blue")]
    assert evaluate(meta, {"circle": top_red}) == (True, "")


def test_position_pass_and_fail_reason():
    ok = {"square": [det(RIGHT)], "circle": [det(LEFT)]}
    assert evaluate(POSITION, ok) == (True, "")
    swapped = {"square": [det(LEFT)], "circle": [det(RIGHT)]}
    assert evaluate(POSITION, swapped) == (
        False,
        "expected circle left of target, found right of target",
    )


def test_position_missing_target_group():
    correct, reason = evaluate(POSITION, {"circle": [det(LEFT)]})
    assert not correct
    assert reason.splitlines() == [
        "expected square>=1, found 0",
        "no target for circle to be left of",
    ]


def test_position_target_group_failing_its_color_is_no_target():
    meta = {
        "tag": "position",
        "include": [
            {"class": "square", "count": 1, "color": "red"},
            {"class": "circle", "count": 1, "position": ["left of", 0]},
        ],
    }
    correct, reason = evaluate(meta, {"square": [det(RIGHT, color="blue")], "circle": [det(LEFT)]})
    assert not correct
    assert reason.splitlines()[1] == "no target for circle to be left of"


def test_position_every_object_against_every_target():
    meta = {
        "tag": "position",
        "include": [
            {"class": "square", "count": 1},
            {"class": "circle", "count": 2, "position": ["left of", 0]},
        ],
    }
    one_wrong = {"square": [det(MIDDLE)], "circle": [det(LEFT), det(RIGHT)]}
    assert not evaluate(meta, one_wrong)[0]
    both_left = {"square": [det(RIGHT)], "circle": [det(LEFT), det(MIDDLE)]}
    assert evaluate(meta, both_left) == (True, "")


def test_all_failures_are_listed():
    meta = {
        "tag": "color_attr",
        "include": [
            {"class": "circle", "count": 1, "color": "red"},
            {"class": "square", "count": 1, "color": "blue"},
        ],
    }
    correct, reason = evaluate(meta, {"circle": [det(LEFT, color="green")]})
    assert not correct
    assert reason.splitlines() == [
        "expected red circle>=1, found 0 red; and 1 green",
        "expected square>=1, found 0",
    ]


def test_verdicts_judge_a_batch_line_by_line():
    lines = [{**POSITION, "prompt": "p0"}, {**POSITION, "prompt": "p1"}]
    found = [{"square": [det(RIGHT)], "circle": [det(LEFT)]}, {"circle": [det(LEFT)]}]
    rows = verdicts(lines, found)
    assert [r["correct"] for r in rows] == [True, False]
    assert [(r["tag"], r["prompt"]) for r in rows] == [("position", "p0"), ("position", "p1")]
    assert [(r["correct"], r["reason"]) for r in rows] == [
        evaluate(m, d) for m, d in zip(lines, found, strict=True)
    ]
    with pytest.raises(ValueError):  # one detection set per line
        verdicts(lines, found[:1])


# ----------------------------------------------------------------------------- partial_score


def test_partial_score_hand_values():
    meta = {
        "tag": "color_attr",
        "include": [
            {"class": "circle", "count": 1, "color": "red"},
            {"class": "square", "count": 1, "color": "blue"},
        ],
    }
    dets = {"circle": [det(LEFT, color="red")], "square": [det(RIGHT, color="green")]}
    assert partial_score(meta, dets) == pytest.approx(3 / 4)  # counts 1, 1; colors 1, 0
    # counting: 2 of 3 found -> count check 2/3, exclude satisfied -> (2/3 + 1) / 2
    three = {
        **COUNTING,
        "include": [{"class": "circle", "count": 3}],
        "exclude": [{"class": "circle", "count": 4}],
    }
    assert partial_score(three, {"circle": [det(LEFT), det(RIGHT)]}) == pytest.approx(5 / 6)
    # position with the target missing: counts 0, 1 and no pair -> 1 / 3
    assert partial_score(POSITION, {"circle": [det(LEFT)]}) == pytest.approx(1 / 3)
    assert partial_score(POSITION, {}) == 0.0


def test_partial_score_is_one_exactly_when_correct():
    rng = np.random.default_rng(0)
    metas = [
        COUNTING,
        POSITION,
        {
            "tag": "color_attr",
            "include": [
                {"class": "circle", "count": 1, "color": "red"},
                {"class": "square", "count": 1, "color": "blue"},
            ],
        },
    ]
    n_correct = 0
    for _ in range(600):
        dets = {}
        for name in ("circle", "square"):
            n = int(rng.integers(0, 4))
            x = rng.uniform(0, 28, size=n)
            dets[name] = [
                det((xi, 0, xi + 4, 4), float(s), str(c))
                for xi, s, c in zip(
                    x, rng.uniform(size=n), rng.choice(["red", "blue"], size=n), strict=True
                )
            ]
            dets[name].sort(key=lambda d: -d.score)
        for meta in metas:
            correct, _ = evaluate(meta, dets)
            score = partial_score(meta, dets)
            assert 0.0 <= score <= 1.0
            assert (score == 1.0) == correct
            n_correct += correct
    assert n_correct > 20  # both branches exercised


# ----------------------------------------------------------------------------- summarize


def test_summarize_is_unweighted_mean_over_tags():
    rows = [{"tag": "counting", "correct": c} for c in (True, False, False, False)]
    rows += [{"tag": "colors", "correct": True}]
    summary = summarize(rows)
    assert summary["per_tag"] == {"counting": 0.25, "colors": 1.0}
    assert summary["n_per_tag"] == {"counting": 4, "colors": 1}
    assert summary["overall"] == pytest.approx(0.625)  # not 2 / 5


def test_summarize_errors():
    with pytest.raises(ValueError, match="no results"):
        summarize([])
    with pytest.raises(ValueError, match="unknown tag 'shapes'"):
        summarize([{"tag": "shapes", "correct": True}])

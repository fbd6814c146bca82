"""The comparison report: markdown tables and PNG figures from the pipeline's numbers.

Pure functions: data in, a markdown string or a PNG file out (written atomically). Missing data
is shown as "—" in tables and as a "no data" note in figures, never an error. Spreads are over
seeds: a cell reads `mean (min–max)`; two methods differ "beyond seed spread" only when their
min–max ranges do not overlap.
"""

from __future__ import annotations

import itertools
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch import Tensor

from pipeline.bench import BASELINE, CHALLENGERS, PHASES, TARGETS, Runs, seed_matrix
from pipeline.geneval import RELATIONS, TAGS, summarize
from pipeline.io import atomic_path

COLORS = {"base": "#7f7f7f", "flow_grpo": "#1f77b4", "stepwise": "#ff7f0e", "tp_grpo": "#2ca02c"}
# for groups outside COLORS (ablations, search cells): matplotlib's tab10 less COLORS' colours
SPARE_COLORS = ("#d62728", "#9467bd", "#8c564b", "#e377c2", "#bcbd22", "#17becf")
DASH = "—"


@dataclass(frozen=True)
class Spread:
    """Mean and min–max of a quantity over seeds (n = how many values)."""

    mean: float
    low: float
    high: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread | None:
        values = [float(v) for v in values if v is not None and math.isfinite(float(v))]
        if not values:
            return None
        return cls(float(np.mean(values)), min(values), max(values), len(values))

    def text(self, digits: int = 2) -> str:
        if self.n == 1:
            return f"{self.mean:.{digits}f}"
        return f"{self.mean:.{digits}f} ({self.low:.{digits}f}–{self.high:.{digits}f})"


def compare(a: Spread, b: Spread, name: str) -> str:
    """How `a` stands against `b` (called `name`): higher/lower beyond seed spread, or within it.

    With a single value on either side there is no spread to judge by: the means decide and the
    phrase says "(one seed)".
    """
    if a.n == 1 or b.n == 1:
        side = "higher than" if a.mean > b.mean else "lower than" if a.mean < b.mean else "equal to"
        return f"{side} {name} (one seed)"
    if a.low > b.high:
        return f"higher than {name} beyond seed spread"
    if a.high < b.low:
        return f"lower than {name} beyond seed spread"
    return f"within seed spread of {name}"


def _text(spread: Spread | None, digits: int = 2) -> str:
    return DASH if spread is None else spread.text(digits)


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: Path) -> None:
    plt = _pyplot()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)


def _no_data(ax, message: str) -> None:
    ax.text(0.5, 0.5, message, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


# ---------------------------------------------------------------------------------------------
# GenEval


GenevalTable = dict[str, dict[str, Spread | None]]  # policy group -> column -> spread


def geneval_table(evals: Mapping[str, Sequence[Mapping]]) -> GenevalTable:
    """Per group (base, each method), `overall` and each tag as a spread over its seeds.

    evals: group -> the `reports/eval/<policy>/metrics.json` dicts of its seeds (may be empty).
    """
    table: GenevalTable = {}
    for group, metrics in evals.items():
        row = {"overall": Spread.of([m["overall"] for m in metrics if "overall" in m])}
        for tag in TAGS:
            row[tag] = Spread.of(
                [m["per_tag"][tag] for m in metrics if tag in m.get("per_tag", {})]
            )
        table[group] = row
    return table


def geneval_markdown(table: GenevalTable) -> str:
    columns = ["overall", *TAGS]
    lines = [
        "| policy | seeds | " + " | ".join(columns) + " |",
        "|---|---|" + "---|" * len(columns),
    ]
    for group, row in table.items():
        seeds = max((s.n for s in row.values() if s is not None), default=0)
        cells = [_text(row[c]) for c in columns]
        cells[0] = f"**{cells[0]}**" if row["overall"] is not None else DASH
        lines.append(f"| {group} | {seeds} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_geneval(table: GenevalTable, path: Path) -> None:
    """Grouped bars: one group of bars per column (overall, tags), one bar per policy group,
    min–max over seeds as error bars."""
    plt = _pyplot()
    columns = ["overall", *TAGS]
    fig, ax = plt.subplots(figsize=(10, 3.6))
    groups = [g for g, row in table.items() if any(s is not None for s in row.values())]
    if not groups:
        _no_data(ax, "no GenEval metrics (run `creditflow evaluate`)")
        _save(fig, path)
        return
    width = 0.8 / len(groups)
    x = np.arange(len(columns))
    for i, group in enumerate(groups):
        spreads = [table[group][c] for c in columns]
        means = [s.mean if s else np.nan for s in spreads]
        errors = [
            [s.mean - s.low if s else 0 for s in spreads],
            [s.high - s.mean if s else 0 for s in spreads],
        ]
        ax.bar(x + (i - (len(groups) - 1) / 2) * width, means, width, yerr=errors, capsize=2,
               label=group, color=COLORS.get(group), error_kw={"elinewidth": 0.8})  # fmt: skip
    ax.set_xticks(x, [c.replace("_", " ") for c in columns])
    ax.set_ylim(0, 1.15)  # headroom above 1 keeps the legend off the bars
    ax.set_yticks(np.linspace(0, 1, 6))
    ax.set_ylabel("GenEval accuracy")
    ax.set_title("GenEval on the test prompts (bars: mean over seeds; whiskers: min–max)")
    ax.legend(ncols=len(groups), fontsize=8, loc="upper center")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    _save(fig, path)


# ---------------------------------------------------------------------------------------------
# learning curves


def plot_learning_curves(runs: Runs, path: Path, target: float | None = None) -> None:
    """Training reward vs round and vs cumulative training seconds, and training accuracy vs
    round: per method the mean over seeds, shaded min–max over seeds.

    Round r's reward comes from the policy after r updates, so it is plotted at the seconds of
    rounds 0..r-1 (mean over seeds). `target` (flow_grpo's final smoothed reward) is dashed.
    """
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    panels = [
        (axes[0], "reward/mean", "round", "training reward"),
        (axes[1], "reward/mean", "seconds", "training reward"),
        (axes[2], "train/accuracy", "round", "training GenEval accuracy"),
    ]
    for ax, column, x_kind, y_label in panels:
        drawn = False
        for method, seeds in runs.items():
            values = seed_matrix(seeds, column)  # (S, R)
            if values is None:
                continue
            x = np.arange(values.shape[1])
            if x_kind == "seconds":
                round_s = seed_matrix(seeds, "time/round_s")
                if round_s is None:
                    continue
                x = np.concatenate([[0.0], np.cumsum(round_s, axis=1).mean(axis=0)[:-1]])
            color = COLORS.get(method)
            label = f"{method} ({values.shape[0]} seed{'s' * (values.shape[0] > 1)})"
            ax.plot(x, values.mean(axis=0), color=color, label=label, lw=1.6)
            ax.fill_between(x, values.min(axis=0), values.max(axis=0), color=color, alpha=0.2)
            drawn = True
        if not drawn:
            _no_data(ax, f"no `{column}` logged")
            continue
        if target is not None and column == "reward/mean":
            ax.axhline(target, color=COLORS[BASELINE], ls="--", lw=0.8, label="flow_grpo final")
        ax.set_xlabel("round" if x_kind == "round" else "training seconds (mean over seeds)")
        ax.set_ylabel(y_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle("Learning curves (line: mean over seeds, band: min–max)", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def t_interval(values: np.ndarray, confidence: float = 0.95) -> tuple[np.ndarray, np.ndarray]:
    """Student-t confidence interval of the mean over axis 0: values (S, ...) -> (low, high),
    each (...); with one seed both equal the value (no interval)."""
    from scipy import stats

    values = np.asarray(values, dtype=np.float64)
    mean, n = values.mean(axis=0), values.shape[0]
    if n < 2:
        return mean, mean
    half = stats.t.ppf(0.5 + confidence / 2, n - 1) * values.std(axis=0, ddof=1) / math.sqrt(n)
    return mean - half, mean + half


def runs_table(evaluations: Sequence[Mapping]) -> tuple[list[str], list[list[str]]]:
    """The terminal table of `creditflow runs`: (header, rows). A row per evaluated policy
    (`pipeline.tracking.evaluation_runs`), then one per method with several seeds: the mean
    over seeds and its 95 % t-interval, per GenEval tag and overall."""
    keys = sorted({k for e in evaluations for k in e["metrics"]} - {"geneval/overall"})
    keys = ["geneval/overall", *keys]
    header = ["run", "seeds", *(k.removeprefix("geneval/") for k in keys)]
    rows = [[e["policy"], "1", *(_score(e["metrics"].get(k)) for k in keys)] for e in evaluations]
    methods = sorted({e["method"] for e in evaluations if e["seed"] is not None})
    for method in methods:
        seeds = [e for e in evaluations if e["method"] == method and e["seed"] is not None]
        if len(seeds) < 2:
            continue
        cells = []
        for key in keys:
            values = np.array([e["metrics"].get(key, np.nan) for e in seeds])
            low, high = t_interval(values)
            cells.append(f"{values.mean():.3f} [{low:.3f}, {high:.3f}]")
        rows.append([f"{method} (mean, 95 % CI)", str(len(seeds)), *cells])
    return header, rows


def _score(value: float | None) -> str:
    return "—" if value is None else f"{value:.3f}"


def line_colors(names: Sequence[str]) -> dict[str, str]:
    """A colour per name: COLORS' for the methods and the base, the spare colours in turn for
    every other name, so that no two of up to six such groups share a method's colour."""
    spare = itertools.cycle(SPARE_COLORS)
    return {name: COLORS.get(name) or next(spare) for name in names}


def plot_probe_curves(probes: Runs, path: Path) -> None:
    """Held-out probe GenEval (`probe/geneval`, test prompts, evaluation sampler) against rounds,
    cumulative training NFEs and seconds: per method the mean over seeds, shaded its 95 %
    t-interval over seeds. NFEs and seconds are the mean over seeds at each probe."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), sharey=True)
    for ax, x_column, x_label in zip(
        axes,
        ("rounds", "nfe", "seconds"),
        ("rounds trained", "training NFEs", "training seconds"),
        strict=True,
    ):
        drawn, colors = False, line_colors(list(probes))
        for method, seeds in probes.items():
            values = seed_matrix(seeds, "probe/geneval")  # (S, P)
            x = seed_matrix(seeds, x_column)
            if values is None or x is None:
                continue
            low, high = t_interval(values)
            label = f"{method} ({values.shape[0]} seed{'s' * (values.shape[0] > 1)})"
            color = colors[method]
            ax.plot(x.mean(axis=0), values.mean(axis=0), color=color, label=label, lw=1.6)
            ax.fill_between(x.mean(axis=0), low, high, color=color, alpha=0.2)
            drawn = True
        if not drawn:
            _no_data(ax, "no probe curve (train.eval_every = 0?)")
            continue
        ax.set_xlabel(x_label)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    axes[0].set_ylabel("held-out GenEval (probe)")
    fig.suptitle("Held-out learning curves (line: mean over seeds, band: 95 % CI)", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def probe_at_nfe(probes: Runs) -> dict | None:
    """Every run's held-out probe (`probe/geneval`) read at one training-NFE count: the most NFEs
    that every run reached, each run's curve linearly interpolated between its probes — the
    methods compared at equal compute. Returns {"nfe": n, "base": the probe before any training
    (mean over runs), "methods": {method: [value per seed]}}, or None without probe curves."""
    curves = {
        (method, seed): (frame["nfe"].to_numpy(np.float64), frame["probe/geneval"].to_numpy())
        for method, seeds in probes.items()
        for seed, frame in seeds.items()
        if {"nfe", "probe/geneval"} <= set(frame) and len(frame)
    }
    if not curves:
        return None
    nfe = min(float(x[-1]) for x, _ in curves.values())
    out = {"nfe": nfe, "base": float(np.mean([y[0] for _, y in curves.values()])), "methods": {}}
    for (method, _), (x, y) in curves.items():
        out["methods"].setdefault(method, []).append(float(np.interp(nfe, x, y)))
    return out


def welch_interval(a: Sequence[float], b: Sequence[float]) -> tuple[float, float] | None:
    """95 % Welch t-interval of mean(a) − mean(b) (independent seeds); None below 2 per side."""
    from scipy import stats

    if len(a) < 2 or len(b) < 2:
        return None
    ci = stats.ttest_ind(a, b, equal_var=False).confidence_interval(0.95)
    return float(ci.low), float(ci.high)


def _probe_verdict(probes: Runs) -> str:
    read = probe_at_nfe(probes)
    if read is None or read["nfe"] <= 0:
        return ""
    values = read["methods"]
    parts = []
    for method, per_seed in values.items():
        text = f"{method} {Spread.of(per_seed).text(3)} ({np.mean(per_seed) - read['base']:+.3f})"
        if method in CHALLENGERS and BASELINE in values:
            diff = np.mean(per_seed) - np.mean(values[BASELINE])
            ci = welch_interval(per_seed, values[BASELINE])
            interval = "" if ci is None else f", 95 % CI {ci[0]:+.3f} to {ci[1]:+.3f}"
            text += f", {diff:+.3f} vs {BASELINE}{interval}"
        parts.append(text)
    return (
        f"**Held-out probe at equal compute** ({read['nfe']:,.0f} training NFEs, the most every "
        f"run reached; probe GenEval interpolated between readings, mean (min–max) over seeds, "
        f"change from the untrained {read['base']:.3f}): " + "; ".join(parts) + "."
    )


#: The decisive experiment's targets: held-out GenEval gain over the base (mean over seeds) of the
#: baseline and of the best method (whose every seed must also beat the base), and the tags that
#: must rise.
GAIN_TARGETS = {"baseline": 0.15, "best": 0.25}
RISING_TAGS = ("counting", "position")


def _targets_verdict(experiment: Mapping) -> str:
    """The gains over the base (`experiment.json`'s `methods.<m>.gain_over_base`) read against
    `GAIN_TARGETS`; empty without a base evaluation or an evaluated method."""
    base = experiment.get("base", {}).get("geneval")
    methods = {m: v for m, v in experiment.get("methods", {}).items() if "gain_over_base" in v}
    if base is None or not methods:
        return ""
    parts = []
    for method, values in methods.items():
        gain = values["gain_over_base"]
        low, high = gain["ci95"]
        goal = ""
        if method == BASELINE:
            target = GAIN_TARGETS["baseline"]
            goal = f", target ≥ {target:+.2f}: {_met(gain['diff'] >= target)}"
        tags = ", ".join(
            f"{t} {gain['per_tag'][t]:+.3f}" for t in RISING_TAGS if t in gain["per_tag"]
        )
        parts.append(f"{method} {gain['diff']:+.3f} (CI {low:+.3f} to {high:+.3f}{goal}; {tags})")
    best = max(methods, key=lambda m: methods[m]["gain_over_base"]["diff"])
    per_seed = methods[best]["geneval_per_seed"]
    above = sum(value > base for value in per_seed)
    target = GAIN_TARGETS["best"]
    met = methods[best]["gain_over_base"]["diff"] >= target and above == len(per_seed)
    return (
        "**Against the targets** (held-out GenEval gain over the base, mean over seeds, 95 % "
        "bootstrap CI over seeds and prompts; counting and position should rise): "
        + "; ".join(parts)
        + f". Best: {best}, above the base on {above} of {len(per_seed)} seeds (target ≥ "
        f"{target:+.2f} with every seed above the base: {_met(met)})."
    )


def _claims_verdict(claims: Mapping[str, Mapping | None]) -> str:
    """Did step-wise credit beat the baseline, read from the equal-NFE evaluation claims."""
    parts = []
    for method in CHALLENGERS:
        claim = claims.get(f"{method}_vs_{BASELINE}")
        if claim is None:
            continue
        low, high = claim["ci95"]
        answer = "yes" if low > 0 else "no, worse" if high < 0 else "not separated"
        parts.append(f"{method} **{answer}** ({claim['diff']:+.3f}, CI {low:+.3f} to {high:+.3f})")
    if not parts:
        return ""
    return (
        "**Did step-wise credit beat the final-reward baseline** (the claim of Savani et al. 2026 "
        "and Tong et al. 2026) on held-out GenEval at equal NFE? " + "; ".join(parts) + "."
    )


def _test_lines_verdict(parts: Mapping[str, Mapping]) -> str:
    """Under `rollout.train_on_test` (experiment.json's `by_test_lines`): each claim on the
    trained test lines and on the held-out others; empty otherwise."""
    if not parts:
        return ""
    texts = [
        f"on the {part.replace('_', '-')} lines ({values['prompts']}): "
        + "; ".join(claim_text(name, claim) for name, claim in values["claims"].items())
        for part, values in parts.items()
    ]
    return (
        "**The claims split by test line** (`rollout.train_on_test`: some test lines were "
        "trained on every round, so only the others are held out): " + " — ".join(texts) + "."
    )


# ---------------------------------------------------------------------------------------------
# where the misses go

_TOO_FEW = re.compile(r"expected (?:\w+ )?(\w+)>=\d+, found \d+")  # "[color ]class>=n"
_TOO_MANY = re.compile(r"expected (\w+)<\d+, found \d+")
_PLACED = re.compile(rf"expected \w+ ({'|'.join(RELATIONS)}) target, found (.+) target")
AXES = {"left of": "horizontal", "right of": "horizontal", "above": "vertical", "below": "vertical"}
MIN_FAILURE_SHARE = 0.005  # causes below this in every policy are summed into "other causes"


def failure_cause(reason: str) -> str:
    """The first failure a wrong verdict's reason names (`geneval.evaluate` writes one line per
    failed clause, in clause order): `missing <class>` (fewer found than asked), `color` (found,
    not in the asked color), `too many <class>` (counting's upper bound), `<axis> flipped`
    (both there, on the asked axis the wrong way round), else `relation other`."""
    line = reason.splitlines()[0] if reason else ""
    if match := _TOO_FEW.match(line):
        # "expected red star>=1, found 0 red; and 1 blue": the star is there, its color is not
        return "color" if "; and" in line else f"missing {match.group(1)}"
    if match := _TOO_MANY.match(line):
        return f"too many {match.group(1)}"
    if (match := _PLACED.match(line)) and match.group(2) in AXES:
        asked, found = match.groups()
        if AXES[asked] == AXES[found]:
            return f"{AXES[asked]} flipped"
    return "relation other"


def failure_shares(verdicts: Sequence[Mapping]) -> dict[str, float]:
    """cause -> the GenEval overall its wrong images would add if they were right, for one
    policy's protocol verdicts ({tag, correct, reason} each). Overall is the mean of the tags'
    accuracies, so an image weighs 1 / (tags x its tag's images); the shares sum to
    1 - overall. Causes in decreasing share."""
    images = Counter(v["tag"] for v in verdicts)
    shares: Counter = Counter()
    for v in verdicts:
        if not v["correct"]:
            shares[failure_cause(v["reason"])] += 1.0 / (len(images) * images[v["tag"]])
    return dict(shares.most_common())


def failures_markdown(shares: Mapping[str, Sequence[Mapping[str, float]]]) -> str:
    """Causes (rows, in decreasing share of the first policy group) x policy groups (columns:
    the mean over the group's seeds of `failure_shares`); causes under MIN_FAILURE_SHARE in
    every group are summed into one row."""
    means = {group: _mean_over_seeds(seeds) for group, seeds in shares.items() if seeds}
    if not means:
        return "No GenEval verdicts yet (`data/eval/<policy>/results.jsonl`)."
    first = next(iter(means.values()))
    # by name among equal shares: set order changes between processes, the report must not
    causes = sorted({c for m in means.values() for c in m}, key=lambda c: (-first.get(c, 0.0), c))
    shown = [c for c in causes if max(m.get(c, 0.0) for m in means.values()) >= MIN_FAILURE_SHARE]
    rows = [(c, [m.get(c, 0.0) for m in means.values()]) for c in shown]
    if rest := [c for c in causes if c not in shown]:
        rows.append(("other causes", [sum(m.get(c, 0.0) for c in rest) for m in means.values()]))
    lines = ["| cause | " + " | ".join(means) + " |", "|---|" + "---|" * len(means)]
    lines += [f"| {c} | " + " | ".join(f"{v:.3f}" for v in values) + " |" for c, values in rows]
    totals = " | ".join(f"**{sum(m.values()):.3f}**" for m in means.values())
    return "\n".join([*lines, f"| all misses (1 − overall) | {totals} |"])


def pass_at_k(verdicts: Sequence[Mapping]) -> float:
    """GenEval overall with a prompt counted right when any of its k images is right (pass@k),
    from one policy's protocol verdicts ({tag, prompt, correct} each): what the policy would
    score if it drew every prompt as it does from its luckiest x_T among k, the room that
    sharpening what it already draws (what RL fine-tuning does) has."""
    right: dict[tuple[str, str], bool] = {}
    for v in verdicts:
        key = (v["tag"], v["prompt"])
        right[key] = right.get(key, False) or bool(v["correct"])
    return summarize([{"tag": tag, "correct": r} for (tag, _), r in right.items()])["overall"]


def reach_markdown(reach: Mapping[str, Sequence[float]]) -> str:
    """One line: each policy group's `pass_at_k`, mean over its seeds (groups without
    verdicts left out)."""
    cells = [f"{group} {np.mean(values):.3f}" for group, values in reach.items() if values]
    if not cells:
        return ""
    return (
        "Right in at least one of a prompt's images (pass@k over the protocol's k images per"
        " prompt, GenEval-weighted; the score of drawing every prompt as from its luckiest"
        " x_T, the room sharpening has): " + " · ".join(cells) + "."
    )


def _mean_over_seeds(seeds: Sequence[Mapping[str, float]]) -> dict[str, float]:
    causes = {c for shares in seeds for c in shares}
    return {c: float(np.mean([shares.get(c, 0.0) for shares in seeds])) for c in causes}


# ---------------------------------------------------------------------------------------------
# claims with uncertainty


def tag_means(accuracy: np.ndarray, tags: np.ndarray) -> dict[int, np.ndarray]:
    """Each tag's mean over its prompts: {tag id: (...)}, in increasing tag id.
    accuracy: (..., P) per-prompt accuracy; tags: (P,) tag ids."""
    return {int(t): accuracy[..., tags == t].mean(axis=-1) for t in np.unique(tags)}


def geneval_overall(accuracy: np.ndarray, tags: np.ndarray) -> np.ndarray:
    """GenEval overall from per-prompt accuracy: the mean over tags of the mean over the tag's
    prompts. accuracy: (..., P); tags: (P,) tag ids -> (...)."""
    return np.stack(list(tag_means(accuracy, tags).values())).mean(0)


def bootstrap_contrast(
    cells: Sequence[np.ndarray],
    weights: Sequence[float],
    tags: np.ndarray,
    *,
    n_boot: int = 2000,
    seed: int = 0,
) -> tuple[float, tuple[float, float]]:
    """Σ_c w_c · GenEval overall of cell c, with a 95 % percentile-bootstrap CI over seeds and
    prompts.

    cells: per policy (a method, or a cell of a factorial design) an (S_c, P) per-seed per-prompt
    accuracy on the same P prompts (same order); weights: one per cell, e.g. (1, −1) for A minus
    B; tags: (P,) each prompt's tag id. The point estimate averages over seeds. Each replicate
    redraws each cell's seeds (independent training runs) and, within each tag, the prompts, the
    same for every cell (a paired comparison), so the CI covers both the seed-to-seed and the
    prompt-to-prompt variation. GenEval overall is linear in the per-prompt accuracy, so a
    replicate scores the weighted sum of the cells' per-prompt means.
    """
    cells = [np.asarray(cell, float) for cell in cells]
    if len(weights) != len(cells):
        raise ValueError(f"{len(weights)} weights for {len(cells)} cells")
    tags = np.asarray(tags)
    point = float(
        sum(w * geneval_overall(cell.mean(0), tags) for w, cell in zip(weights, cells, strict=True))
    )
    rng = np.random.default_rng(seed)
    by_tag = [np.flatnonzero(tags == t) for t in np.unique(tags)]
    replicates = np.empty(n_boot)
    for i in range(n_boot):
        prompts = np.concatenate([rng.choice(idx, size=idx.size) for idx in by_tag])
        combined = sum(
            w * cell[rng.integers(len(cell), size=len(cell))][:, prompts].mean(0)
            for w, cell in zip(weights, cells, strict=True)
        )
        replicates[i] = geneval_overall(combined, tags[prompts])
    low, high = np.percentile(replicates, [2.5, 97.5])
    return point, (float(low), float(high))


def bootstrap_difference(
    a: np.ndarray, b: np.ndarray, tags: np.ndarray, *, n_boot: int = 2000, seed: int = 0
) -> tuple[float, tuple[float, float]]:
    """GenEval overall of A minus B with its 95 % bootstrap CI: `bootstrap_contrast` of the two
    (a: (S_a, P), b: (S_b, P), tags: (P,))."""
    return bootstrap_contrast([a, b], (1.0, -1.0), tags, n_boot=n_boot, seed=seed)


def contrast(cells: Sequence[np.ndarray], weights: Sequence[float], tags: np.ndarray) -> dict:
    """`bootstrap_contrast` as a JSON-ready dict: {"diff", "ci95", "separated" (the CI excludes
    0)}."""
    diff, ci = bootstrap_contrast(cells, weights, tags)
    return {"diff": diff, "ci95": list(ci), "separated": not ci[0] <= 0.0 <= ci[1]}


def difference(a: np.ndarray, b: np.ndarray, tags: np.ndarray) -> dict:
    """A's GenEval overall minus B's as a JSON-ready dict (`contrast`); a: (S_a, P), b: (S_b, P),
    tags: (P,) as in `bootstrap_difference`."""
    return contrast([a, b], (1.0, -1.0), tags)


def tag_gains(a: np.ndarray, b: np.ndarray, tags: np.ndarray) -> dict[str, float]:
    """Per-tag accuracy of A minus B, each averaged over its seeds: {tag name: difference}.
    a: (S_a, P), b: (S_b, P) per-seed per-prompt accuracy; tags: (P,) ids into `TAGS`."""
    gap = np.asarray(a, float).mean(0) - np.asarray(b, float).mean(0)
    return {TAGS[t]: float(mean) for t, mean in tag_means(gap, np.asarray(tags)).items()}


def claim_text(name: str, claim: Mapping | None) -> str:
    """One line: the difference, its CI, whether the CI excludes 0 and, when the claim has them,
    the compute it was measured at (the challenger's NFEs over the baseline's)."""
    if claim is None:
        return f"{name}: not measured"
    low, high = claim["ci95"]
    word = "separated" if claim["separated"] else "not separated (the CI covers 0)"
    text = f"{name}: {claim['diff']:+.3f} (95 % CI {low:+.3f} to {high:+.3f}), {word}"
    if claim.get("nfe_ratio"):
        text += f"; {claim['nfe']:,.0f} training NFEs, {claim['nfe_ratio']:.2f}× the baseline's"
    return text


# ---------------------------------------------------------------------------------------------
# credit diagnostics


def credit_profile(advantages: pd.DataFrame) -> pd.DataFrame:
    """Per trained step: mean |step signal|, turning-point frequency, and the share of
    (trajectory, step) pairs whose advantage sign differs from the final-reward advantage.

    advantages: rows of `data/train/<run>/advantages/round=<r>.parquet` (any rounds and seeds
    concatenated): step, step_reward, turning_point, advantage, final_advantage.
    Returns a frame indexed by step with columns abs_signal, turning_point_rate, sign_differs.
    """
    frame = advantages.assign(
        abs_signal=advantages.step_reward.abs(),
        turning_point_rate=advantages.turning_point.astype(float),
        sign_differs=(np.sign(advantages.advantage) != np.sign(advantages.final_advantage)).astype(
            float
        ),
    )
    return frame.groupby("step")[["abs_signal", "turning_point_rate", "sign_differs"]].mean()


def early_late_ratio(profile: pd.DataFrame) -> float | None:
    """Mean |step signal| of the first half of the trained steps over that of the last half
    (the middle step of an odd count is left out); None with fewer than 2 steps or a zero."""
    signal = profile.sort_index().abs_signal.to_numpy()
    half = signal.size // 2
    if half == 0 or signal[-half:].mean() == 0:
        return None
    return float(signal[:half].mean() / signal[-half:].mean())


def plot_credit(profiles: Mapping[str, pd.DataFrame], path: Path) -> None:
    """Three panels over the trained steps: mean |step signal| (step-wise methods), the
    turning-point frequency (tp_grpo), the share of advantage signs differing from the final."""
    plt = _pyplot()
    from matplotlib.ticker import MaxNLocator

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.4))
    panels = [
        (axes[0], "abs_signal", "mean |step signal|", CHALLENGERS),
        (axes[1], "turning_point_rate", "turning-point frequency", ("tp_grpo",)),
        (axes[2], "sign_differs", "advantage sign ≠ final-reward sign", None),
    ]
    for ax, column, title, methods in panels:
        shown = [m for m in profiles if methods is None or m in methods]
        if not shown:
            _no_data(ax, "no cached advantages")
        for method in shown:
            profile = profiles[method]
            ax.plot(profile.index, profile[column], "o-", color=COLORS.get(method), label=method)
        ax.set_title(title, fontsize=9)
        if shown:
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.set_xlabel("step (0 = pure noise)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
    axes[0].text(0.01, 0.01, "flow_grpo credits R(x0) to every step: flat by construction",
                 transform=axes[0].transAxes, fontsize=6, color="0.4")  # fmt: skip
    fig.suptitle("Credit diagnostics (all cached rounds and seeds)", fontsize=10)
    fig.tight_layout()
    _save(fig, path)


def credit_markdown(runs: Runs, profiles: Mapping[str, pd.DataFrame]) -> str:
    """Per method: sign differences and turning points (rounds.json means, spread over seeds)
    and the early/late |step signal| ratio (cached advantages)."""
    rates = credit_rates(runs)
    lines = [
        "| method | advantage sign ≠ final (share of steps) | turning points (share of steps) "
        "| mean \\|step signal\\|, first half / last half of the steps |",
        "|---|---|---|---|",
    ]
    for method in dict.fromkeys([*runs, *profiles]):
        own = rates.get(method, {})
        ratio = early_late_ratio(profiles[method]) if method in profiles else None
        shown = DASH if ratio is None or method == BASELINE else f"{ratio:.2f}"
        lines.append(
            f"| {method} | {_text(own.get('sign_differs'))} | {_text(own.get('turning_points'))} "
            f"| {shown} |"
        )
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------
# non-monotonic intermediate rewards


@dataclass
class Example:
    """One trajectory's decoded estimates along its steps and their rewards.

    images: (K, 3, H, W) in [0, 1]; steps, rewards: K state indices and rewards of the estimates;
    final_reward: R(x0) of the trajectory's final image.
    """

    title: str
    steps: list[int]
    rewards: list[float]
    images: Tensor
    final_reward: float

    @property
    def turns(self) -> int:
        """Direction changes of the reward sequence (estimates, then the final reward)."""
        moves = np.sign(np.diff([*self.rewards, self.final_reward]))
        moves = moves[moves != 0]
        return int((moves[1:] != moves[:-1]).sum())

    @property
    def excess_variation(self) -> float:
        """Total variation of the reward path minus its net change: 0 when monotonic."""
        path = np.array([*self.rewards, self.final_reward])
        return float(np.abs(np.diff(path)).sum() - abs(path[-1] - path[0]))


def trajectory_examples(
    keys: pd.DataFrame, images: Tensor, scores: pd.DataFrame, *, limit: int = 3, prefix: str = ""
) -> list[Example]:
    """The `limit` most non-monotonic trajectories among the stored estimates of one round.

    keys: (M rows) trajectory, step, estimator of each image in images (M, 3, H, W); scores: the
    round's score table (trajectory, step, estimator, reward, value); the "mix" reward is shown.
    Ranked by direction changes, then by excess variation.
    """
    mix = scores[scores.reward == "mix"]
    value = mix.set_index(["trajectory", "step", "estimator"]).value
    final = mix[mix.estimator == "final"].set_index("trajectory").value
    examples = []
    keys = keys.reset_index(drop=True)
    for (trajectory, estimator), rows in keys.groupby(["trajectory", "estimator"], sort=True):
        rows = rows.sort_values("step")
        lookup = [(trajectory, step, estimator) for step in rows.step]
        if trajectory not in final.index or not all(k in value.index for k in lookup):
            continue
        examples.append(
            Example(
                title=f"{prefix}traj {trajectory} · {estimator}",
                steps=[int(s) for s in rows.step],
                rewards=[float(value[k]) for k in lookup],
                images=images[torch.tensor(rows.index.tolist())],
                final_reward=float(final[trajectory]),
            )
        )
    examples.sort(key=lambda e: (-e.turns, -e.excess_variation))
    return examples[:limit]


def plot_examples(examples: Sequence[Example], path: Path) -> None:
    """One row per trajectory: its decoded estimates along the steps, the reward under each (red
    where it fell from the previous estimate), the final reward R(x0) at the end of the row."""
    plt = _pyplot()
    if not examples:
        fig, ax = plt.subplots(figsize=(6, 1.5))
        _no_data(ax, "no stored estimate images (stepwise / tp_grpo rounds)")
        _save(fig, path)
        return
    columns = max(len(e.steps) for e in examples)
    fig, axes = plt.subplots(
        len(examples), columns, figsize=(1.3 * columns + 1.2, 1.75 * len(examples)), squeeze=False
    )
    for row, example in zip(axes, examples, strict=True):
        for i, ax in enumerate(row):
            ax.set_xticks([])
            ax.set_yticks([])
            if i >= len(example.steps):
                ax.axis("off")
                continue
            ax.imshow(
                example.images[i].permute(1, 2, 0).clamp(0, 1).numpy(), interpolation="nearest"
            )
            fell = i > 0 and example.rewards[i] < example.rewards[i - 1]
            ax.set_xlabel(f"step {example.steps[i]}\nr = {example.rewards[i]:.3f}", fontsize=7,
                          color="tab:red" if fell else "black")  # fmt: skip
        row[0].set_ylabel(example.title.replace(" · ", "\n"), fontsize=7)
        last = row[len(example.steps) - 1]
        turns = f"{example.turns} turn{'s' * (example.turns != 1)}"
        fell = example.final_reward < example.rewards[-1]
        last.text(
            1.08,
            0.5,
            f"R(x0)\n= {example.final_reward:.3f}\n({turns})",
            transform=last.transAxes,
            fontsize=7,
            va="center",
            color="tab:red" if fell else "black",
        )
    fig.suptitle(
        "Rewards of decoded clean-image estimates along trajectories (red: fell)", fontsize=9
    )
    fig.tight_layout()
    _save(fig, path)


# ---------------------------------------------------------------------------------------------
# cost and verdict


def _x(value: float | None, reference: float | None) -> str:
    if value is None or not reference:
        return DASH
    return f"{value / reference:.2f}×"


def _num(value: float | None, spec: str) -> str:
    return DASH if value is None else format(value, spec)


def cost_markdown(bench: dict) -> str:
    """Seconds and NFEs per round per phase per method (means over rounds and seeds)."""
    methods = bench["methods"]
    base = methods.get(BASELINE, {})
    header = [f"{p} s" for p in PHASES] + ["round s", "× flow_grpo"]
    header += [f"{p} NFE" for p in PHASES] + ["round NFE", "× flow_grpo"]
    lines = ["| method | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for method, m in methods.items():
        cells = [_num(m["seconds_per_round_by_phase"][p], ".2f") for p in PHASES]
        cells += [_num(m["seconds_per_round"], ".2f")]
        cells += [_x(m["seconds_per_round"], base.get("seconds_per_round"))]
        cells += [_num(m["nfe_per_round_by_phase"][p], ".0f") for p in PHASES]
        cells += [
            _num(m["nfe_per_round"], ".0f"),
            _x(m["nfe_per_round"], base.get("nfe_per_round")),
        ]
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def credit_rates(runs: Runs) -> dict[str, dict[str, Spread | None]]:
    """Per method, over seeds: the mean over rounds of the share of steps whose advantage sign
    differs from the final-reward advantage (`sign_differs`) and of turning points."""
    rates = {}
    for method, seeds in runs.items():
        rates[method] = {}
        for name, key in (("sign_differs", "credit/sign_differs_from_final"),
                          ("turning_points", "credit/turning_point_rate")):  # fmt: skip
            values = seed_matrix(seeds, key)  # (S, R)
            rates[method][name] = None if values is None else Spread.of(values.mean(axis=1))
    return rates


def verdict(
    geneval: GenevalTable,
    bench: dict,
    profiles: Mapping[str, pd.DataFrame],
    runs: Runs,
    probes: Runs | None = None,
    experiment: Mapping | None = None,
) -> list[str]:
    """A few bullet lines stating what the numbers say. Held-out numbers first — the evaluation
    protocol against the base and the targets, the probe curves read at equal NFE and the
    claims with their CIs (`experiment`: the dict of `reports/experiment.json`) — then the
    training-reward diagnostics (that curve follows which prompts a round drew), costs and
    credit statistics."""
    experiment = experiment or {}
    claims = experiment.get("claims") or {}
    lines = [
        _geneval_verdict(geneval),
        _targets_verdict(experiment),
        _probe_verdict(probes or {}),
    ]
    lines += [claim_text(name, claim) for name, claim in claims.items()]
    lines.append(_claims_verdict(claims))
    lines.append(_test_lines_verdict(experiment.get("by_test_lines") or {}))
    methods, target = bench["methods"], bench["target_reward"]
    if methods:
        lines.append(
            f"Diagnostic — **training reward** after the last round (smoothed over "
            f"{bench['smoothing_window']} rounds): "
            + "; ".join(
                f"{m} {Spread.of(s['final_reward_per_seed']).text(3)}"
                + _versus(methods, m, "final_reward_per_seed")
                for m, s in methods.items()
            )
            + "."
        )
    if target is None:
        lines.append(f"No {BASELINE} run: rounds-to-reward and wall-clock are not measurable.")
        return [line for line in lines if line] + [f"Note: {note}" for note in bench["notes"]]
    base = methods[BASELINE]
    lines.append(
        f"Diagnostic — **Rounds to {BASELINE}'s final reward {target:.3f}**: {BASELINE} "
        f"{_num(base['rounds_to_target'], 'd')}"
        + "".join(_reached(bench, m, "rounds_ratio", "rounds_to_target") for m in CHALLENGERS)
        + "; **wall-clock** "
        + f"{BASELINE} {_num(base['seconds_to_target'], '.0f')} s"
        + "".join(_reached(bench, m, "wallclock_ratio", "seconds_to_target") for m in CHALLENGERS)
        + "."
    )
    costs = [
        f"{m} {_num(bench['round_cost_ratio'][m], '.2f')}× the seconds (target ≤ "
        f"{TARGETS['round_cost_ratio'][m]}×: {_met(bench['met']['round_cost_ratio'][m])}) and"
        f" {_num(bench['round_nfe_ratio'][m], '.2f')}× the NFEs"
        for m in CHALLENGERS
        if m in methods
    ]
    if costs:
        lines.append(f"**Cost per round** vs {BASELINE}: " + "; ".join(costs) + ".")
    lines.append(_credit_verdict(profiles, credit_rates(runs)))
    lines += [f"Note: {note}" for note in bench["notes"]]
    return [line for line in lines if line]


def _geneval_verdict(geneval: GenevalTable) -> str:
    overall = {g: row["overall"] for g, row in geneval.items() if row.get("overall") is not None}
    if not overall:
        return "No GenEval metrics yet (`creditflow evaluate`)."
    text = "; ".join(
        f"{g} {s.text()}"
        + (
            f", {compare(s, overall[BASELINE], BASELINE)}"
            if g in CHALLENGERS and BASELINE in overall
            else ""
        )
        for g, s in overall.items()
    )
    line = f"**GenEval overall** on the test prompts: {text}."
    if "base" in overall:
        trained = [g for g in overall if g != "base"]
        above = [g for g in trained if overall[g].low > overall["base"].mean]
        if above:
            line += f" Above the base model on every seed: {', '.join(above)}."
        if len(above) < len(trained):
            rest = ", ".join(g for g in trained if g not in above)
            line += f" Not above it on every seed: {rest}."
    return line


def _versus(methods: Mapping[str, dict], method: str, field: str) -> str:
    if method not in CHALLENGERS or BASELINE not in methods:
        return ""
    ours, theirs = Spread.of(methods[method][field]), Spread.of(methods[BASELINE][field])
    return ", " + compare(ours, theirs, BASELINE)


def _met(met: bool | None) -> str:
    return "not measurable" if met is None else "met" if met else "not met"


def _credit_verdict(
    profiles: Mapping[str, pd.DataFrame], rates: Mapping[str, Mapping[str, Spread | None]]
) -> str:
    parts = []
    early = [(m, early_late_ratio(profiles[m])) for m in CHALLENGERS if m in profiles]
    early = [(m, r) for m, r in early if r is not None]
    if early:
        parts.append(
            "**Early steps worth more?** "
            + "; ".join(
                f"{m} {'yes' if r > 1 else 'no'} (mean |step signal| of the first half "
                f"of the steps is {r:.2f}× the last half's)"
                for m, r in early
            )
            + "."
        )
    signs = [
        f"{r['sign_differs'].mean:.0%} of {m}'s steps"
        for m, r in rates.items()
        if m != BASELINE and r["sign_differs"] is not None
    ]
    if signs:
        parts.append(f"The advantage sign differs from the final-reward one at {', '.join(signs)}.")
    tp = rates.get("tp_grpo", {}).get("turning_points")
    if tp is not None:
        parts.append(f"Turning points: {tp.mean:.0%} of tp_grpo's steps.")
    return " ".join(parts)


def _reached(bench: dict, method: str, key: str, field: str) -> str:
    """ "; stepwise 3 = 0.33× (target ≤ 0.33: met, within seed spread)" for a verdict line."""
    m = bench["methods"].get(method)
    goal = f"target ≤ {TARGETS[key][method]:.2f}"
    if m is None:
        return f"; {method} not run"
    if m["rounds_to_target"] is None:
        return f"; {method} not reached in {m['rounds']} rounds ({goal}: not met)"
    value, met = bench[key][method], bench["met"][key][method]
    unit = " s" if field == "seconds_to_target" else ""
    shown = "" if value is None else f" = {value:.2f}× ({goal}: {_met(met)})"
    return f"; {method} {_num(m[field], '.0f')}{unit}{shown}"


def readme(
    *,
    header: str,
    verdict_lines: Sequence[str],
    geneval: str,
    failures: str,
    samples: Sequence[str],
    cost: str,
    credit: str,
    missing: Sequence[str],
) -> str:
    """`reports/README.md`: verdict first, then the tables and figures behind it."""
    parts = [
        "# creditflow results",
        "",
        header,
        "",
        "## Verdict",
        "",
        *(f"- {line}" for line in verdict_lines),
        "",
        "## GenEval on the test prompts",
        "",
        "Accuracy, mean (min–max) over seeds.",
        "",
        geneval,
        "",
        "![GenEval per tag](figures/geneval.png)",
        "",
    ]
    if samples:
        parts += ["Sample grids: " + " · ".join(samples), ""]
    parts += [
        "### Where the misses go",
        "",
        "Each wrong image of the protocol counted once, by the first failure its verdict names;",
        "a cell is the GenEval overall those images would add if they were right (mean over",
        "seeds), so a column sums to 1 − overall.",
        "",
        failures,
        "",
    ]
    parts += [
        "## Learning curves",
        "",
        "Held-out: GenEval of a fixed probe of the test prompts (`train.probe_images` images per",
        "prompt, evaluation sampler, same initial noise for every policy) every `train.eval_every`",
        "rounds, against rounds, NFEs and seconds spent training.",
        "",
        "![held-out probe curves](figures/probe_curves.png)",
        "",
        "Training reward (a diagnostic: it follows which prompts a round drew):",
        "",
        "![learning curves](figures/learning_curves.png)",
        "",
        "Rounds and wall-clock to flow_grpo's final reward: [benchmark.md](benchmark.md).",
        "",
        "## Cost per round",
        "",
        "Means over rounds and seeds; NFE = one sample through the denoiser (CFG counts two).",
        "",
        cost,
        "",
        "## Credit diagnostics",
        "",
        credit,
        "",
        "![credit diagnostics](figures/credit.png)",
        "",
        "![non-monotonic intermediate rewards](figures/nonmonotonic.png)",
        "",
    ]
    if missing:
        parts += ["## Missing inputs", "", *(f"- {m}" for m in missing), ""]
    return "\n".join(parts)

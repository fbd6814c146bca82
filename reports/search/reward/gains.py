"""Session 26 scratch measurement (reports/search.md, session 26): does a dense learned reward
teach what the GenEval rule reward does not? The default recipe trained with
`score.rewards: {shapes_clip: 1.0}` (ShapesCLIP's scaled text-image cosine, continuous, so no
group's rewards all agree) instead of `{geneval: 1.0}`, in a copy of the project that differs
from `params.yaml` only in that line (`data/prompts`, `data/base/model`, `data/base/shapesclip`
linked). Held-out GenEval (the evaluation protocol, rule-based) is what is read, as always.

    python reports/search/reward/gains.py --copy shapes_clip=COPY --draft RUN=OUT ...  # collect
    python reports/search/reward/gains.py --add --copy LABEL=COPY ...  # add to what is stored
    python reports/search/reward/gains.py                               # report what is stored

Collecting reads each policy's per-prompt accuracy (`data/eval/<policy>/results.jsonl`) of
the base and the committed default runs (this project), of the copy's runs and of `draft.py`'s
runs (`--draft lr1e-3-s0=OUT`: `OUT/eval/results.jsonl`), and stores it in `accuracy.json`
beside this file (144 numbers per policy: all the bootstrap needs), with the copy's
`probe.json` / `rounds.json` under `<reward>/train/<run>/` and draft.py's `history.json` under
`draft/<run>/`. The report (printed, and `gains.json`) gives per reward and method: GenEval per
seed, the gain over the base and the difference to the rule-reward runs of the same method (of
flow_grpo for draft.py's), each with the report's bootstrap CI over seeds and prompts
(`pipeline.report.difference`), the gain per tag, the held-out probe's mean over seeds against
training NFEs, and the training prompts' GenEval accuracy (`train/accuracy`, logged whatever
the reward), first 3 rounds (steps) against last 3; `probe.png` plots the probe curves against
training NFEs.
"""

import argparse
import json
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
sys.path.insert(0, str(REPO))
import numpy as np  # noqa: E402

from pipeline import layout  # noqa: E402
from pipeline import report as rep  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.geneval import TAGS  # noqa: E402
from pipeline.io import write_text  # noqa: E402
from stages.report import eval_matrix  # noqa: E402

REFERENCE = "geneval"  # the committed default runs' reward
DRAFT = "draft"  # draft.py's runs: the exact gradient of ShapesCLIP
ACCURACY = HERE / "accuracy.json"


def collect(
    cfg, test: list[dict], copies: dict[str, Path], drafts: dict[str, Path], stored: dict | None
) -> dict:
    """{"base": [P], reward: {run: [P]}, "draft": {run: [P]}} per-prompt accuracy, and
    "verdicts": {"base" or "reward/run": "0110..."} each evaluation image's verdict in the
    protocol's order (the same seeds for every policy: paired); copies each copy's run curves
    and each `draft.py` run's history beside this file. With `stored` (the accuracy collected
    before) the copies and runs given are added to it, so a later study need not have every
    earlier run's evaluation on disk; a copy's label ("reward") may name any variant."""

    def verdicts(folder: Path) -> str:
        lines = (folder / "results.jsonl").read_text().splitlines()
        return "".join("1" if json.loads(line)["correct"] else "0" for line in lines if line)

    def runs_in(folder: Path) -> list[str]:
        return sorted(p.name for p in folder.iterdir() if p.name != "base")

    def rows(folder: Path, runs: list[str]) -> dict[str, list[float]]:
        matrix = eval_matrix(cfg, runs, test, folder=folder)
        return {run: row.round(6).tolist() for run, row in zip(runs, matrix, strict=True)}

    main_eval = REPO / layout.EVAL
    if stored is not None:
        out = stored
    else:
        out = {"base": eval_matrix(cfg, ["base"], test, folder=main_eval)[0].round(6).tolist()}
        out[REFERENCE] = rows(main_eval, runs_in(main_eval))
        out["verdicts"] = {"base": verdicts(main_eval / "base")} | {
            f"{REFERENCE}/{run}": verdicts(main_eval / run) for run in out[REFERENCE]
        }
    for reward, copy in copies.items():
        out[reward] = rows(copy / layout.EVAL, runs_in(copy / layout.EVAL))
        out["verdicts"] |= {f"{reward}/{r}": verdicts(copy / layout.EVAL / r) for r in out[reward]}
        for run in out[reward]:
            target = HERE / reward / "train" / run
            target.mkdir(parents=True, exist_ok=True)
            for name in ("probe.json", "rounds.json", "metrics.json"):
                shutil.copy(copy / "reports" / "train" / run / name, target / name)
    out.setdefault(DRAFT, {})
    for run, folder in drafts.items():
        out[DRAFT][run] = eval_matrix(cfg, ["eval"], test, folder=folder)[0].round(6).tolist()
        out["verdicts"][f"{DRAFT}/{run}"] = verdicts(folder / "eval")
        (HERE / DRAFT / run).mkdir(parents=True, exist_ok=True)
        for name in ("history.json", "eval/metrics.json"):
            shutil.copy(folder / name, HERE / DRAFT / run / Path(name).name)
    return out


def curves(reward: str, runs: list[str]) -> dict:
    """Mean over runs of the probe curve and the training prompts' GenEval accuracy."""
    if reward == DRAFT:
        histories = [json.loads((HERE / DRAFT / r / "history.json").read_text()) for r in runs]
        steps = sorted(set.intersection(*(set(h["probes"]) for h in histories)), key=int)
        nfe = {row["step"]: row["nfe"] for row in histories[0]["steps"]} | {0: 0}
        accuracy = [[row["train_accuracy"] for row in h["steps"]] for h in histories]
        probe = [[h["probes"][k]["overall"] for k in steps] for h in histories]
        rounds, probe_nfe = [int(k) for k in steps], [nfe[int(k)] for k in steps]
    else:
        folder = REPO / "reports" / "train" if reward == REFERENCE else HERE / reward / "train"
        probes = [json.loads((folder / r / "probe.json").read_text()) for r in runs]
        history = [json.loads((folder / r / "rounds.json").read_text()) for r in runs]
        length = min(len(p) for p in probes)
        accuracy = [[row["train/accuracy"] for row in rows] for rows in history]
        probe = [[p["probe/geneval"] for p in ps[:length]] for ps in probes]
        rounds = [p["rounds"] for p in probes[0][:length]]
        probe_nfe = [p["nfe"] for p in probes[0][:length]]
    first, last = (float(np.mean([a[s] for a in accuracy])) for s in (slice(3), slice(-3, None)))
    return {
        "probe_rounds": rounds,
        "probe_nfe": probe_nfe,
        "probe_mean": np.mean(probe, 0).round(4).tolist(),
        "train_accuracy_first3_last3": [round(first, 4), round(last, 4)],
    }


def by_method(runs: dict[str, list[float]]) -> dict[str, list[str]]:
    """Run names ("<method>-s<seed>") grouped by method, both sorted."""
    grouped: dict[str, list[str]] = {}
    for run in sorted(runs):
        grouped.setdefault(run.rsplit("-s", 1)[0], []).append(run)
    return dict(sorted(grouped.items()))


def gains(accuracy: dict, tags: np.ndarray) -> dict:
    base = np.asarray([accuracy["base"]])
    out = {"base_geneval": float(rep.geneval_overall(base[0], tags))}
    references = by_method(accuracy[REFERENCE])
    for reward in [r for r in accuracy if r not in ("base", "verdicts")]:
        methods = by_method(accuracy[reward])
        for method, runs in methods.items():
            trained = np.asarray([accuracy[reward][r] for r in runs])
            entry = {
                "runs": runs,
                "geneval_per_seed": [float(rep.geneval_overall(row, tags)) for row in trained],
                "gain_over_base": rep.difference(trained, base, tags),
                "gain_per_tag": rep.tag_gains(trained, base, tags),
                **curves(reward, runs),
            }
            if reward != REFERENCE:  # against the rule reward's runs of the method (draft:
                # of flow_grpo, the baseline)
                other = "flow_grpo" if reward == DRAFT else method
                ref = np.asarray([accuracy[REFERENCE][r] for r in references[other]])
                entry["minus_reference"] = {
                    "reference": f"{REFERENCE}/{other}",
                    **rep.difference(trained, ref, tags),
                }
            if method != "flow_grpo" and "flow_grpo" in methods:  # the claims' baseline,
                # trained under the same variant
                flow = np.asarray([accuracy[reward][r] for r in methods["flow_grpo"]])
                entry["minus_flow_grpo"] = rep.difference(trained, flow, tags)
            out[f"{reward}/{method}"] = entry
    return out


def flips(verdicts: dict[str, str]) -> dict:
    """How far each policy moved from the base on the same evaluation noise: images whose verdict
    it turned right ("gained") or wrong ("lost"); and for runs of one seed under two rewards,
    how many images both turned (the same images: the move follows the seed's draws, not the
    reward)."""

    def turned(a: str, b: str) -> np.ndarray:
        return np.frombuffer(a.encode(), np.uint8) != np.frombuffer(b.encode(), np.uint8)

    base = verdicts["base"]
    out = {}
    for name, own in verdicts.items():
        if name == "base":
            continue
        moved = turned(base, own)
        right = np.frombuffer(own.encode(), np.uint8) == ord("1")
        entry = {"gained": int((moved & right).sum()), "lost": int((moved & ~right).sum())}
        reward, run = name.split("/")
        reference = verdicts.get(f"{REFERENCE}/{run}")
        if reward not in (REFERENCE, DRAFT) and reference is not None:
            entry[f"turned_by_{REFERENCE}_run_too"] = int((moved & turned(base, reference)).sum())
            entry[f"differs_from_{REFERENCE}_run"] = int(turned(own, reference).sum())
        out[name] = entry
    return out


def plot(out: dict, path: Path) -> None:
    """Held-out probe (mean over seeds) against training NFEs, one line per reward and method;
    every curve starts at the base's probe (0 NFEs)."""
    plt = rep._pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, g in out.items():
        if isinstance(g, dict) and "probe_mean" in g:
            style = "-" if name.startswith(DRAFT) else "--" if name.startswith(REFERENCE) else ":"
            ax.plot(np.asarray(g["probe_nfe"]) / 1000, g["probe_mean"], style, marker="o",
                    markersize=3, label=f"{name} ({len(g['runs'])} seed(s))")  # fmt: skip
    ax.set(xlabel="training NFEs (thousands; a backward counts as two)",
           ylabel="held-out probe GenEval", title="GRPO (dashed: the committed default runs, "
           "dotted: variants by label) vs the exact ShapesCLIP gradient (solid)")  # fmt: skip
    ax.title.set_fontsize(9)
    ax.legend(fontsize=7)
    rep._save(fig, path)


def line(name: str, g: dict) -> str:
    def ci(d: dict) -> str:
        return f"{d['diff']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}]"

    tags = g["gain_per_tag"]
    parts = [
        f"{name}: " + " / ".join(f"{v:.3f}" for v in g["geneval_per_seed"]),
        f"gain {ci(g['gain_over_base'])}",
        *([f"minus {g[key]['reference']} {ci(g[key])}"] if (key := "minus_reference") in g else []),
        *([f"minus its flow_grpo {ci(g['minus_flow_grpo'])}"] if "minus_flow_grpo" in g else []),
        " ".join(f"{t} {tags[t]:+.3f}" for t in ("counting", "position", "two_object")),
        "probe at "
        + ", ".join(
            f"{n / 1000:.0f}k NFE {v:.3f}"
            for n, v in zip(g["probe_nfe"], g["probe_mean"], strict=True)
        ),
        "train accuracy {:.3f} -> {:.3f}".format(*g["train_accuracy_first3_last3"]),
    ]
    return "; ".join(parts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--copy", action="append", default=[], help="REWARD=PATH of a copy")
    parser.add_argument("--draft", action="append", default=[], help="RUN=OUT of draft.py")
    parser.add_argument("--add", action="store_true", help="add to the stored accuracy.json")
    args = parser.parse_args()
    cfg = load_config(REPO / "params.yaml")
    test = layout.load_prompts(cfg, "test")
    tags = np.array([TAGS.index(m["tag"]) for m in test])
    if args.copy or args.draft:
        copies, drafts = ({k: Path(v) for k, v in (a.split("=", 1) for a in given)}
                          for given in (args.copy, args.draft))  # fmt: skip
        stored = json.loads(ACCURACY.read_text()) if args.add else None
        write_text(ACCURACY, json.dumps(collect(cfg, test, copies, drafts, stored)) + "\n")
    stored = json.loads(ACCURACY.read_text())
    out = gains(stored, tags)
    out["flips_against_base"] = flips(stored["verdicts"])
    print(f"base {out['base_geneval']:.3f}")
    for name, g in out.items():
        if name not in ("base_geneval", "flips_against_base"):
            print(line(name, g))
    n_images = len(stored["verdicts"]["base"])
    for name, f in out["flips_against_base"].items():
        print(
            f"{name}: of {n_images} images, {f['gained']} turned right, {f['lost']} wrong", end=""
        )
        if (both := f.get(f"turned_by_{REFERENCE}_run_too")) is not None:
            print(f"; {both} also turned by the {REFERENCE} run of its seed", end="")
        print()
    write_text(HERE / "gains.json", json.dumps(out, indent=2) + "\n")
    plot(out, HERE / "probe.png")


if __name__ == "__main__":
    main()

"""Sessions 48-49 (reports/search.md): the held-out probe of each group of pool runs, round by
round: mean ± standard error over runs of `probe/geneval` at every probed round, with the mean
NFEs spent by then, and the report's probe figure of the groups (against rounds, NFEs and
seconds). Equal rounds compare the credit signals; equal NFEs compare the methods.

    python reports/search/oracle/pool24/probe_rounds.py OUT.json --group NAME ROOT METHOD SEEDS...

ROOT holds the group's runs as `train/<METHOD>-s<seed>/probe.json`; the figure is OUT.png.
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from pipeline.bench import read_probe_runs, seed_matrix  # noqa: E402
from pipeline.io import write_json  # noqa: E402
from pipeline.report import plot_probe_curves  # noqa: E402


def probe_by_round(seeds) -> list[dict]:
    """[{"rounds", "runs", "nfe", "geneval", "sem"}] at every probe the group's runs share."""
    geneval = seed_matrix(seeds, "probe/geneval")  # (S, P)
    sem = geneval.std(axis=0, ddof=1) / np.sqrt(len(geneval))
    return [
        {"rounds": int(r), "runs": len(geneval), "nfe": n, "geneval": g, "sem": s}
        for r, n, g, s in zip(
            seed_matrix(seeds, "rounds")[0], seed_matrix(seeds, "nfe").mean(axis=0),
            geneval.mean(axis=0), sem, strict=True,
        )
    ]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument(
        "--group", nargs="+", action="append", required=True,
        metavar=("NAME", "ROOT METHOD SEEDS"), help="a name, the runs' root, method and seeds",
    )  # fmt: skip
    args = parser.parse_args()
    groups = {}
    for name, root, method, *seeds in args.group:
        runs = read_probe_runs(Path(root), [method], [int(s) for s in seeds]).get(method, {})
        if len(runs) < 2:
            parser.error(f"--group {name}: fewer than two runs with a probe.json under {root}")
        groups[name] = runs
    out = {name: probe_by_round(seeds) for name, seeds in groups.items()}
    write_json(args.out, out)
    plot_probe_curves(groups, args.out.with_suffix(".png"))
    for name, points in out.items():
        cells = (
            f"r{p['rounds']} {p['nfe'] / 1e3:.0f}k {p['geneval']:.3f} ± {p['sem']:.3f}"
            for p in points
        )
        print(f"{name}: " + "; ".join(cells))


if __name__ == "__main__":
    main()

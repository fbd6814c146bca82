"""Table and plot of the lent-GPU runs of big_rounds.py: `python reports/search/gpu/summary.py`
-> summary.json (per run: rounds, NFEs, probe at round 0 / best / last, final protocol) and
probe.png (held-out probe against NFEs, the CPU default experiment's budget marked)."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

HERE = Path(__file__).resolve().parent
CPU_BUDGET_NFE = 99_840  # train.nfe_budget of the default experiment


def main() -> None:
    runs = {p.parent.name: json.loads(p.read_text()) for p in sorted(HERE.glob("*/result.json"))}
    table = {}
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, run in runs.items():
        nfe_at = {0: 0.0} | {r["round"]: r["nfe"] for r in run["rounds"]}
        probes = {int(k): v["overall"] for k, v in run["probes"].items()}
        xs = sorted(probes)
        ax.plot([nfe_at[x] / 1e6 for x in xs], [probes[x] for x in xs], marker=".", label=name)
        table[name] = {
            "overrides": run["overrides"],
            "rounds": len(run["rounds"]),
            "nfe": run["rounds"][-1]["nfe"],
            "seconds_per_round": sum(r["seconds"] for r in run["rounds"]) / len(run["rounds"]),
            "probe_round0": probes[0],
            "probe_best": max(probes.values()),
            "probe_last": probes[xs[-1]],
            "final_protocol": run["final_protocol"],
        }
    ax.axvline(CPU_BUDGET_NFE / 1e6, color="grey", linestyle=":", label="CPU experiment's budget")
    ax.set(xlabel="training NFEs (millions)", ylabel="probe GenEval (2 images / prompt)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(HERE / "probe.png", dpi=110)
    (HERE / "summary.json").write_text(json.dumps(table, indent=1) + "\n")
    for name, row in table.items():
        probe = f"{row['probe_round0']:.3f} -> best {row['probe_best']:.3f}"
        protocol = row["final_protocol"]["overall"]
        print(f"{name:24s} {row['rounds']:4d} rounds {row['nfe']:>10.0f} NFE  probe {probe} "
              f"last {row['probe_last']:.3f}  protocol {protocol:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()

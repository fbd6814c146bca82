"""Session 37 scratch measurement (reports/search.md, session 37): the average of several
finished runs' policies (a "soup"), judged by the evaluation protocol.

The placebo runs (`reports/search/placebo/`) show that a GRPO update is a small learned direction
plus a random walk. Independent seeds walk independently, so their average keeps what they share
and shrinks the walk (by 1/sqrt(n) if the walks are independent). The average is taken over the
weight updates themselves, not the LoRA factors (whose random inits differ per seed): the n
adapters are stacked into one of rank n*r with every B scaled by 1/n, so that
B_cat A_cat = mean_i B_i A_i exactly (alpha scaled by n keeps alpha/r). `--scale k` multiplies
that mean update by k: k > 1 extrapolates along it, which raises GenEval if what the runs share
is the learned direction and GenEval is still linear in the update there.

    python reports/search/soup/lora_soup.py --runs data/train/flow_grpo-s0 data/train/flow_grpo-s1 \
        data/train/flow_grpo-s2 --out reports/search/soup/flow_grpo

Writes `eval/results.jsonl` and `eval/metrics.json` as `creditflow evaluate` does.
"""

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "reports" / "search" / "reward"))
import torch  # noqa: E402
from draft import write_evaluation  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from pipeline import layout  # noqa: E402
from pipeline.config import load_config  # noqa: E402
from pipeline.grpo import load_lora_state  # noqa: E402
from pipeline.policy import Policy, checkpoints  # noqa: E402


def stacked_mean(
    states: list[dict[str, torch.Tensor]], scale: float = 1.0
) -> dict[str, torch.Tensor]:
    """One LoRA state of rank n*r whose update B A is `scale` times the mean of the n states'
    B_i A_i.

    states: n dicts of `...lora_A.weight` (r, in) and `...lora_B.weight` (out, r) tensors.
    """
    n = len(states)
    stacked = {}
    for name in states[0]:
        parts = [state[name].float() for state in states]
        if ".lora_A." in name:
            stacked[name] = torch.cat(parts, dim=0)  # (n*r, in)
        elif ".lora_B." in name:
            stacked[name] = torch.cat(parts, dim=1) * (scale / n)  # (out, n*r)
        else:
            raise ValueError(f"not a LoRA factor: {name}")
    return stacked


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=Path, nargs="+", required=True, help="data/train/<run>")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="the mean update times this (> 1 extrapolates)"
    )
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(REPO / "params.yaml")
    states = []
    for run in args.runs:
        rounds = checkpoints(run / "checkpoints")
        if not rounds:
            raise SystemExit(f"error: no checkpoints in {run / 'checkpoints'}")
        states.append(load_file(rounds[max(rounds)] / "lora.safetensors"))
        print(f"{run}: round {max(rounds)}")
    n, update = len(states), cfg.update
    cfg = load_config(
        REPO / "params.yaml",
        [f"update.lora_rank={n * update.lora_rank}", f"update.lora_alpha={n * update.lora_alpha}"],
    )
    backend = Policy.create(cfg).backend
    load_lora_state(backend.transformer, stacked_mean(states, args.scale))
    write_evaluation(backend.eval(), cfg, layout.load_prompts(cfg, "test"), args.out)


if __name__ == "__main__":
    main()

"""Session 34 scratch measurement (reports/search.md, session 34 §6): would an EMA of the policy
move held-out GenEval? Flow-GRPO's recipe evaluates an exponential moving average of its LoRA
(`../shared/ANCHORS.md`); creditflow evaluates the last iterate, and supervised LoRA steps
without an average lose held-out accuracy while their loss stays flat (§4). Post hoc, from a
finished run's round checkpoints: ema = w_0 (round 0's LoRA), then ema = d * ema + (1 - d) * w_r
for every later round r (an EMA at round granularity: each round is a few optimizer steps),
loaded into the policy and judged by the evaluation protocol.

    python reports/search/ema/checkpoint_ema.py --run data/train/flow_grpo-s0 --decay 0.8 \
        --out reports/search/ema/NAME

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


def round_ema(states: list[dict[str, torch.Tensor]], decay: float) -> dict[str, torch.Tensor]:
    """EMA of LoRA states in round order, starting at the first: {name: tensor}."""
    ema = {name: value.float().clone() for name, value in states[0].items()}
    for state in states[1:]:
        for name, value in state.items():
            ema[name].lerp_(value.float(), 1.0 - decay)
    return ema


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--run", type=Path, required=True, help="data/train/<method>-s<seed>")
    parser.add_argument("--decay", type=float, default=0.8, help="per round")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cfg = load_config(REPO / "params.yaml")
    rounds = checkpoints(args.run / "checkpoints")
    if not rounds:
        raise SystemExit(f"error: no checkpoints in {args.run / 'checkpoints'}")
    states = [load_file(path / "lora.safetensors") for path in rounds.values()]
    backend = Policy.create(cfg).backend
    load_lora_state(backend.transformer, round_ema(states, args.decay))
    print(f"{args.run}: EMA over rounds {min(rounds)}-{max(rounds)}, decay {args.decay}")
    write_evaluation(backend.eval(), cfg, layout.load_prompts(cfg, "test"), args.out)


if __name__ == "__main__":
    main()

#!/bin/bash
# Session 42 (reports/search.md): the three credit rules trained on the 24 pool lines, and the
# two sampler swaps, judged on those lines and on the other 120 test lines.
#   bash reports/search/oracle/pool24/credit.sh   (from the repository root, after the runs were
#   collected into eval/ and sampler-swap/eval/ here)
set -e
here=reports/search/oracle/pool24
gain() { python "$here/../pool_gain.py" "$@" --pool "$here/prompts.jsonl" --base data/eval/base; }
runs() { for s in $2; do echo "$here/$1-s$s"; done; }
flow=$(runs eval/flow_grpo "0 1 2 3")
gain "$here/credit-flow_grpo.json" --policy $flow
gain "$here/credit-stepwise.json" --policy $(runs eval/stepwise "0 1 2 3") --reference $flow
gain "$here/credit-tp_grpo.json" --policy $(runs eval/tp_grpo "0 1 2 3") --reference $flow
# Which half of stepwise makes the difference: its credit rule or its DDIM-style SDE? Each swap
# against the same seeds of the method it came from.
gain "$here/swap-stepwise-credit-flow_grpo-sde.json" \
  --policy $(runs sampler-swap/eval/stepwise "0 1 2") --reference $(runs eval/stepwise "0 1 2")
gain "$here/swap-flow_grpo-credit-stepwise-sde.json" \
  --policy $(runs sampler-swap/eval/flow_grpo "0 1 2") --reference $(runs eval/flow_grpo "0 1 2")
# The step-wise credit rule on Flow-GRPO's SDE against flow_grpo itself: the credit rule alone.
gain "$here/swap-stepwise-credit-vs-flow_grpo.json" \
  --policy $(runs sampler-swap/eval/stepwise "0 1 2") --reference $flow

#!/bin/bash
# Sessions 42-44 (reports/search.md): the three credit rules trained on the 24 pool lines, and the
# two sampler swaps, judged on those lines and on the other 120 test lines; session 43 added
# seed 4 of flow_grpo and stepwise and seeds 3-5 of each swap, and the 2x2 split (factorial.py);
# session 44 seeds 5-6 of flow_grpo and stepwise, 4-5 of tp_grpo and 6 of each swap; session 45
# seeds 7-8 of every 2x2 cell (the last: nine seeds a cell, fixed before they were run); session
# 47 stepwise with the exact completion, seeds 0-7 (collected into exact-completion/ here); session
# 48 the hybrid credit rule, seeds 0-7 (hybrid/); session 49 stepwise with Tweedie's estimate on
# Flow-GRPO's SDE, seeds 0-5 (tweedie/), and the probe round by round (probe_rounds.py); session
# 50 seeds 6-8 of tp_grpo (nine seeds, as every 2x2 cell) and per-step normalization (per-step/);
# session 51 per-step seeds 3-8 and seeds 9-11 of tp_grpo and flow_grpo, trained through
# `-S rollout.train_on_test=4` with ../lane.sh and collected with ../collect.sh.
#   bash reports/search/oracle/pool24/credit.sh   (from the repository root, after the runs were
#   collected into eval/ and sampler-swap/eval/ here)
set -e
here=reports/search/oracle/pool24
gain() { python "$here/../pool_gain.py" "$@" --pool "$here/prompts.jsonl" --base data/eval/base; }
runs() { for s in $2; do echo "$here/$1-s$s"; done; }
seeds="0 1 2 3 4 5 6 7 8"  # every cell of the 2x2
tp_seeds="0 1 2 3 4 5"
twelve="$seeds 9 10 11"  # tp_grpo and flow_grpo from session 51
flow=$(runs eval/flow_grpo "$seeds")
stepwise=$(runs eval/stepwise "$seeds")
gain "$here/credit-flow_grpo.json" --policy $flow
gain "$here/credit-stepwise.json" --policy $stepwise --reference $flow
gain "$here/credit-tp_grpo.json" --policy $(runs eval/tp_grpo "$tp_seeds") --reference $flow
# Which half of stepwise makes the difference: its credit rule or its DDIM-style SDE? Each swap
# against the method it came from.
gain "$here/swap-stepwise-credit-flow_grpo-sde.json" \
  --policy $(runs sampler-swap/eval/stepwise "$seeds") --reference $stepwise
gain "$here/swap-flow_grpo-credit-stepwise-sde.json" \
  --policy $(runs sampler-swap/eval/flow_grpo "$seeds") --reference $flow
# The step-wise credit rule on Flow-GRPO's SDE against flow_grpo itself: the credit rule alone.
gain "$here/swap-stepwise-credit-vs-flow_grpo.json" \
  --policy $(runs sampler-swap/eval/stepwise "$seeds") --reference $flow
# The four credit x SDE cells at once: each half's main effect and their interaction (session 43).
python "$here/factorial.py" "$here/factorial.json" --pool "$here/prompts.jsonl" \
  --final-flow $flow --final-ddim $(runs sampler-swap/eval/flow_grpo "$seeds") \
  --step-flow $(runs sampler-swap/eval/stepwise "$seeds") --step-ddim $stepwise
# Round 0 of every run: the base sampled by each SDE (sessions 43-44); tp_grpo samples with
# Flow-GRPO's SDE.
python "$here/round0.py" "$here/round0.json" \
  --flow-sde $(runs train/flow_grpo "$seeds") $(runs sampler-swap/train/stepwise "$seeds") \
    $(runs train/tp_grpo "$tp_seeds") \
  --ddim-sde $(runs sampler-swap/train/flow_grpo "$seeds") $(runs train/stepwise "$seeds")
# Session 47: session 46's prediction, stepwise with the exact completion
# (`-S score.completion_steps=0`, eight seeds fixed before they were run), against the default
# stepwise (primary) and against flow_grpo.
exact=$(runs exact-completion/eval/stepwise "0 1 2 3 4 5 6 7")
gain "$here/exact-completion-vs-stepwise.json" --policy $exact --reference $stepwise
gain "$here/exact-completion-vs-flow_grpo.json" --policy $exact --reference $flow
# Session 48: the hybrid credit rule (`-S rollout.sampler=flow_grpo -S
# advantages.final_reward_steps=1`, eight seeds fixed before they were run; collected into
# hybrid/ here) against the step-wise credit rule on Flow-GRPO's SDE (primary) and flow_grpo.
hybrid=$(runs hybrid/eval/stepwise "0 1 2 3 4 5 6 7")
gain "$here/hybrid-vs-stepwise-credit.json" --policy $hybrid \
  --reference $(runs sampler-swap/eval/stepwise "$seeds")
gain "$here/hybrid-vs-flow_grpo.json" --policy $hybrid --reference $flow
# Session 49: the step-wise credit rule with Tweedie's free estimate on Flow-GRPO's SDE (`-S
# rollout.sampler=flow_grpo -S score.estimator=tweedie`, six seeds fixed before they were run;
# collected into tweedie/ here) against flow_grpo (primary) and the step-wise cell.
tweedie=$(runs tweedie/eval/stepwise "0 1 2 3 4 5")
gain "$here/tweedie-vs-flow_grpo.json" --policy $tweedie --reference $flow
gain "$here/tweedie-vs-stepwise-credit.json" --policy $tweedie \
  --reference $(runs sampler-swap/eval/stepwise "$seeds")
# The held-out probe round by round (sessions 48-51): equal rounds compare the signals, equal
# NFEs the methods.
python "$here/probe_rounds.py" "$here/probe-rounds.json" \
  --group flow_grpo "$here" flow_grpo $twelve \
  --group stepwise_credit_flow_grpo_sde "$here/sampler-swap" stepwise $seeds \
  --group hybrid "$here/hybrid" stepwise 0 1 2 3 4 5 6 7 \
  --group tweedie "$here/tweedie" stepwise 0 1 2 3 4 5 \
  --group tp_grpo "$here" tp_grpo $twelve \
  --group stepwise "$here" stepwise $seeds \
  --group stepwise_per_step "$here/per-step" stepwise $seeds
# Session 50: tp_grpo at nine seeds (6-8 added; the count fixed before they finished) against
# flow_grpo, the issue's second claim where GRPO learns; the lines above keep session 44's six.
gain "$here/tp_grpo-nine-seeds-vs-flow_grpo.json" --policy $(runs eval/tp_grpo "$seeds") \
  --reference $flow
# Session 50: stepwise with per-step normalization (`-S advantages.normalization=per_step`, seeds
# 0-2, the count fixed before they finished; collected into per-step/ here): the committed joint
# stepwise minus it (primary), and it against flow_grpo.
per_step=$(runs per-step/eval/stepwise "0 1 2")
gain "$here/joint-vs-per-step.json" --policy $stepwise --reference $per_step
gain "$here/per-step-vs-flow_grpo.json" --policy $per_step --reference $flow
# Session 51: per-step normalization at nine seeds (3-8 added; the count and a stopping time fixed
# before they finished) against the joint rule's nine, and against flow_grpo's nine.
per_step_nine=$(runs per-step/eval/stepwise "$seeds")
gain "$here/joint-vs-per-step-nine-seeds.json" --policy $stepwise --reference $per_step_nine
gain "$here/per-step-nine-seeds-vs-flow_grpo.json" --policy $per_step_nine --reference $flow
# Session 51: tp_grpo and flow_grpo at twelve seeds each (9-11 added; the last look at this
# contrast, fixed before they ran), and stepwise's nine against the twelve flow_grpo seeds.
flow_twelve=$(runs eval/flow_grpo "$twelve")
gain "$here/tp_grpo-twelve-seeds-vs-flow_grpo.json" --policy $(runs eval/tp_grpo "$twelve") \
  --reference $flow_twelve
gain "$here/stepwise-vs-flow_grpo-twelve-seeds.json" --policy $stepwise --reference $flow_twelve

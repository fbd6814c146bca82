#!/bin/bash
# Copy finished search runs out of a lane's checkout into a search folder, as pool_gain.py and
# probe_rounds.py read them: DEST/train/RUN/{metrics,probe,rounds}.json and
# DEST/eval/RUN/{metrics.json,results.jsonl}.
#   bash reports/search/oracle/collect.sh DEST CHECKOUT RUN ...
set -euo pipefail
dest=$1
checkout=$2
shift 2
for run in "$@"; do
  mkdir -p "$dest/train/$run" "$dest/eval/$run"
  cp "$checkout/reports/train/$run/"{metrics,probe,rounds}.json "$dest/train/$run/"
  cp "$checkout/reports/eval/$run/metrics.json" "$checkout/data/eval/$run/results.jsonl" \
    "$dest/eval/$run/"
done

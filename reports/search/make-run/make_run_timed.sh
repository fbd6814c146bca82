#!/bin/bash
# `make run` in a fresh clone, each output line stamped with the clock and the seconds since the
# start (session 41): bash make_run_timed.sh /tmp/mr > make_run.log, then
# grep -E "^START|Running stage|^END" make_run.log > make_run_stages.log; python split.py
clone=${1:?usage: make_run_timed.sh FRESH_CLONE_DIR}
cd "$clone" || exit 1
start=$(date +%s)
echo "START $(date -u +%FT%TZ)"
make run 2>&1 | while IFS= read -r line; do
    printf '%s +%ds %s\n' "$(date -u +%T)" "$(($(date +%s) - start))" "$line"
done
echo "END rc=${PIPESTATUS[0]} $(date -u +%FT%TZ) elapsed=$(($(date +%s) - start))s"

#!/usr/bin/env bash
# A same-machine A/B of one command: this tree's sources against an older tree's, alternated
# ROUNDS times (so drift and warm-up fall on both sides), each run's Markdown rows tagged
# with its side. OLD is a folder holding the older tree's package sources as
# `git archive <sha> packages/<pkg>/src | tar -x -C $OLD` leaves them (only the packages
# archived there are swapped; the others come from this tree). Repository root, e.g.
#   OLD=.ab/old ROUNDS=2 bash tools/gpu/ab.sh python3 tools/gpu/bench_kernels.py --numel \
#     --model qwen3-4b --modes batched --reps 5 --warmup 2 --reference-reps 1
set -uo pipefail
: "${OLD:?a folder with packages/<pkg>/src of the older tree}"
site=/tmp/site
if [ -d .whl ] && [ ! -d "$site" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
fi
new=""
old=""
for pkg in dte-detector dte-codec dte-transport dte-config areal-dte; do
  new="$new:packages/$pkg/src"
  if [ -d "$OLD/packages/$pkg/src" ]; then old="$old:$OLD/packages/$pkg/src"
  else old="$old:packages/$pkg/src"; fi
done
status=0
for round in $(seq "${ROUNDS:-2}"); do
  for side in new old; do
    paths=$new
    [ "$side" = old ] && paths=$old
    PYTHONPATH="$site${paths}:tools:tools/gpu" "$@" 2>&1 | grep "^|" | grep -v "^|---" \
      | sed "s/^/$side $round /" || status=1
  done
done
exit $status

#!/usr/bin/env bash
# Early stopping against a search that runs every study to --trials, on one GPU (issue 50's 15-minute bar):
# the same default search of Qwen3.5-27B twice, fresh, each timed to its end; then both runs' per-token
# predictions (tunekit compare's per-token table, "s (tuned)" per M) side by side. The bar: the early-stopped
# run ends within 15 minutes and its per-token figure is within 1% of the full one's at every M. Both runs
# are fresh (--seed-from none): a GPU with a shipped table would otherwise start from its winners.
#   bash benchmarks/probes/early_stop_ab.sh [OUT]   (default OUT: /var/tmp/early-stop-ab)
set -euo pipefail
out=${1:-/var/tmp/early-stop-ab}
mkdir -p "$out"
run() {  # NAME ARGS...: one fresh search, its wall time in NAME.seconds
  local name=$1; shift
  rm -rf "$out/$name"
  local start=$SECONDS
  python -m tunekit search --model qwen3.5-27b --out "$out/$name" --no-progress --seed-from none "$@" > "$out/$name.log" 2>&1
  echo $((SECONDS - start)) > "$out/$name.seconds"
  echo "$name: $(cat "$out/$name.seconds") s, $(grep -c 'stopped early' "$out/$name.log" || true) studies stopped early"
}
run early                                         # the defaults: early stopping on
run full --stop-patience 0 --stop-near-limit 0    # every study to --trials (40)
for name in early full; do
  echo "== $name"; sed -n '/^## Per token/,/^## /p' "$out/$name/report.md" | grep '^|'
done

#!/usr/bin/env bash
# The default test suite N times in a row (default 10) while a CPU hog keeps every core busy: a
# test that decides by timing instead of by events shows up here. Not part of CI (it takes N times
# the suite). Prints one line per run and, last, "P passed, F failed" (suite runs).
#   bash scripts/stress_tests.sh [N]        (make stress N=...)
set -uo pipefail
cd "$(dirname "$0")/.."
PY="${PY:-.venv/bin/python}"
N="${1:-10}"
if ! [[ "$N" =~ ^[1-9][0-9]*$ ]]; then
  echo "N=$N: must be a whole number of suite runs ≥ 1, e.g. N=10" >&2
  exit 2
fi
hogs=()
cleanup() { ((${#hogs[@]})) && kill "${hogs[@]}" 2>/dev/null; wait 2>/dev/null; }
trap cleanup EXIT
trap 'exit 130' INT TERM
for _ in $(seq "$(nproc)"); do
  "$PY" -c 'while True: pass' &
  hogs+=("$!")
done
echo "a CPU hog on each of $(nproc) cores: pids ${hogs[*]}"
passed=0
failed=0
for i in $(seq "$N"); do
  log="$(mktemp)"
  start=$SECONDS
  if "$PY" -m pytest -q -p no:cacheprovider -m "not ray and not vllm and not faults and not gpu" >"$log" 2>&1; then
    passed=$((passed + 1))
    verdict=passed
  else
    failed=$((failed + 1))
    verdict=FAILED
  fi
  echo "run $i/$N: $verdict in $((SECONDS - start)) s — $(tail -n 1 "$log")"
  [[ "$verdict" == FAILED ]] && grep -E "^(FAILED|ERROR) " "$log" | sed 's/^/    /'
  if [[ "$verdict" == FAILED ]]; then echo "    log kept: $log"; else rm -f "$log"; fi
done
echo "$passed passed, $failed failed"
((failed == 0))

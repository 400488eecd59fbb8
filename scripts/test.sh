#!/usr/bin/env bash
# The whole test suite on every tested vLLM, on a fresh machine or an old one (what CI runs, via .ci/run).
# Real vLLM engines, real Mooncake engines (TCP) and real ZMQ, all on 127.0.0.1.
#
#   * vLLM 0.32 (newest CPU build): scripts/setup.sh makes .venv, and the suite runs from this tree.
#   * vLLM 0.23 (what vllm-ascend 0.23.0.post1 runs): scripts/setup_vllm_release.sh 0.23.0 makes its own venv once
#     per machine and builds this package against its torch in a copy of the tree (build/vllm-0.23.0/src), where
#     the suite runs.
#
# Every run uses scripts/run_suite.sh, the same pytest invocation the Ascend workflow uses. Which tests each vLLM
# runs is the rule in tests/conftest.py: vLLM 0.32 runs the pure unit tests (vLLM and Mooncake made unimportable:
# the check that they are pure) and all the rest; vLLM 0.23 the rest less the packages named in NEWEST_VLLM_ONLY
# (each with the package that exercises its vLLM seams on 0.23). The rest comes in two parts (KVP2P_PART): the
# engineless packages (tests/unit, scheduler, worker: one process, one core) and the e2e packages (vllm serve
# engines on both cores). On CI's two cores the runs go in three phases:
#   1. at once: vLLM 0.32's pure run then its engineless part, beside vLLM 0.23's engineless part;
#   2. vLLM 0.32's e2e packages;   3. vLLM 0.23's e2e packages.
# Arguments, when given, are passed to pytest on each version instead, whole, one version after the other.
# KVP2P_TEST_VLLM="0.32" or "0.23" runs only one. Every run always runs; exits non-zero when any fails or collects
# nothing. The last line adds up every run's counts.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VERSIONS=${KVP2P_TEST_VLLM:-0.32 0.23}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
has() { [[ " $VERSIONS " == *" $1 "* ]]; }
for version in $VERSIONS; do
  case "$version" in
    0.32|0.23) ;;
    *) echo "[test] unknown vLLM version '$version' in KVP2P_TEST_VLLM (known: 0.32 0.23)" >&2; exit 2 ;;
  esac
done

if has 0.32; then bash scripts/setup.sh || exit 1; fi
if has 0.23; then PY023=$(bash scripts/setup_vllm_release.sh 0.23.0 | tail -n 1) || exit 1; fi

# run NAME VERSION MODE PART [pytest arguments]: one pytest run, its output in $logs/NAME.log (and on stdout
# unless QUIET=1), its exit code and seconds in $logs/NAME.rc.
run() {
  local name=$1 version=$2 mode=$3 part=$4 start rc pid
  shift 4
  start=$(date +%s)
  echo "[test] ===== $name: vLLM $version, KVP2P_TESTS=${mode:-all} KVP2P_PART=${part:-all} $* ====="
  if [ "$version" = 0.32 ]; then
    KVP2P_TESTS=$mode KVP2P_PART=$part bash scripts/run_suite.sh "$ROOT/.venv/bin/python" "$@" \
      > "$logs/$name.log" 2>&1 &
  else
    (cd build/vllm-0.23.0/src && KVP2P_TESTS=$mode KVP2P_PART=$part bash scripts/run_suite.sh "$PY023" "$@") \
      > "$logs/$name.log" 2>&1 &
  fi
  pid=$!
  [ "${QUIET:-0}" = 1 ] || tail -f --pid="$pid" -n +1 "$logs/$name.log"
  wait "$pid"
  rc=$?
  echo "$rc $(( $(date +%s) - start ))" > "$logs/$name.rc"
}

phases=()
if [ $# -eq 0 ]; then
  # Phase 1: each engineless run keeps one core busy; the two vLLMs' go side by side, their logs shown after.
  phase_start=$(date +%s)
  if has 0.32; then
    (QUIET=1 run vllm-0.32-pure 0.32 pure ""; QUIET=1 run vllm-0.32-engineless 0.32 contract engineless) &
  fi
  if has 0.23; then (QUIET=1 run vllm-0.23-engineless 0.23 older engineless) & fi
  wait
  for name in vllm-0.32-pure vllm-0.32-engineless vllm-0.23-engineless; do
    if [ -f "$logs/$name.log" ]; then echo "[test] ===== $name ====="; cat "$logs/$name.log"; fi
  done
  phases+=("phase 1, engineless runs side by side: $(( $(date +%s) - phase_start )) s")
  for version in $VERSIONS; do
    mode=contract; [ "$version" = 0.32 ] || mode=older
    phase_start=$(date +%s)
    run "vllm-$version-engines" "$version" "$mode" engines
    phases+=("vLLM $version e2e packages: $(( $(date +%s) - phase_start )) s")
  done
else
  for version in $VERSIONS; do
    phase_start=$(date +%s)
    run "vllm-$version" "$version" "" "" "$@"
    phases+=("vLLM $version: $(( $(date +%s) - phase_start )) s")
  done
fi

status=0
for rcfile in "$logs"/*.rc; do
  name=$(basename "$rcfile" .rc)
  read -r rc seconds < "$rcfile"
  echo "[test] $name: $(tail -n 1 "$logs/$name.log") (exit $rc, $seconds s)"
  [ "$rc" -eq 0 ] || status=1
done
printf '[test] %s\n' "${phases[@]}"
# One closing line for every run: pytest's counts added up (errors count as failures).
python3 - "$logs"/*.log <<'EOF'
import re, sys
totals = {"passed": 0, "failed": 0, "skipped": 0}
for path in sys.argv[1:]:
    text = open(path, errors="replace").read().splitlines()
    closing = [line for line in text if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)]
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", closing[-1] if closing else ""):
        totals["failed" if word.startswith("error") else word] += int(n)
print(f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
EOF
exit "$status"

#!/usr/bin/env bash
# The whole test suite on every tested vLLM, on a fresh machine or an old one (what CI runs, via .ci/run).
# Real vLLM engines, real Mooncake engines (TCP) and real ZMQ, all on 127.0.0.1.
#
#   1. vLLM 0.32 (newest CPU build): scripts/setup.sh makes .venv, then the suite runs from this tree.
#   2. vLLM 0.23 (what vllm-ascend 0.23.0.post1 runs): scripts/setup_vllm_release.sh 0.23.0 makes its own venv once
#      per machine and builds this package against its torch in a copy of the tree (build/vllm-0.23.0/src), where the suite runs.
#
# Both runs use scripts/run_suite.sh, the same pytest invocation the Ascend workflow uses. Which tests each vLLM
# runs is the rule in tests/conftest.py: vLLM 0.32 runs the pure unit tests (vLLM and Mooncake made unimportable:
# the check that they are pure) and then all the rest; vLLM 0.23 runs the rest less the packages named in
# NEWEST_VLLM_ONLY (each with the package that exercises its vLLM seams on 0.23). Arguments, when given, are
# passed to pytest on both versions instead, whole (default: the whole tests/ directory, split as above).
# KVP2P_TEST_VLLM="0.32" or "0.23" runs only one. Both always run; exits non-zero when either fails. The last line
# adds up every run's counts.
#
# CI mode (KVP2P_CI=1, tests/support/ci_mode.py): a test that would skip because the machine lacks something CI's
# machine has (the C++ extension, network namespaces, a second core ...) fails instead. In the full run (no
# arguments) every part's skips are then held to tests/expected_skips.toml by scripts/check_skips.py: a skip not on
# the list, or a listed one that did not happen, fails the run, naming the test and the reason.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VERSIONS=${KVP2P_TEST_VLLM:-0.32 0.23}
status=0
summary=()
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
export KVP2P_CI=1
# check_skips VLLM PART: that part's skips (written by tests/support/skip_log.py) against the list; fails when they
# differ. Only the full run has a list to be held to.
check_skips() {
  python3 scripts/check_skips.py --vllm "$1" --run "$2" "$logs/skips-$1-$2.jsonl" > "$logs/check-$1-$2.txt" 2>&1
  local check=$?
  cat "$logs/check-$1-$2.txt"
  summary+=("vLLM $1 ($2) $(head -n 1 "$logs/check-$1-$2.txt" | sed 's/^\[check-skips\] vLLM [^ ]* [^ ]*: /skips: /')")
  return $check
}

bash scripts/setup_debian.sh || exit 1  # both vLLMs' runs need its packages (setup.sh runs it too)
for version in $VERSIONS; do
  start=$(date +%s)
  case "$version" in
    0.32)
      bash scripts/setup.sh || exit 1
      rc=0
      if [ $# -eq 0 ]; then
        echo "[test] ===== vLLM 0.32 ($ROOT/.venv): pure unit tests, without vLLM and Mooncake ====="
        KVP2P_TESTS=pure KVP2P_SKIP_LOG="$logs/skips-0.32-pure.jsonl" bash scripts/run_suite.sh "$ROOT/.venv/bin/python" \
          2>&1 | tee "$logs/vllm-0.32-pure.log"
        rc=${PIPESTATUS[0]}
        check_skips 0.32 pure || rc=1
        echo "[test] ===== vLLM 0.32 ($ROOT/.venv): the rest ====="
        KVP2P_TESTS=contract KVP2P_SKIP_LOG="$logs/skips-0.32-contract.jsonl" \
          bash scripts/run_suite.sh "$ROOT/.venv/bin/python" 2>&1 | tee "$logs/vllm-$version.log"
        [ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
        check_skips 0.32 contract || rc=1
      else
        echo "[test] ===== vLLM 0.32 ($ROOT/.venv) ====="
        bash scripts/run_suite.sh "$ROOT/.venv/bin/python" "$@" 2>&1 | tee "$logs/vllm-$version.log"
        rc=${PIPESTATUS[0]}
      fi
      ;;
    0.23)
      PY023=$(bash scripts/setup_vllm_release.sh 0.23.0 | tail -n 1) || exit 1
      echo "[test] ===== vLLM 0.23 ($PY023, tree copy build/vllm-0.23.0/src) ====="
      mode=older skip_log="$logs/skips-0.23-older.jsonl"; [ $# -eq 0 ] || mode="" skip_log=""
      (cd build/vllm-0.23.0/src && KVP2P_TESTS=$mode KVP2P_SKIP_LOG=$skip_log bash scripts/run_suite.sh "$PY023" "$@") \
        2>&1 | tee "$logs/vllm-$version.log"
      rc=${PIPESTATUS[0]}
      [ $# -gt 0 ] || check_skips 0.23 older || rc=1
      ;;
    *)
      echo "[test] unknown vLLM version '$version' in KVP2P_TEST_VLLM (known: 0.32 0.23)" >&2
      exit 2
      ;;
  esac
  for log in "$logs"/vllm-"$version"*.log; do
    summary+=("vLLM $version ($(basename "$log" .log)): $(tail -n 1 "$log")")
  done
  summary+=("vLLM $version: exit $rc in $(( $(date +%s) - start )) s")
  [ "$rc" -eq 0 ] || status=1
done

printf '[test] %s\n' "${summary[@]}"
# One closing line for both runs: pytest's counts added up (errors count as failures).
python3 - "$logs"/vllm-*.log <<'EOF'
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

#!/usr/bin/env bash
# The whole test suite on every tested vLLM, on a fresh machine or an old one (what CI runs, via .ci/run).
# Real vLLM engines, real Mooncake engines (TCP) and real ZMQ, all on 127.0.0.1.
#
#   1. vLLM 0.32 (newest CPU build): scripts/setup.sh makes .venv, then the suite runs from this tree.
#   2. vLLM 0.23 (what vllm-ascend 0.23.0.post1 runs): scripts/setup_vllm023.sh makes its own venv once per machine
#      and builds this package against its torch in a copy of the tree (build/vllm023/src), where the suite runs.
#
# Both runs use scripts/run_suite.sh, the same pytest invocation the Ascend workflow uses; arguments are passed
# to pytest in both (default: the whole tests/ directory). KVP2P_TEST_VLLM="0.32" or "0.23" runs only one.
# Both always run; exits non-zero when either fails. The last line adds up both runs' counts.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
VERSIONS=${KVP2P_TEST_VLLM:-0.32 0.23}
status=0
summary=()
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT

for version in $VERSIONS; do
  start=$(date +%s)
  case "$version" in
    0.32)
      bash scripts/setup.sh || exit 1
      echo "[test] ===== vLLM 0.32 ($ROOT/.venv) ====="
      bash scripts/run_suite.sh "$ROOT/.venv/bin/python" "$@" 2>&1 | tee "$logs/vllm-$version.log"
      rc=${PIPESTATUS[0]}
      ;;
    0.23)
      PY023=$(bash scripts/setup_vllm023.sh | tail -n 1) || exit 1
      echo "[test] ===== vLLM 0.23 ($PY023, tree copy build/vllm023/src) ====="
      (cd build/vllm023/src && bash scripts/run_suite.sh "$PY023" "$@") 2>&1 | tee "$logs/vllm-$version.log"
      rc=${PIPESTATUS[0]}
      ;;
    *)
      echo "[test] unknown vLLM version '$version' in KVP2P_TEST_VLLM (known: 0.32 0.23)" >&2
      exit 2
      ;;
  esac
  summary+=("vLLM $version: pytest exit $rc in $(( $(date +%s) - start )) s: $(tail -n 1 "$logs/vllm-$version.log")")
  [ "$rc" -eq 0 ] || status=1
done

printf '[test] %s\n' "${summary[@]}"
# One closing line for both runs: pytest's counts added up (errors count as failures).
python3 - "$logs"/vllm-*.log <<'EOF'
import re, sys
totals = {"passed": 0, "failed": 0, "skipped": 0}
for path in sys.argv[1:]:
    text = open(path, errors="replace").read().splitlines()
    closing = [line for line in text if re.search(r"\d+ (passed|failed|errors?)\b", line)]
    for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", closing[-1] if closing else ""):
        totals["failed" if word.startswith("error") else word] += int(n)
print(f"total: {totals['passed']} passed, {totals['failed']} failed, {totals['skipped']} skipped")
EOF
exit "$status"

#!/usr/bin/env bash
# Every vLLM release with a CPU build between the two CI runs (0.23 and 0.32), checked the way CI checks those two:
# for each, its environment is made once per machine (scripts/setup_vllm_release.sh), this package is built
# against its torch in a tree copy, and there the contract tests run:
#   * tests/scheduler: the connector driven by that release's real Scheduler (lifecycles, hostile params, hybrid
#     groups, speculative-decoding look-ahead, the support verdict);
#   * tests/e2e/test_vllm_versions.py and two tests of tests/e2e/test_pd_end_to_end.py: real `vllm serve` P and D
#     and the proxy, P/D answers compared with the single instance's (four prompts), a corrupted transfer that
#     must change the answer, the KV-cache route that release has, and the start-up line.
# Results go to docs/vllm_releases.json (one entry per release: date, torch, counts, seconds, the commit it ran at,
# and "ran": the git object id of each path a release check runs, `scripts/vllm_releases_table.py --ran COMMIT`),
# from which `python scripts/vllm_releases_table.py` prints the table of docs/compatibility.md: a record is current
# while HEAD has those same objects. Not part of CI (an hour and ~35 GB the first time); CI keeps 0.23 and the newest.
#
# What runs is the tree of HEAD's commit (git archive into the copy), not the working tree, so the record's
# "commit" is exactly what was tested; KVP2P_RELEASES_WORKTREE=1 tests the working tree instead (uncommitted
# work), and then "dirty" lists the uncommitted paths among those the rule watches (such a record is never
# current: docs/compatibility.md, "When a record says tested").
#
#   bash scripts/check_vllm_releases.sh                  # 0.24.0 ... 0.31.0
#   bash scripts/check_vllm_releases.sh 0.27.1 0.30.0    # some of them
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
RELEASES=("$@")
[ ${#RELEASES[@]} -gt 0 ] || RELEASES=(0.24.0 0.25.0 0.25.1 0.26.0 0.27.0 0.27.1 0.28.0 0.29.0 0.30.0 0.31.0)
TESTS=(tests/scheduler tests/e2e/test_vllm_versions.py
       "tests/e2e/test_pd_end_to_end.py::test_disaggregated_output_equals_single_instance"
       "tests/e2e/test_pd_end_to_end.py::test_corrupted_transfer_changes_the_output")
RESULTS="$ROOT/docs/vllm_releases.json"
status=0
for version in "${RELEASES[@]}"; do
  start=$(date +%s)
  log="$ROOT/build/vllm-$version.log"
  mkdir -p build
  echo "[releases] ===== vLLM $version ====="
  commit=$(git rev-parse HEAD)
  ran=$(python3 scripts/vllm_releases_table.py --ran "$commit") || exit 2
  if [ "${KVP2P_RELEASES_WORKTREE:-}" = 1 ]; then
    export KVP2P_SRC_COMMIT=""
    # shellcheck disable=SC2046
    dirty=$(git status --porcelain --untracked-files=all -- $(python3 scripts/vllm_releases_table.py --paths) \
      | cut -c4- | paste -sd, -)
  else
    export KVP2P_SRC_COMMIT=$commit dirty=""
  fi
  if py=$(bash scripts/setup_vllm_release.sh "$version" 2> >(tee "$log.setup" >&2) | tail -n 1) && [ -x "$py" ]; then
    (cd "build/vllm-$version/src" && bash scripts/run_suite.sh "$py" "${TESTS[@]}") 2>&1 | tee "$log"
    rc=${PIPESTATUS[0]}
  else
    py="" rc=3
    echo "environment could not be made (build/vllm-$version.log.setup)" | tee "$log"
  fi
  [ "$rc" -eq 0 ] || status=1
  python3 - "$RESULTS" "$version" "$rc" "$(( $(date +%s) - start ))" "$log" "$py" "$commit" "$dirty" "$ran" <<'PYEOF'
import datetime, json, re, subprocess, sys
path, version, rc, seconds, log, py, commit, dirty, ran = sys.argv[1:]
text = open(log, errors="replace").read().splitlines()
closing = [line for line in text if re.search(r"\d+ (passed|failed|skipped|errors?)\b", line)]
counts = {w if not w.startswith("error") else "failed": 0 for w in ("passed", "failed", "skipped")}
for n, word in re.findall(r"(\d+) (passed|failed|skipped|errors?)\b", closing[-1] if closing else ""):
    counts["failed" if word.startswith("error") else word] += int(n)
torch = ""
if py:
    torch = subprocess.run([py, "-c", "import torch; print(torch.__version__)"], capture_output=True,
                           text=True).stdout.strip()
failures = [line.split(" - ")[0] for line in text if line.startswith(("FAILED ", "ERROR "))]
try:
    results = json.load(open(path))
except (OSError, ValueError):
    results = {}
results[version] = {"date": datetime.date.today().isoformat(), "torch": torch, "exit": int(rc),
                    "seconds": int(seconds), **counts, "failures": failures[:20], "commit": commit,
                    "dirty": [p for p in dirty.split(",") if p], "ran": json.loads(ran)}
with open(path, "w") as f:
    json.dump(dict(sorted(results.items(), key=lambda kv: [int(x) for x in kv[0].split(".")])), f, indent=1)
    f.write("\n")
print(f"[releases] vLLM {version}: exit {rc}, {counts}, {seconds} s, at {commit[:12]}"
      + (f" + uncommitted {dirty}" if dirty else ""))
PYEOF
done
exit "$status"

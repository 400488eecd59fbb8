#!/usr/bin/env bash
# The one pytest invocation every environment runs: CI on CPU (vLLM 0.32 in .venv, vLLM 0.23 in its own venv, see
# scripts/test.sh) and the Ascend 910B workflow (.github/workflows/ascend-910b.yml). Usage:
#   scripts/run_suite.sh PYTHON [pytest arguments; default: tests]
set -euo pipefail
PY=$1; shift
export MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
[ $# -gt 0 ] || set -- tests
exec "$PY" -m pytest -p no:cacheprovider -ra "$@"

#!/usr/bin/env bash
# The whole test suite, on a fresh machine or an old one: sets up what it needs, then runs pytest.
# Real vLLM engines, real Mooncake engines (TCP) and real ZMQ, all on 127.0.0.1.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
exec .venv/bin/python -m pytest -p no:cacheprovider -ra "$@" tests

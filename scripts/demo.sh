#!/usr/bin/env bash
# The main job on one machine: P and D vLLM instances plus the proxy on 127.0.0.1 with a tiny local model;
# sends a few prompts, prints the answers and what D pulled from P, then stops everything it started.
# Both engines advertise 127.0.0.1 (VLLM_KVP2P_HOST, set by vllm_kvp2p/testing/server.py): no traffic leaves loopback.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export MC_LOG_LEVEL=${MC_LOG_LEVEL:-ERROR}
exec .venv/bin/vllm-kvp2p-demo "$@"

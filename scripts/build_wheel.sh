#!/usr/bin/env bash
# Build vllm_kvp2p's sdist and wheel into dist/ with `python -m build`, against the torch of the Python that runs
# this script ($PYTHON, default: python3 on PATH). Run it inside the environment the wheel goes into (vLLM's
# venv, the vllm-ascend image): the wheel's _arena links that torch's libc10 and is refused at load
# (vllm_kvp2p/platform/arena.py) under a torch of another major.minor.
#
#   PYTHON=/path/to/venv/bin/python bash scripts/build_wheel.sh
#   CMAKE_ARGS=-DKVP2P_BUILD_NPU=ON bash scripts/build_wheel.sh     # Ascend: after sourcing CANN's set_env.sh
#
# --no-isolation: the build uses this environment's torch (and setuptools, pybind11, cmake), never a torch pip
# would fetch into an isolated build environment. The only packages it installs are build tools missing here
# (build, wheel, pybind11, cmake, ninja); it installs no torch and changes no vLLM package. `python -m build`
# makes the sdist first and builds the wheel from it, so the wheel build also proves the sdist complete.
# Then: pip install dist/vllm_kvp2p-*.whl (README.md, "Into an existing vLLM environment"; docs/deploy-ascend.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[build_wheel] $PY cannot import torch: run this in the vLLM environment the wheel is for" >&2
  exit 1
fi
# pyproject.toml's build requirements (python -m build --no-isolation checks them) and ninja; pip keeps an installed
# one that meets the pin. setuptools is not installed here: one older than >=64 fails in python -m build.
if ! "$PY" -c "import build, pybind11, cmake, ninja, wheel" 2>/dev/null; then
  echo "[build_wheel] installing the missing build tools (build wheel pybind11 cmake ninja) with $PY -m pip"
  "$PY" -m pip install -q build wheel "pybind11>=2.10" "cmake>=3.22" ninja
fi
"$PY" -c "import torch; print('[build_wheel] building against torch', torch.__version__, 'at', torch.__path__[0])"

rm -f dist/vllm_kvp2p-*.whl dist/vllm_kvp2p-*.tar.gz
"$PY" -m build --no-isolation --outdir dist .

sdist=$(ls dist/vllm_kvp2p-*.tar.gz)
wheel=$(ls dist/vllm_kvp2p-*.whl)
# The wheel carries the extension modules this build configured (_C always; _arena since torch is importable,
# unless CMAKE_ARGS has -DKVP2P_BUILD_ARENA=OFF) and no tests.
"$PY" - "$wheel" "$sdist" <<'PYEOF'
import sys, tarfile, zipfile
wheel, sdist = sys.argv[1:]
names = zipfile.ZipFile(wheel).namelist()
mods = sorted(n for n in names if n.endswith(".so"))
print("[build_wheel] extension modules in the wheel:", ", ".join(mods) or "none")
problems = []
if not any(n.startswith("vllm_kvp2p/_C.") for n in mods):
    problems.append("no vllm_kvp2p/_C.*.so in the wheel")
junk = [n for n in names if n.startswith("tests/") or "__pycache__" in n or n.endswith((".pyc", ".o"))]
if junk:
    problems.append(f"test or build files in the wheel: {junk[:5]}")
src = tarfile.open(sdist).getnames()
root = src[0].split("/", 1)[0]
for need in ("CMakeLists.txt", "setup.py", "pyproject.toml", "csrc/bindings.cpp", "csrc/arena.cpp"):
    if f"{root}/{need}" not in src:
        problems.append(f"{need} missing from the sdist")
if any(n.endswith(".so") for n in src):
    problems.append("a built .so in the sdist")
if problems:
    sys.exit("[build_wheel] " + "; ".join(problems))
PYEOF
ls -l "$sdist" "$wheel"

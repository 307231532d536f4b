#!/usr/bin/env bash
# One entry point for the README's commands and CI:
#   bash scripts/dev.sh demo [args]   create .venv (Python >= 3.12), install, run the main example
#   bash scripts/dev.sh test [args]   create .venv, install, run the test suite
#   bash scripts/dev.sh install       create .venv and install only
#   bash scripts/dev.sh env           create .venv with the requirements, without the package
#   bash scripts/dev.sh deps          print the pip requirements `install` would install here,
#                                     one per line (installs nothing)
# The package is installed editable (pip install -e .): Python started anywhere, the checkout's
# root included, imports the checkout's code. The CUDA backend is compiled when `nvidia-smi -L`
# lists a GPU and nvcc is found; on a machine without a GPU only the host backend (CPU devices)
# is built, which takes seconds instead of minutes. JAX_NVCOMM_CUDA=ON|OFF|AUTO overrides.
# JAX_NVCOMM_WHEEL=path/to.whl installs that wheel (and the CUDA runtime its CUDA module needs)
# instead of building (CI: .ci/run builds the wheel once and tests it).
# jax comes with its CUDA plugin when `nvidia-smi -L` lists a GPU: jax[cuda13] when the driver
# supports CUDA >= 13 (the "CUDA Version" of plain `nvidia-smi`), else jax[cuda12]; plain jax
# otherwise (CI, CPU-only machines). The same choice as pyproject.toml's extras cuda13 / cuda12.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
VENV=${VENV:-.venv}
case "$VENV" in /*) ;; *) VENV="$PWD/$VENV" ;; esac  # absolute: demo/test run from subfolders

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

# CUDA major version the driver supports ("" when no GPU is listed or nvidia-smi is missing).
driver_cuda_major() {
  command -v nvidia-smi >/dev/null 2>&1 || return 0
  local listing header v
  # whole outputs first: `grep -q` / `head` ending a pipe early would SIGPIPE nvidia-smi, and
  # pipefail would read that as "no GPU"
  listing=$(nvidia-smi -L 2>/dev/null) || true
  grep -q '^GPU [0-9]' <<<"$listing" || return 0
  header=$(nvidia-smi 2>/dev/null) || true
  v=$(sed -n 's/.*CUDA Version: *\([0-9][0-9]*\)\..*/\1/p' <<<"$header")
  v=${v%%$'\n'*}
  echo "${v:-12}"  # a GPU whose driver does not print its CUDA version: the older plugin
}

requirements() {
  local major
  major=$(driver_cuda_major)
  if [ -z "$major" ]; then
    echo "jax>=0.11"
    echo "jaxlib>=0.11"
  elif [ "$major" -ge 13 ]; then
    echo "jax[cuda13]>=0.11"
    echo "cuda-python>=13,<14"
  else
    echo "jax[cuda12]>=0.11"
    echo "cuda-python>=12.8,<13"
  fi
  printf '%s\n' "nanobind>=2.4" "scikit-build-core>=0.10" "cmake>=3.26" ninja numpy "pytest>=8" \
    "hypothesis>=6" matplotlib
}

# JAX_NVCOMM_CUDA for the build when the caller did not set it, and a line saying why.
cuda_choice() {
  if [ -n "${JAX_NVCOMM_CUDA:-}" ]; then
    echo "jax_nvcomm: CUDA part: JAX_NVCOMM_CUDA=$JAX_NVCOMM_CUDA (set by you)" >&2
  elif [ -z "$(driver_cuda_major)" ]; then
    export JAX_NVCOMM_CUDA=OFF
    echo "jax_nvcomm: no NVIDIA GPU here (nvidia-smi -L): building the host backend only" \
      "(CPU devices); JAX_NVCOMM_CUDA=ON also compiles the CUDA part (minutes)" >&2
  elif command -v nvcc >/dev/null 2>&1; then
    export JAX_NVCOMM_CUDA=ON
    echo "jax_nvcomm: GPU found: compiling the CUDA part with $(command -v nvcc)" \
      "(a few minutes; progress below)" >&2
  else
    export JAX_NVCOMM_CUDA=OFF
    echo "jax_nvcomm: GPU found but no nvcc on PATH: building without the CUDA part" \
      "(install the CUDA toolkit to use the GPU kernels)" >&2
  fi
}

# pip install of the package itself (args: the pip command after `python -m pip`; default
# `install --no-build-isolation --no-deps -e .`: editable, so Python run in the checkout's root
# imports the checkout's code with the compiled modules of the install). With the CUDA part the
# build's progress lines ([k/N] of ninja) are shown; its whole log goes to $BUILD_LOG
# ($VENV/build.log) and its end is printed on failure. VENV_PY: the python to run pip with.
build_package() {
  local args=("$@")
  [ ${#args[@]} -gt 0 ] || args=(install --no-build-isolation --no-deps -e .)
  local pip=("${VENV_PY:-$VENV/bin/python}" -m pip "${args[@]}")
  if [ "$JAX_NVCOMM_CUDA" = OFF ]; then
    "${pip[@]}" -q
    return
  fi
  local log="${BUILD_LOG:-$VENV/build.log}"
  "${pip[@]}" -v >"$log" 2>&1 </dev/null &
  local pid=$! shown=0 rc=0 steps='^ *\[[0-9]*/[0-9]*\] '  # ninja's lines, as pip -v indents them
  show() {  # the progress lines of the log not shown yet
    local n
    n=$(grep -c "$steps" "$log" || true)
    if [ "$n" -gt "$shown" ]; then
      grep "$steps" "$log" | sed -n "$((shown + 1)),${n}p" | sed 's/^ *//' | cut -c1-100 >&2
      shown=$n
    fi
  }
  while kill -0 "$pid" 2>/dev/null; do sleep 2; show; done
  wait "$pid" || rc=$?
  show
  if [ "$rc" -ne 0 ]; then
    tail -n 40 "$log" >&2
    echo "jax_nvcomm: the build failed; full log: $log" >&2
    return "$rc"
  fi
}

# The requirement that brings the CUDA runtime a built wheel's _cuda module needs (the module
# names libcudart.so.<major>); nothing for a wheel without it.
wheel_cuda_runtime() {
  local major
  major=$("${VENV_PY:-$VENV/bin/python}" - "$1" <<'EOF'
import re, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if "/_cuda" in n and n.endswith(".so"):
            m = re.search(rb"libcudart\.so\.(\d+)", z.read(n))
            print(m.group(1).decode() if m else "")
EOF
)
  case "$major" in
    "") ;;
    12) echo "nvidia-cuda-runtime-cu12>=12.8,<13" ;;
    *) echo "nvidia-cuda-runtime>=$major,<$((major + 1))" ;;
  esac
}

# $VENV with the requirements, without the package
make_env() {
  local reqs
  mapfile -t reqs < <(requirements)
  if [ ! -x "$VENV/bin/python" ]; then
    PY=$(find_python)
    echo "jax_nvcomm: creating $VENV with $PY" >&2
    "$PY" -m venv "$VENV"
  fi
  local pip="$VENV/bin/python -m pip"
  echo "jax_nvcomm: installing ${reqs[*]}" >&2
  $pip install -q --upgrade pip
  $pip install -q "${reqs[@]}"
}

install() {
  make_env
  local pip="$VENV/bin/python -m pip" t0=$SECONDS
  if [ -n "${JAX_NVCOMM_WHEEL:-}" ]; then  # a built wheel instead of the checkout (CI)
    local runtime
    runtime=$(wheel_cuda_runtime "$JAX_NVCOMM_WHEEL")
    echo "jax_nvcomm: installing $JAX_NVCOMM_WHEEL ${runtime}" >&2
    $pip install -q --no-deps --force-reinstall "$JAX_NVCOMM_WHEEL"
    [ -z "$runtime" ] || $pip install -q "$runtime"
    echo "jax_nvcomm: installed the wheel in $((SECONDS - t0)) s" >&2
    return
  fi
  cuda_choice
  build_package
  echo "jax_nvcomm: installed (editable; CUDA backend: $JAX_NVCOMM_CUDA) in $((SECONDS - t0)) s" >&2
}

# sourced (tests call the functions above): define them, run nothing
if [ "${BASH_SOURCE[0]}" != "$0" ]; then return 0; fi

cmd=${1:-test}
shift || true
case "$cmd" in
  install) install ;;
  env) make_env ;;
  deps) requirements ;;
  # run from examples/ and tests/: with a wheel installed (JAX_NVCOMM_WHEEL) the checkout's
  # source folder jax_nvcomm/ (no compiled modules) in the current directory would shadow it
  demo) install; cd examples && exec "$VENV/bin/python" -m jax_nvcomm.demo "$@" ;;
  test) install; cd tests && exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$@" ;;
  *) echo "usage: $0 demo|test|install|env|deps [args]" >&2; exit 2 ;;
esac

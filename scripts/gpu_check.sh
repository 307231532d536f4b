#!/usr/bin/env bash
# GPU correctness run (device machine): single process over all GPUs, one process per GPU,
# processes sharing GPU 0, CUDA-graph loop, then a quick benchmark. Logs in $OUT (or ./gpu_out).
# Usage: bash scripts/gpu_check.sh [quick]
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests/mp:${PYTHONPATH:-} PYTHONUNBUFFERED=1 JAX_NVCOMM_TIMEOUT_S=60
PY=${PY:-python3}
if ! $PY -c "import jax_nvcomm._cuda" 2>/dev/null; then
  echo "building the extension here" | tee -a "$OUT/summary.txt"
  t0=$SECONDS
  cmake -S . -B build/gpu -G Ninja -DJAX_NVCOMM_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90a \
    -DPython_EXECUTABLE="$(command -v $PY)" >"$OUT/build.log" 2>&1 &&
    cmake --build build/gpu -j >>"$OUT/build.log" 2>&1 && cp build/gpu/_*.so jax_nvcomm/
  echo "build: $((SECONDS - t0)) s" | tee -a "$OUT/summary.txt"
fi
NG=$(nvidia-smi -L | wc -l)
echo "GPUs: $NG; $($PY -c 'import jax; print(jax.__version__)')" | tee -a "$OUT/summary.txt"
step() {
  local name=$1 tmo=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" >>"$OUT/all.log"
  timeout "$tmo" "$@" >>"$OUT/all.log" 2>&1
  local rc=$?
  printf '%-14s rc=%-4s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(tail -n 400 "$OUT/all.log" | grep -c PASS) PASS lines" | tee -a "$OUT/summary.txt"
}
L="$PY -m jax_nvcomm.launch"
step sp_coll 90 $PY tests/mp/collectives_mp.py --calls=100
if [ "$NG" -ge 2 ]; then step mp2_coll 90 $L -n 2 --timeout 85 tests/mp/collectives_mp.py --calls=100; fi
step sp_moe 90 $PY tests/mp/moe_mp.py --rounds=20
step sh4_coll 120 $L -n 4 --share-gpu --timeout 115 tests/mp/collectives_mp.py --calls=30
step sp_graph 60 $PY tests/mp/graph_mp.py --iters=100
if [ "$NG" -ge 2 ]; then step mp2_moe 90 $L -n 2 --timeout 85 tests/mp/moe_mp.py --rounds=20; fi
step sh4_moe 120 $L -n 4 --share-gpu --timeout 115 tests/mp/moe_mp.py --rounds=5
step bench_ar 150 $PY -m jax_nvcomm.bench allreduce --quick --out "$OUT/bench"
cat "$OUT/summary.txt"

#!/usr/bin/env bash
# GPU verification runs (device machine). Logs under $OUT (or ./gpu_out): summary.txt, all.log,
# bench/*.json|png. Each part runs in under 10 minutes.
#   bash scripts/gpu_check.sh quick    2-GPU and shared-GPU smoke run + quick all-reduce bench (~90 s)
#   bash scripts/gpu_check.sh shared   package build timing, kernel harnesses (+ compute-sanitizer),
#                                      2/4/8 processes sharing GPU 0: collectives (1,000 calls),
#                                      MoE, CUDA-graph loop, fault cases, example (--nvcomm-only)
#   bash scripts/gpu_check.sh topology device facts (cuda-python), the transport decision on all
#                                      GPUs, 2 processes marked as different hosts (XLA fallback)
#   bash scripts/gpu_check.sh multi    all GPUs: one process driving all, one process per GPU,
#                                      example on all GPUs, full benchmarks with --tune
#   bash scripts/gpu_check.sh pytest   the pytest GPU suite (`pytest -m gpu`, tests/gpu/: kernels
#                                      in-process on every local GPU, one process per GPU when
#                                      there are 2+, two processes sharing GPU 0, CUDA-graph loop,
#                                      fault matrix rows; ~6 min), log in $OUT/pytest_gpu.log
#   bash scripts/gpu_check.sh onegpulat the kernel-latency A/B timings on one GPU (virtual ranks: kernel
#                                      variants against each other, not 2-GPU numbers)
#   bash scripts/gpu_check.sh faults   the fault matrix on GPU 0 (scripts/faults.py), 2 processes
#                                      started directly: a peer killed / raising with timeout 10 s
#                                      (the survivor's named error, fresh GPU work, exit 0), then
#                                      every other case with timeout 5 s; plus the harnesses'
#                                      --error modes when build/ar_h, build/moe_h exist (~5 min).
#                                      Rows in $OUT/faults_table.md (PASS/FAIL per row), details
#                                      (every rank's report) in $OUT/faults_*.json
#   bash scripts/gpu_check.sh faults4  the same with 4 processes sharing GPU 0, and 2 processes
#                                      through the launcher (--share-gpu) (~5 min)
#   bash scripts/gpu_check.sh tune1    one GPU: `tune` at world 1 (tune1/tuning_w1.json, the rows
#                                      for the built-in table) and `bench allreduce --quick` with
#                                      the XLA-best column (best1/); ~5 min with the build
#   bash scripts/gpu_check.sh tuneN    all GPUs: `tune --quick` (TUNE_ARGS), bench allreduce and
#                                      moe --quick with XLA best
#   bash scripts/gpu_check.sh ragged   ragged_all_to_all's GPU tests: in-process, world 1 against
#                                      XLA's, 2 and 4 processes sharing GPU 0, CUDA-graph loops;
#                            raggedmem one process of tests/mp/ragged_mp.py under memcheck
#   bash scripts/gpu_check.sh parity   lax parity in-process (tests/gpu/test_gpu_parity.py: every
#                                      op in every form next to lax, world = local GPUs; ~5 min)
#                            paritymp  tests/mp/parity_mp.py: 2 and 4 processes sharing GPU 0
#                                      (and one per GPU on 2+), forward forms against numpy
#   bash scripts/gpu_check.sh mend     the failure-path fixes of csrc on GPU 0 (virtual ranks; no
#                                      package build): harnesses rebuilt, their new fault cases,
#                                      every case, memcheck, a 2-rank all-reduce table (~7 min)
#   bash scripts/gpu_check.sh mcemu    the multicast all-reduce kernels EMULATED on GPU 0 (virtual ranks,
#                                      no package build, no multicast object, no multimem
#                                      instruction: the SASS is checked first): every case at
#                                      W = 2/4/8 against the references and the unicast kernels,
#                                      graph replays, --error, memcheck + racecheck (~2.5 min)
#   bash scripts/gpu_check.sh multicast_real  ONLY by hand on a machine with NVLink SHARP that may
#                                      use it: refuses unless JAX_NVCOMM_MULTICAST_REAL_OK=1 (what
#                                      the emulation cannot show; allreduce_multicast.cuh)
#   bash scripts/gpu_check.sh raggedk  ragged_all_to_all kernel harness on GPU 0 (virtual ranks;
#                                      no package build): every case and error case, memcheck,
#                                      the --graph-time table in $OUT/ragged_graph_time.txt (~3 min)
#   bash scripts/gpu_check.sh raggedbig ragged_all_to_all's chunked path, kernel harness on GPU 0
#                                      (virtual ranks 1/2/4/8/16; no package build): chunked cases
#                                      (outputs up to 70 x max_message_bytes, graph replays) and
#                                      error cases, memcheck on a subset, the world-1 A/B chunked
#                                      vs one round in $OUT/raggedbig/ab.txt (~2.5 min)
#   bash scripts/gpu_check.sh raggedbig2 the chunked path through the package (needs the package
#                                      build): tests/gpu/test_gpu_ragged.py's outputs of 64 x
#                                      max_message_bytes (world 1, all GPUs), world 1's named
#                                      error, the CUDA-graph runs of ragged_mp.py (1 process, 2
#                                      sharing GPU 0, with its big-output section) (~2 min)
#   bash scripts/gpu_check.sh moeboundk MoE dispatch / combine with bounded slots (calls in rounds,
#                                      moe_layout.h BOUNDED SLOTS), kernel harness on GPU 0 (virtual
#                                      ranks, no package build): every case (bounded and whole-call),
#                                      --error (a bad id in a bounded call's last round), memcheck
#                                      on the tiny bounded cases, the --bounded-time table (~2.5 min)
#   bash scripts/gpu_check.sh moefast  MoE dispatch / combine at moe_layer's decode sizes, kernel harness on
#                                      GPU 0 (virtual ranks, no package build): this tree's kernels
#                                      (against another tree's when MOE_BASE=<its root>), every
#                                      case, --error, memcheck, the phase probes, a (before/after)
#                                      graph-time table (W 1 and 2, 8/32/128 tokens) (~2.5 min)
#   bash scripts/gpu_check.sh moebound bounded MoE slots and ragged_all_to_all's big outputs through
#                                      the package (built if needed): tests/mp/moe_bounded_mp.py
#                                      (calls in rounds, direct and in a fori_loop under command
#                                      buffers) and ragged_mp.py's chunked section, 2 and 4 processes
#                                      sharing GPU 0, then 1 process in the time left (~150 s + build)
#   bash scripts/gpu_check.sh rdot     the grouped expert product kernel (ragged_dot, swiglu) on GPU 0,
#                                      no package build: harness cases (float64 reference), memcheck,
#                                      the decode-shape table against the weight-read bound and the
#                                      tile x cluster sweep (best per shape last) (~2.5 min)
#                            rdotsweep the kernel options (balanced ranges, per-row-count MMA loop, L2
#                                      prefetch, TMA, wgmma) x tiles: cases (each variant vs float64),
#                                      memcheck of the TMA / wgmma variants' cases, the sweep at the
#                                      decode shapes (every result checked), a matrix of time /
#                                      bound per variant last (~2.5 min)
#                            rdotlayer the package's tiles after the sweeps: harness cases (float64),
#                                      the production table, the sweep's next candidates (30 s),
#                                      then the layer rows of bench moelayer (layer, layer
#                                      two-dot; device time from traces) (~2.5 min + build)
#                            rdotpy    tests/test_ragged_dot.py and tests/gpu/test_gpu_ragged_dot.py on
#                                      GPU 0 (the package's op: kernel, graph loop, gradients,
#                                      shard_map; 1, 2 and 4 processes) (~2 min + build)
#                            rdotfinal the three in one: harness cases + the production table (no
#                                      sweep), the op's tests (1, 2, 4 processes), bench moelayer's
#                                      gate / down rows at 32 and 256 experts (~2.5 min + build)
#                            rdotb32   the ragged_dot rows of `bench moelayer` (nvc vs lax.ragged_dot,
#                            rdotb256  device time, weight-read bound) at 32 / 256 experts (~2 min
#                                      each + build)
#   bash scripts/gpu_check.sh moeragged the dropless EP MoE layer (examples/moe_ragged.py): one GPU,
#                                      nvc vs lax.ragged_all_to_all vs a dense reference (forward,
#                                      training step), then 2 and 4 processes sharing GPU 0, nvc
#                                      only, against the one-GPU results (~5 min)
#   bash scripts/gpu_check.sh docs     what a user runs first, on the GPUs: topology CLI (no
#                                      warning), the README's quickstart, every block of
#                                      docs/guide.md, the three small examples; the guide's
#                                      launcher script with 2 and 4 processes sharing GPU 0 and,
#                                      with 2+ GPUs, one process per GPU (~4 min)
#   bash scripts/gpu_check.sh moelayerk the MoE kernel harness with the packed expert rows (moe_layer's
#                                      layout) on GPU 0 (virtual ranks; no package build): every
#                                      case, memcheck of the packed cases (~2 min)
#   bash scripts/gpu_check.sh moelayer  nvc.moe_layer: tests/test_moe_layer.py on GPU 0 (world 1), 2 and
#                                      4 processes sharing GPU 0 (tests/mp/moe_layer_mp.py: float64
#                                      reference, CUDA-graph loop), memcheck of a small case (~150 s)
#                            moelayerbench the layer rows of bench moelayer at world 1 (~120 s)
#   bash scripts/gpu_check.sh wheel    the wheel users install: scripts/build_wheel.sh here (sm_90a
#                                      only, to fit; retagged, no network), installed into a fresh
#                                      venv that sees this machine's jax (a .pth file),
#                                      then from /tmp: import, CUDA_BUILT, which libcudart the
#                                      process holds, one all_reduce on the GPUs (~2.5 min)
#   bash scripts/gpu_check.sh benchragged `bench ragged` (nvc vs lax.ragged_all_to_all at MoE
#                                      shapes, all local GPUs); stepragged: `bench step` ep-ragged
#                                      + high-throughput rows, then 2 processes sharing GPU 0
#   bash scripts/gpu_check.sh jitprof  nvc.jit vs hand-written at world 1 (40 rounds, profiler traces
#                                      of each program), then 4 processes sharing the GPU
#   bash scripts/gpu_check.sh styles   nvc.jit on the public-style models (tests/public_styles/): world 1
#                                      against float64 and jax.jit with loop times (--time), then 2
#                                      and 4 processes sharing GPU 0 (~4 min + build)
#   bash scripts/gpu_check.sh w8ab     the 8-bit-weight kernel's MMA loops A/B on GPU 0 (mma.sync
#                                      against wgmma with A in registers: tests/cuda_harness/
#                                      run_w8_ab.sh, no package build), then the FP8 layer rows of
#                                      bench moelayer at 32 and 256 experts (~6 min + build)
#   bash scripts/gpu_check.sh jit      nvc.jit on unchanged model code (tests/tp_decoder.py, the MoE
#                                      layer on lax's collectives): world 1 (vs jax.jit, hand calls,
#                                      dense), then 2 processes sharing GPU 0; our calls in the
#                                      program, loop time nvc.jit vs hand-written (~2 min + build)
#   bash scripts/gpu_check.sh opforms1 float32 RMSNorm weights and zero-padded widths in the fused
#                                      all-reduce kernels: the all-reduce harness rebuilt, its
#                                      --wtail cases (W 1-8, virtual ranks on GPU 0), then --quick
#                                      in the time left (no package build; ~150 s)
#   bash scripts/gpu_check.sh opforms  the ops' new forms on the package (built if needed): axis_name=,
#                                      tuple-axes communicator, fused [B, S, H] / odd widths /
#                                      float32 weights (both kernels), ragged groups / int16 sizes /
#                                      jvp; world 1, then 2 processes sharing GPU 0 (~100 s + build)
# The 2-GPU run (2 x H200), each part under 10 minutes, in this order:
#   bash scripts/gpu_check.sh twogpu1  GPU suite on 2 GPUs, kernel targets (harness graph and device
#                                      times), the cluster A/B
#   bash scripts/gpu_check.sh twogpu2  bench step, both presets, every layout (ep-ragged included) with
#                                      its bound, XLA best and capture; then one process per GPU
#   bash scripts/gpu_check.sh twogpu3  bench ragged (nvc vs lax.ragged_all_to_all, XLA best), tune on
#                                      2 GPUs with the all-reduce / MoE XLA-best tables
# `shared` is the parts harness, share, faults, demo1, bench1 in turn; parts may be named directly and
# several modes given at once (e.g. `gpu_check.sh harness share`) to fit one call. A prebuilt
# build/ar_h and build/moe_h (nvcc -arch=sm_90a, see the harness step) skip the harness build.
# With NVC_BUILD_BG=1 the package build that is timed runs in the background (into
# /tmp/nvc_site, not used) while the steps use the jax_nvcomm importable from here.
# Never sets JAX_NVCOMM_MULTICAST or NCCL variables (multicast stays off on shared machines),
# except part multicast_real, which refuses to start without JAX_NVCOMM_MULTICAST_REAL_OK=1.
set -u
OUT=${OUT:-gpu_out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/tests/mp:${PYTHONPATH:-} PYTHONUNBUFFERED=1
export JAX_NVCOMM_TIMEOUT_S=${JAX_NVCOMM_TIMEOUT_S:-60}
PY=${PY:-python3}
L="$PY -m jax_nvcomm.launch"

say() { echo "$*" | tee -a "$OUT/summary.txt"; }
step() {  # step NAME TIMEOUT CMD...: runs CMD, appends its output to all.log, one summary line
  local name=$1 tmo=$2; shift 2
  local t0=$SECONDS
  echo "=== $name: $*" >>"$OUT/all.log"
  timeout "$tmo" "$@" >"$OUT/step.log" 2>&1
  local rc=$?
  cat "$OUT/step.log" >>"$OUT/all.log"
  printf '%-16s rc=%-4s %4ss  %s\n' "$name" "$rc" "$((SECONDS - t0))" \
    "$(grep -c -E 'PASS|GOT after' "$OUT/step.log") PASS/GOT lines" | tee -a "$OUT/summary.txt"
  rm -f "$OUT/step.log"
}

build_pkg() {  # build_pkg LABEL: pip build into /tmp/nvc_site, one summary line with its time
  local t0=$SECONDS
  if rm -rf /tmp/nvc_site; $PY -m pip install -q --no-build-isolation --no-deps --target /tmp/nvc_site . >"$OUT/build.log" 2>&1; then
    say "package build on this machine$1: $((SECONDS - t0)) s"
  else
    say "package build FAILED (see build.log)"; return 1
  fi
}

build_rdot_harness() {  # the ragged_dot harness (cases, production table, sweep parts) -> build/rdot_h
  mkdir -p build/rdot "$OUT/rdot"
  local NV="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Icsrc"
  local B=build/rdot H=tests/cuda_harness
  local parts  # 0 .. kSweepParts - 1 (ragged_dot_sweep.h)
  parts=$(seq 0 $(($(sed -nE 's/^constexpr int kSweepParts = ([0-9]+);.*/\1/p' $H/ragged_dot_sweep.h) - 1)) | tr '\n' ' ')
  rm -f $B/*.o
  # the kernel units (16-bit and 8-bit weights: csrc/cuda/ragged_dot*.cu), the sweep parts and
  # both harnesses; build/rdot_w8: the 8-bit weight harness (ragged_dot_w8_harness.cu)
  step rdot_build 240 bash -c "for f in csrc/cuda/ragged_dot*.cu; do
      $NV -c \$f -o $B/\$(basename \$f .cu).o & done
    for p in $parts; do $NV -DRDOT_SWEEP_PART=\$p -c $H/ragged_dot_sweep.cu -o $B/sweep\$p.o & done
    $NV -c $H/ragged_dot_harness.cu -o $B/harness.o &
    $NV -c $H/ragged_dot_w8_harness.cu -o $B/w8harness.o & wait
    $NV -o build/rdot_h \$(ls $B/*.o | grep -v w8harness) &&
    $NV -o build/rdot_w8 \$(ls $B/*.o | grep -vE '/(harness|sweep[0-9]+)[.]o')"
}

ensure_built() {
  if [ "${NVC_BUILD_BG:-0}" = 1 ]; then
    build_pkg " (background)" &  # timing only: the steps use the importable jax_nvcomm
    BUILD_PID=$!
  elif [ "${NVC_REUSE:-0}" = 1 ] && [ -d /tmp/nvc_site/jax_nvcomm ]; then
    # the build of an earlier invocation in this command (same tree)
    export PYTHONPATH=/tmp/nvc_site:$PYTHONPATH PYTHONSAFEPATH=1
  elif [ "$BUILD" = 1 ] || ! $PY -c "import jax_nvcomm._cuda" 2>/dev/null; then
    # the build goes first on the path, and PYTHONSAFEPATH keeps every process (launcher
    # children too) from putting the working directory, whose jax_nvcomm/ lacks the compiled
    # modules, in front of it
    build_pkg "" && export PYTHONPATH=/tmp/nvc_site:$PYTHONPATH PYTHONSAFEPATH=1
  fi
  (cd /tmp && $PY -c "import jax_nvcomm as n, jax; from jax_nvcomm import _ffi; print('CUDA built:', n.CUDA_BUILT, _ffi._cuda.compiled_archs() if _ffi._cuda else '', n.__file__, jax.devices())") \
    2>&1 | tail -1 | tee -a "$OUT/summary.txt"
}

MODES=("$@"); [ ${#MODES[@]} -eq 0 ] && MODES=(quick)
for m in "${MODES[@]}"; do  # before anything runs: real multicast only where a human allowed it
  if [ "$m" = multicast_real ] && [ "${JAX_NVCOMM_MULTICAST_REAL_OK:-0}" != 1 ]; then
    echo "multicast_real: refused. It creates NVLink multicast objects and runs multimem" \
      "instructions; set JAX_NVCOMM_MULTICAST_REAL_OK=1 only on a machine with NVLink SHARP" \
      "whose administrators allow multicast (never on machines shared with other users)." >&2
    exit 2
  fi
done
NG=$(nvidia-smi -L | wc -l)
BUILD=0; for m in "${MODES[@]}"; do [ "$m" = shared ] && BUILD=1; done
say "GPUs: $NG; jax $($PY -c 'import jax; print(jax.__version__)'); modes ${MODES[*]}; $(date -u)"
case "${MODES[*]}" in raggedk | mend | mcemu | raggedbig | opforms1 | wheel | rdot | rdotsweep | moelayerk | moeboundk | moefast) ;; *) ensure_built ;; esac  # no package build

run_part() {
case "$1" in
quick)
  step sp_coll 90 $PY tests/mp/collectives_mp.py --calls=100
  [ "$NG" -ge 2 ] && step mp2_coll 90 $L -n 2 --timeout 85 tests/mp/collectives_mp.py --calls=100
  step sp_moe 90 $PY tests/mp/moe_mp.py --rounds=20
  step sh4_coll 120 $L -n 4 --share-gpu --timeout 115 tests/mp/collectives_mp.py --calls=30
  step sp_graph 60 $PY tests/mp/graph_mp.py --iters=100
  step bench_ar 150 $PY -m jax_nvcomm.bench allreduce --quick --out "$OUT/bench"
  ;;
shared) for p in harness share faults demo1 bench1; do run_part $p; done ;;
twogpu1) for p in pytest kernlat clusterab; do run_part $p; done ;;
twogpu2) run_part stepfull ;;
twogpu3) for p in benchragged tuneN; do run_part $p; done ;;
harness)
  mkdir -p build
  NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I csrc"
  [ -x build/ar_h ] && [ -x build/moe_h ] && [ -x build/ragged_h ] ||
    step harness_build 240 bash -c "$NV -o build/ar_h tests/cuda_harness/allreduce_harness.cu csrc/cuda/allreduce.cu csrc/cuda/allreduce_wf32.cu & $NV -o build/moe_h tests/cuda_harness/moe_harness.cu csrc/cuda/moe.cu & $NV -o build/ragged_h tests/cuda_harness/ragged_harness.cu csrc/cuda/ragged.cu & wait"
  step ar_harness 120 build/ar_h --quick
  step ar_harness_cl4 120 env JAX_NVCOMM_AR_CLUSTER=4 build/ar_h --quick  # clusters of 4 only
  step moe_harness 120 build/moe_h
  step ar_error 120 build/ar_h --error    # timeouts / disagreements: records, no trap
  step moe_error 60 build/moe_h --error  # the bad-expert records, no trap
  step memcheck_moe 120 compute-sanitizer --tool memcheck build/moe_h --only "W4 T=5"
  step racecheck_ar 120 compute-sanitizer --tool racecheck build/ar_h --quick
  # ragged_all_to_all: every case (error cases included) in child processes, then memcheck
  step ragged_harness 240 build/ragged_h
  step memcheck_ragged 240 compute-sanitizer --tool memcheck --error-exitcode 1 build/ragged_h \
    --no-fork --only "misaligned|many blocks|k=70"
  ;;
mend)  # the failure-path fixes of csrc (one-shot tag wait, two-shot poison, ragged first bad
  # slice and k > 256 records, cached occupancy): the three harnesses rebuilt from this tree, the
  # all-reduce fault cases (a third rank absent, a two-shot rank leaving after phase 0), every
  # all-reduce / ragged / MoE case (virtual ranks: ragged_blocks and fused_fits take the cached
  # queries), memcheck of the new ragged error cases, then the all-reduce timing table of 2
  # virtual ranks (ptxas rescheduled the two-shot kernels; compare with an earlier table)
  mkdir -p build
  NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I csrc"
  local H=tests/cuda_harness
  step mend_build 300 bash -c "$NV -o build/ar_h $H/allreduce_harness.cu csrc/cuda/allreduce.cu csrc/cuda/allreduce_wf32.cu &
    $NV -o build/moe_h $H/moe_harness.cu csrc/cuda/moe.cu &
    $NV -o build/ragged_h $H/ragged_harness.cu csrc/cuda/ragged.cu & wait"
  step ar_error 120 build/ar_h --error
  grep -A60 "=== ar_error" "$OUT/all.log" | grep -E "absent|poison|RESULT" |
    tee -a "$OUT/summary.txt"
  step ar_harness 150 build/ar_h --quick
  step ragged_harness 240 build/ragged_h
  grep -A90 "=== ragged_harness" "$OUT/all.log" | grep -E "k=300|FAIL|failure" |
    tee -a "$OUT/summary.txt"
  step memcheck_ragged_err 120 compute-sanitizer --tool memcheck --error-exitcode 1 build/ragged_h \
    --no-fork --only "k=300"
  step moe_harness 120 build/moe_h
  step ar_bench2 120 build/ar_h --bench --ranks 2
  grep -A40 "=== ar_bench2" "$OUT/all.log" | grep -vE "^===" | tail -30 >> "$OUT/summary.txt"
  ;;
mcemu)  # the multicast all-reduce kernels under emulation (allreduce_multicast.cuh "Emulation
  # build": every multimem instruction replaced by unicast loads/stores through the peer table,
  # each rank's own buffer as its "multicast" base; no multicast object, no driver multicast
  # call). The build's SASS must hold no multimem instruction, else nothing runs. Then every
  # case at W = 2, 4, 8 (one-/two-shot, plain/fused/FP8, unicast and multicast, graph replays,
  # queued calls mixing them), the failure paths on the multicast kernels, memcheck and
  # racecheck on a few shapes; logs in $OUT/mcemu/, a PASS/FAIL table last
  mkdir -p build "$OUT/mcemu"
  NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -diag-suppress 128,177 -I csrc"
  local MR=() rows="" n_mm=-1 n_fn=0
  mc_row() {  # mc_row NAME PATTERN...: PASS when the step's rc is 0 and its log has every pattern
    local rc log="$OUT/mcemu/$1.log" name=$1 verdict=PASS; shift
    awk -v h="=== $name:" 'index($0, h) == 1 {on = 1; next} /^=== / {on = 0} on' "$OUT/all.log" >"$log"
    rc=$(grep -E "^$name +rc=" "$OUT/summary.txt" | tail -1 | sed -E 's/.*rc=([0-9]+).*/\1/')
    [ "$rc" = 0 ] || verdict="FAIL(rc=$rc)"
    for pat in "$@"; do grep -qE "$pat" "$log" || verdict="FAIL(no '$pat')"; done
    MR+=("$name $verdict")
  }
  # PTX embedded too (code=compute_90a): the harness reads both back before it runs anything.
  # The two TUs compile side by side, then link.
  rm -f build/ar_mcemu build/ar_mcemu_h.o build/ar_mcemu_k.o build/ar_mcemu_w.o
  local NVE="$NV -gencode=arch=compute_90a,code=compute_90a -DNVC_MULTICAST_EMULATE"
  step mcemu_build 200 bash -c "$NVE -c -o build/ar_mcemu_h.o tests/cuda_harness/allreduce_harness.cu &
    $NVE -c -o build/ar_mcemu_k.o csrc/cuda/allreduce.cu & $NVE -c -o build/ar_mcemu_w.o csrc/cuda/allreduce_wf32.cu & wait
    $NV -o build/ar_mcemu build/ar_mcemu_h.o build/ar_mcemu_k.o build/ar_mcemu_w.o"
  mc_row mcemu_build "."
  # In SASS multimem.ld_reduce is LDGMC and multimem.st.relaxed.sys.v4 is STG.E.128.STRONG.SYS
  # (the package build's multicast kernels hold both; no unicast kernel does): none may remain
  local n_ptx=-1 n_sass=-1
  if [ -x build/ar_mcemu ]; then
    cuobjdump --dump-sass build/ar_mcemu >/tmp/ar_mcemu.sass 2>&1
    cuobjdump --dump-ptx build/ar_mcemu >/tmp/ar_mcemu.ptx 2>&1
    n_mm=$(grep -ci multimem /tmp/ar_mcemu.sass)
    n_sass=$(grep -ciE "multimem|LDGMC|STG\.E\.128\.STRONG\.SYS" /tmp/ar_mcemu.sass)
    n_ptx=$(grep -ci multimem /tmp/ar_mcemu.ptx)
    n_fn=$(grep -cE "Function : .*_mc_kernel" /tmp/ar_mcemu.sass)
  fi
  say "mcemu binary: $n_fn multicast kernel functions in SASS; lines with multimem: SASS $n_mm," \
    "with multimem|LDGMC|STG.E.128.STRONG.SYS: SASS $n_sass, with multimem: PTX $n_ptx (all must be 0)"
  if [ "$n_mm" = 0 ] && [ "$n_sass" = 0 ] && [ "$n_ptx" = 0 ] && [ "$n_fn" -gt 0 ]; then
    MR+=("sass_no_multimem PASS")
    step mcemu_cases 120 build/ar_mcemu --multicast
    mc_row mcemu_cases "RESULT: PASS"
    grep -E "^ ?[0-9] |^W=|FAIL|SASS" "$OUT/mcemu/mcemu_cases.log" | tee -a "$OUT/summary.txt"
    step mcemu_error 60 build/ar_mcemu --multicast --error
    mc_row mcemu_error "RESULT: PASS"
    grep -E " ok$| FAIL$|RESULT" "$OUT/mcemu/mcemu_error.log" | cut -c1-150 | tee -a "$OUT/summary.txt"
    step mcemu_memcheck 90 compute-sanitizer --tool memcheck --error-exitcode 1 \
      build/ar_mcemu --multicast --tiny
    mc_row mcemu_memcheck "ERROR SUMMARY: 0 errors" "RESULT: PASS"
    step mcemu_racecheck 90 compute-sanitizer --tool racecheck --error-exitcode 1 \
      build/ar_mcemu --multicast --tiny
    mc_row mcemu_racecheck "(RACECHECK|ERROR) SUMMARY: 0 (hazards|errors)" "RESULT: PASS"
    grep -hE "SUMMARY|RESULT" "$OUT/mcemu/mcemu_memcheck.log" "$OUT/mcemu/mcemu_racecheck.log" |
      tee -a "$OUT/summary.txt"
  else
    MR+=("sass_no_multimem FAIL(nothing run)")
  fi
  say "== mcemu results"
  for r in "${MR[@]}"; do say "$(printf '  %-18s %s' "${r%% *}" "${r#* }")"; done
  ;;
multicast_real)  # REAL NVLink SHARP: what the emulation (part mcemu) cannot show. Only by hand,
  # on a machine with NVSwitch + fabric manager whose administrators allow multicast; the top of
  # this script refuses the part unless JAX_NVCOMM_MULTICAST_REAL_OK=1. Every GPU, one rank each:
  # (1) the harness built with -DNVC_MULTICAST_REAL (one multicast object over every rank's VMM
  #     buffer, csrc/transport/cuda_multicast.h): every case with small-integer inputs, whose
  #     sums are exact in any order, so the multicast kernels must equal the unicast ones
  #     bitwise (real multimem ordering, indexing, flags, graph replays, queued calls); then
  #     float inputs for the switch's own reduction order (two-shot: within the float64
  #     tolerance, identical on every rank, the differences from unicast counted); --error;
  # (2) the package: the multicast gate must turn on (comm.multicast), then the collectives
  #     against float64 with one process over all GPUs and one process per GPU. Its one-shot ==
  #     two-shot bitwise assertion may fail by the documented last bit (DESIGN.md) on multicast.
  export JAX_NVCOMM_MULTICAST=1
  mkdir -p build "$OUT/multicast_real"
  NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -diag-suppress 128,177 -I csrc"
  step mcreal_build 300 $NV -DNVC_MULTICAST_REAL -o build/ar_mcreal \
    tests/cuda_harness/allreduce_harness.cu csrc/cuda/allreduce.cu csrc/cuda/allreduce_wf32.cu csrc/transport/cuda_multicast.cu \
    csrc/transport/cuda_vmm.cu
  step mcreal_cases 580 build/ar_mcreal --gpus "$NG" --multicast-real
  step mcreal_error 300 build/ar_mcreal --gpus "$NG" --multicast-real --error
  step mcreal_gate 120 $PY -c "import jax, jax_nvcomm as n
c = n.Communicator(jax.make_mesh((len(jax.devices()),), ('x',)), 'x')
print('multicast', c.multicast, '|', c.multicast_reason); assert c.multicast; print('PASS gate'); c.close()"
  step mcreal_coll 300 $PY tests/mp/collectives_mp.py --calls=300
  [ "$NG" -ge 2 ] && step mcreal_collN 300 $L -n "$NG" --timeout 295 tests/mp/collectives_mp.py --calls=300
  grep -E "^ ?[0-9]+ |^W=|FAIL|RESULT|rounding|PASS gate|multicast (True|False)" "$OUT/all.log" | \
    tee "$OUT/multicast_real/results.txt" | tee -a "$OUT/summary.txt"
  unset JAX_NVCOMM_MULTICAST
  ;;
moelayer)  # nvc.moe_layer correctness on GPU 0: the test file's world-1 cases in-process,
  # 2 and 4 processes sharing GPU 0 (no NCCL: our kernels only), each with the CUDA-graph loop,
  # memcheck of one small layer call (~60 s: the first run took 31 s at 1 / 1 rounds)
  step ml_pytest 150 env JAX_NVCOMM_TEST_GPU=1 $PY -m pytest -q -p no:cacheprovider -rfEs \
    tests/test_moe_layer.py
  step ml_sh2 120 $L -n 2 --share-gpu --timeout 115 tests/mp/moe_layer_mp.py --rounds=3 \
    --graph_iters=20
  step ml_sh4 120 $L -n 4 --share-gpu --timeout 115 tests/mp/moe_layer_mp.py --rounds=2 \
    --graph_iters=10
  step ml_memcheck 200 env XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_NVCOMM_TIMEOUT_S=120 \
    compute-sanitizer --tool memcheck --leak-check no --report-api-errors no $PY \
    tests/mp/moe_layer_mp.py --small=1
  grep -hE "ERROR SUMMARY" "$OUT/all.log" | tail -1 | tee -a "$OUT/summary.txt"
  grep -hE "passed|failed|PASS moe_layer_mp" "$OUT/all.log" | tail -8 | tee -a "$OUT/summary.txt"
  ;;
moelayerbench)  # the layer rows of bench moelayer at world 1: layer / composed / xla at hidden
  # 7168, F 2048, 32 and 256 experts, 8 / 32 / 128 tokens, top-8, each with its weight-read
  # bound and device time; the methods' outputs compared at 8 tokens (~120 s)
  step ml_bench 300 $PY -m jax_nvcomm.bench.moelayer_layer --out "$OUT/moelayer"
  grep -hE "vs layer" "$OUT/all.log" | tail -6 | tee -a "$OUT/summary.txt"
  grep -hE "^(experts|-------|[0-9]+ +[0-9]+ +[0-9.]+ )" "$OUT/all.log" | tail -8 | \
    tee -a "$OUT/summary.txt"
  ;;
moelayerk)  # the MoE harness rebuilt from this tree (never a cached build/moe_h): every case,
  # the packed ones (dispatch RECV into / combine SEND from packed rows) included, then memcheck
  # of the three tiny packed cases (scales + zero-token rank, split, graph replay)
  mkdir -p build
  NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I csrc"
  step moel_build 240 $NV -o build/moe_h_layer tests/cuda_harness/moe_harness.cu csrc/cuda/moe.cu
  step moel_harness 200 build/moe_h_layer
  step moel_memcheck 200 compute-sanitizer --tool memcheck --error-exitcode 1 build/moe_h_layer \
    --only "packed tiny"
  grep -hE "^packed|failure|ERROR SUMMARY" "$OUT/all.log" | tee -a "$OUT/summary.txt"
  ;;
raggedk)  # the ragged_all_to_all kernel harness alone: build, cases (PASS/FAIL lines, error cases
  # each in a child process), memcheck (misaligned buffers, many blocks, two staging chunks),
  # graph-time table (decode 1-8 tokens, prefill 512-4096 tokens x top-8 x 7168 bf16)
  mkdir -p build
  NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I csrc"
  [ -x build/ragged_h ] || step ragged_build 240 \
    $NV -o build/ragged_h tests/cuda_harness/ragged_harness.cu csrc/cuda/ragged.cu
  step ragged_harness 240 build/ragged_h
  grep -A80 "=== ragged_harness" "$OUT/all.log" | grep -E "FAIL|failure" | tee -a "$OUT/summary.txt"
  step memcheck_ragged 240 compute-sanitizer --tool memcheck --error-exitcode 1 build/ragged_h \
    --no-fork --only "misaligned|many blocks|k=70"
  grep -A80 "=== memcheck_ragged" "$OUT/all.log" | grep -E "ERROR SUMMARY|failure" | tee -a "$OUT/summary.txt"
  step ragged_time 300 build/ragged_h --graph-time
  grep -A40 "=== ragged_time" "$OUT/all.log" | grep -vE "^===" > "$OUT/ragged_graph_time.txt"
  cat "$OUT/ragged_graph_time.txt" >> "$OUT/summary.txt"
  ;;
rdot)  # ragged_dot kernels alone: the kernel and sweep units in parallel, the correctness cases
  # (every edge case fully checked against float64, each sweep variant x cluster size), the
  # timing table + sweep, then memcheck of the cases without the variants; logs in $OUT/rdot
  build_rdot_harness
  step rdot_cases 60 build/rdot_h
  grep -A300 "=== rdot_cases" "$OUT/all.log" | grep -E "^(PASS|FAIL)" > "$OUT/rdot/cases.txt"
  grep -E "FAIL|failure" "$OUT/rdot/cases.txt" | tee -a "$OUT/summary.txt"
  step rdot_sweep 120 build/rdot_h --sweep
  grep -A2000 "=== rdot_sweep" "$OUT/all.log" | grep -vE "^===" > "$OUT/rdot/sweep.txt"
  grep -vE "^  sweep" "$OUT/rdot/sweep.txt" | tee -a "$OUT/summary.txt"
  step rdot_memcheck 60 compute-sanitizer --tool memcheck --error-exitcode 1 build/rdot_h --no-variants
  grep -A40 "=== rdot_memcheck" "$OUT/all.log" | grep -E "ERROR SUMMARY|failure" | tee -a "$OUT/summary.txt"
  step rdot_w8_cases 180 build/rdot_w8
  grep -A400 "=== rdot_w8_cases" "$OUT/all.log" | grep -E "^(PASS|FAIL)" > "$OUT/rdot/w8cases.txt"
  grep -E "^FAIL|failed" "$OUT/rdot/w8cases.txt" | head -20 | tee -a "$OUT/summary.txt"
  step rdot_w8_time 120 build/rdot_w8 --time
  step rdot_w8_memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 1 build/rdot_w8 --quick
  ;;
rdotsweep)  # the ragged_dot harness with the sweep split into parts (tests/cuda_harness/
  # ragged_dot_sweep.h kSweepParts) compiled in parallel; the cases (every variant x cluster size
  # against float64), memcheck of the cases with the TMA variants (balanced, row-count loop) in at
  # most 25 s, then the sweep (cluster size 1, every variant's result checked, sampled); its
  # matrix and best-per-shape table printed last
  build_rdot_harness
  step rdot_cases 60 build/rdot_h
  grep -A400 "=== rdot_cases" "$OUT/all.log" | grep -E "^(PASS|FAIL)" > "$OUT/rdot/cases.txt"
  say "rdot cases: $(grep -c ^PASS "$OUT/rdot/cases.txt") PASS, $(grep -c ^FAIL "$OUT/rdot/cases.txt") FAIL"
  grep -E "^FAIL" "$OUT/rdot/cases.txt" | head -20 | tee -a "$OUT/summary.txt"
  step rdot_memcheck 25 compute-sanitizer --tool memcheck --error-exitcode 1 build/rdot_h --variants tma
  sed -n '/^=== rdot_memcheck: /,/^=== /p' "$OUT/all.log" | grep -E "ERROR SUMMARY|failure" | tail -2 | tee -a "$OUT/summary.txt"
  step rdot_memcheck_wg 25 compute-sanitizer --tool memcheck --error-exitcode 1 build/rdot_h --variants wgmma
  sed -n '/^=== rdot_memcheck_wg: /,/^=== /p' "$OUT/all.log" | grep -E "ERROR SUMMARY|failure" | tail -2 | tee -a "$OUT/summary.txt"
  # variants that failed or hung in the cases stay out of the sweep (a hang there would end it);
  # one TMA variant wrong: all of them
  local skip
  skip=$(grep -A400 "=== rdot_cases" "$OUT/all.log" | sed -nE 's/^FAIL variant (.*) cluster [0-9]+ .*/\1/p; s/^HANG.*case variant (.*) cluster [0-9]+.*/\1/p' | sort -u | tr '\n' '|')
  case "$skip" in *tma*) skip="${skip}*tma" ;; esac
  # a wgmma variant that hung: the cases after it never ran, so no wgmma variant is timed
  grep -A400 "=== rdot_cases" "$OUT/all.log" | grep -qE "^HANG.*case variant .*wgmma" && skip="${skip}|*wgmma"
  [ -n "$skip" ] && say "rdot sweep skips: $skip"
  step rdot_sweep 95 build/rdot_h --sweep --budget 60 --skip "$skip"
  grep -A3000 "=== rdot_sweep" "$OUT/all.log" | grep -vE "^===" > "$OUT/rdot/sweep.txt"
  grep -E "^FAIL|HANG" "$OUT/rdot/sweep.txt" | head -20 | tee -a "$OUT/summary.txt"
  grep -E "^(copy|E  |[0-9]+ +[0-9]+ +[0-9]+ )" "$OUT/rdot/sweep.txt" | tee -a "$OUT/summary.txt"
  if grep -q "^sweep matrix" "$OUT/rdot/sweep.txt"; then
    sed -n '/^sweep matrix/,$p' "$OUT/rdot/sweep.txt" | tee -a "$OUT/summary.txt"
  else  # the sweep did not finish: the rows it printed on the way
    grep -E "^mrow " "$OUT/rdot/sweep.txt" | tee -a "$OUT/summary.txt"
  fi
  ;;
rdotlayer)  # the grouped kernel with the package's tiles: the harness cases (float64; every
  # variant of the sweep too), its production table, the sweep's next candidates in at most 30 s
  # (matrix last of that step), then nvc.moe_layer's rows of bench moelayer (the layer and its
  # two-dot form, device time from profiler traces); logs in $OUT/rdot, $OUT/moelayer
  build_rdot_harness
  step rdot_cases 60 build/rdot_h
  grep -A400 "=== rdot_cases" "$OUT/all.log" | grep -E "^(PASS|FAIL)" > "$OUT/rdot/cases.txt"
  say "rdot cases: $(grep -c ^PASS "$OUT/rdot/cases.txt") PASS, $(grep -c ^FAIL "$OUT/rdot/cases.txt") FAIL"
  grep -E "^FAIL" "$OUT/rdot/cases.txt" | head -20 | tee -a "$OUT/summary.txt"
  local skip
  skip=$(grep -A400 "=== rdot_cases" "$OUT/all.log" | sed -nE 's/^FAIL variant (.*) cluster [0-9]+ .*/\1/p; s/^HANG.*case variant (.*) cluster [0-9]+.*/\1/p' | sort -u | tr '\n' '|')
  step rdot_sweep 75 build/rdot_h --sweep --budget 30 --skip "$skip"
  grep -A3000 "=== rdot_sweep" "$OUT/all.log" | grep -vE "^===" > "$OUT/rdot/sweep.txt"
  grep -E "^(copy|FAIL|HANG|E  |[0-9]+ +[0-9]+ +[0-9]+ )" "$OUT/rdot/sweep.txt" | tee -a "$OUT/summary.txt"
  sed -n '/^sweep matrix/,$p' "$OUT/rdot/sweep.txt" | tee -a "$OUT/summary.txt"
  step ml_bench 200 $PY -m jax_nvcomm.bench.moelayer_layer --layer-methods layer "layer two-dot" \
    --out "$OUT/moelayer"
  grep -hE "vs layer" "$OUT/all.log" | tail -6 | tee -a "$OUT/summary.txt"
  grep -hE "^(experts|-------|[0-9]+ +[0-9]+ +[0-9.]+ )" "$OUT/all.log" | tail -8 | \
    tee -a "$OUT/summary.txt"
  ;;
rdotpy)  # the package's nvc.ragged_dot on GPU 0 against the float64 reference and lax, then
  # tests/gpu/test_gpu_ragged_dot.py (one process, 2 and 4 sharing GPU 0, CUDA-graph loop)
  step rdot_pytest 150 env JAX_NVCOMM_TEST_GPU=1 $PY -m pytest -q -p no:cacheprovider -rfEs \
    tests/test_ragged_dot.py tests/gpu/test_gpu_ragged_dot.py
  grep -hE "passed|failed|^FAILED|^ERROR" "$OUT/all.log" | tail -12 | tee -a "$OUT/summary.txt"
  ;;
rdotfinal)  # the kernel harness (cases, production table), the package's op on GPU 0 (tests),
  # bench moelayer's gate / down rows with device time
  build_rdot_harness
  step rdot_cases 60 build/rdot_h --no-variants
  grep -A300 "=== rdot_cases" "$OUT/all.log" | grep -E "FAIL|failure" | tee -a "$OUT/summary.txt"
  step rdot_time 60 build/rdot_h --time
  grep -A200 "=== rdot_time" "$OUT/all.log" | grep -vE "^===|PASS" | tee -a "$OUT/summary.txt"
  step rdot_pytest 150 env JAX_NVCOMM_TEST_GPU=1 $PY -m pytest -q -p no:cacheprovider -rfEs \
    tests/test_ragged_dot.py tests/gpu/test_gpu_ragged_dot.py
  grep -hE "passed|failed|^FAILED|^ERROR" "$OUT/all.log" | tail -12 | tee -a "$OUT/summary.txt"
  step rdot_bench 150 $PY -m jax_nvcomm.bench moelayer --experts 32 256 --ops gate down \
    --reps 3 --calls 5 --layer-rows off --out "$OUT/rdotbench"
  grep -A16 "^   E    T     M op" "$OUT/all.log" | tail -16 | tee -a "$OUT/summary.txt"
  ;;
rdotb32 | rdotb256)  # bench moelayer's ragged_dot rows: gate- and down-shaped products and the
  # 3-product block, nvc vs lax.ragged_dot, with device time and the weight-read bound
  local e=${1#rdotb}
  step rdot_bench$e 145 $PY -m jax_nvcomm.bench moelayer --experts $e --reps 5 --calls 5 \
    --layer-rows off --out "$OUT/rdotbench$e"  # the layer rows: part moelayerbench
  grep -A12 "^   E    T     M op" "$OUT/all.log" | tail -12 | tee -a "$OUT/summary.txt"
  ;;
share)  # SHARE_NS: the process counts (default 2 4 8)
  for n in ${SHARE_NS:-2 4 8}; do
    step sh${n}_coll 150 $L -n $n --share-gpu --timeout 145 tests/mp/collectives_mp.py --calls=1000
    step sh${n}_moe 150 $L -n $n --share-gpu --timeout 145 tests/mp/moe_mp.py --rounds=100
    step sh${n}_graph 90 $L -n $n --share-gpu --timeout 85 tests/mp/graph_mp.py --iters=50
  done
  ;;
faults)  # the fault matrix (scripts/faults.py): rows appended to $OUT/faults_table.md
  [ -x build/ar_h ] && step ar_error 120 build/ar_h --error
  [ -x build/moe_h ] && step moe_error 60 build/moe_h --error
  FM="$PY scripts/faults.py --platform gpu --table $OUT/faults_table.md"
  step faults_sh2_dead 300 $FM -n 2 --timeout 10 --cases kill raise \
    --json "$OUT/faults_sh2_dead.json"
  step faults_sh2 480 $FM -n 2 --timeout 5 --json "$OUT/faults_sh2.json" --cases kill-twoshot \
    stall sizes-oneshot sizes-twoshot order expert rows ragged nan
  ;;
faults4)
  FM="$PY scripts/faults.py --platform gpu --table $OUT/faults_table.md"
  step faults_sh4 480 $FM -n 4 --timeout 5 --json "$OUT/faults_sh4.json" --cases kill raise \
    stall sizes-oneshot sizes-twoshot order expert ragged nan
  step faults_launch 240 $FM -n 2 --timeout 5 --start launcher --json "$OUT/faults_launch.json" \
    --cases kill stall sizes-oneshot expert
  ;;
demo1)  # the example: one GPU, then 2 processes sharing it, compared with the stored reference
  step demo_ref 200 $PY -m jax_nvcomm.demo --devices 1 --save-ref /tmp/ref.npz
  step demo_sh2 200 $L -n 2 --share-gpu --timeout 195 -m jax_nvcomm.demo --nvcomm-only --ref /tmp/ref.npz
  ;;
vmm)  # the cuMemCreate + POSIX-fd allocation mode (never multicast: JAX_NVCOMM_MULTICAST unset)
  step vmm_info 60 env JAX_NVCOMM_ALLOC=vmm $PY -c "import jax, jax_nvcomm as n
c = n.Communicator(jax.make_mesh((len(jax.devices()),), ('x',)), 'x')
print('PASS multicast', c.multicast, '|', c.multicast_reason, '| nbytes', c.nbytes); c.close()"
  step vmm_sp 120 env JAX_NVCOMM_ALLOC=vmm $PY tests/mp/collectives_mp.py --calls=200
  [ "$NG" -ge 2 ] && step vmm_mp2 120 env JAX_NVCOMM_ALLOC=vmm $L -n 2 --timeout 115 tests/mp/collectives_mp.py --calls=200
  step vmm_sh2 120 env JAX_NVCOMM_ALLOC=vmm $L -n 2 --share-gpu --timeout 115 tests/mp/collectives_mp.py --calls=200
  ;;
pytest)
  t0=$SECONDS
  JAX_NVCOMM_TEST_GPU=1 timeout "${PYTEST_TIMEOUT:-580}" $PY -m pytest -q -p no:cacheprovider -rfEs -m gpu -v ${PYTEST_TARGET:-tests} \
    >"$OUT/pytest_gpu.log" 2>&1
  rc=$?
  cat "$OUT/pytest_gpu.log" >>"$OUT/all.log"
  say "pytest -m gpu: rc=$rc $((SECONDS - t0))s: $(tail -1 "$OUT/pytest_gpu.log")"
  grep -E '^(FAILED|ERROR|SKIPPED)' "$OUT/pytest_gpu.log" | head -20 | tee -a "$OUT/summary.txt"
  ;;
bench1) step bench_1gpu 200 env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" \
    $PY -m jax_nvcomm.bench allreduce --quick --out "$OUT/bench1" ;;
topology)  # device facts through cuda-python, the transport decision, the multi-host fallback
  step topo_facts 60 $PY -m jax_nvcomm.topology
  step topo_comm 90 $PY -c "import jax, jax_nvcomm as n
c = n.Communicator(jax.make_mesh((len(jax.devices()),), ('x',)), 'x')
t = c.topology
print('PASS fallback', c.xla_fallback, '|', c.transport_reason, '| links', t['link_summary'])
print([(r['rank'], r['host'], r['device'] and r['device']['name']) for r in t['ranks']]); c.close()"
  [ "$NG" -ge 2 ] && step fallback_mp2 150 $L -n 2 --timeout 145 tests/mp/fallback_mp.py
  ;;
multi) run_part multitest; run_part multibench ;;
multitest)
  step sp_coll 120 $PY tests/mp/collectives_mp.py --calls=1000
  step mpN_coll 150 $L -n "$NG" --timeout 145 tests/mp/collectives_mp.py --calls=1000
  step sp_moe 120 $PY tests/mp/moe_mp.py --rounds=100
  step mpN_moe 150 $L -n "$NG" --timeout 145 tests/mp/moe_mp.py --rounds=100
  step sp_graph 90 $PY tests/mp/graph_mp.py --iters=200
  step demo 240 $PY -m jax_nvcomm.demo
  ;;
multibench)
  step bench_ar 300 $PY -m jax_nvcomm.bench allreduce --tune --out "$OUT/bench"
  step bench_moe 240 $PY -m jax_nvcomm.bench moe --out "$OUT/bench"
  ;;
order)  # independent collectives (the call-order work): default XLA flags, then the most concurrency
  step ind_sp 150 $PY tests/mp/independent_mp.py --runs=30
  step ind_sp_conc 150 $PY tests/mp/independent_mp.py --runs=30 --concurrent=1
  [ "$NG" -ge 2 ] && step ind_mpN 150 $L -n "$NG" --timeout 145 tests/mp/independent_mp.py --runs=30 --concurrent=1
  step ind_sh2 150 $L -n 2 --share-gpu --timeout 145 tests/mp/independent_mp.py --runs=5
  grep -h "PASS independent" "$OUT/all.log" | cut -c1-200 | tee -a "$OUT/summary.txt"
  ;;
step)  # whole jitted steps vs XLA (the step-speed work): the package as it is, then what each variant costs
  step step_A 300 $PY -m jax_nvcomm.bench step --presets example --out "$OUT/stepA" --iters 30
  step step_B 240 env JAX_NVCOMM_DECLARE_EFFECT=1 $PY -m jax_nvcomm.bench step --presets example \
    --out "$OUT/stepB" --iters 30
  step step_C 200 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=" \
    $PY -m jax_nvcomm.bench step --presets example --out "$OUT/stepC" --iters 30 --no-trace
  for v in A B C; do echo "== step variant $v"; tail -6 "$OUT/step$v"/bench_*_step.txt; done 2>&1 | tee -a "$OUT/summary.txt"
  ;;
stepD)  # custom calls out of command buffers (XLA cuts its graphs at our calls, as at NCCL's)
  step step_D 240 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,WHILE,CONDITIONAL" \
    $PY -m jax_nvcomm.bench step --presets example --out "$OUT/stepD" --iters 30
  tail -5 "$OUT"/stepD/bench_*_step.txt 2>&1 | tee -a "$OUT/summary.txt"
  ;;
stepAD)  # the package as it is (A) against custom calls outside command buffers (D), alternating
  for i in 1 2; do
    step step_A$i 150 $PY -m jax_nvcomm.bench step --presets example --out "$OUT/stepA$i" --iters 40 --no-trace
    step step_D$i 150 env XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=FUSION,CUBLAS,CUBLASLT,CUDNN,WHILE,CONDITIONAL" \
      $PY -m jax_nvcomm.bench step --presets example --out "$OUT/stepD$i" --iters 40 --no-trace
  done
  for v in A1 D1 A2 D2; do echo "== $v"; tail -4 "$OUT/step$v"/bench_*_step.txt; done 2>&1 | tee -a "$OUT/summary.txt"
  ;;
stepE)  # graph capture off for our calls (JAX_NVCOMM_GRAPH_CAPTURE=0: "_nograph" targets, = D
  # without an XLA flag) against the default, alternating, with traces
  for i in $(seq "${STEPE_N:-2}"); do
    step step_A$i 150 $PY -m jax_nvcomm.bench step --presets example --out "$OUT/stepA$i" --iters 40
    step step_E$i 150 env JAX_NVCOMM_GRAPH_CAPTURE=0 \
      $PY -m jax_nvcomm.bench step --presets example --out "$OUT/stepE$i" --iters 40
  done
  for v in A1 E1 A2 E2; do [ -d "$OUT/step$v" ] || continue; echo "== $v"; tail -4 "$OUT/step$v"/bench_*_step.txt; done 2>&1 | tee -a "$OUT/summary.txt"
  ;;
diag)  # the multi-process split-MoE and varlen scripts run directly, each with its full log
  export XLA_PYTHON_CLIENT_PREALLOCATE=false
  for spec in "split_sp:0:split_moe_mp.py --rounds=8 --iters=20" \
              "split_spg:0:split_moe_mp.py --rounds=8 --iters=20 --graph" \
              "split_mp2:2:split_moe_mp.py --rounds=5 --iters=10" \
              "split_sh2:2s:split_moe_mp.py --rounds=5 --iters=10" \
              "varlen_mp2:2:varlen_mp.py --rounds=20 --grad=1" \
              "varlen_sh2:2s:varlen_mp.py --rounds=20 --grad=0" \
              "varlen_spg:0:varlen_mp.py --rounds=5 --graph=1"; do
    IFS=: read -r name n cmd <<<"$spec"
    case $n in 0) pre="$PY";; 2) pre="$L -n 2 --timeout 110";; 2s) pre="$L -n 2 --share-gpu --timeout 110";; esac
    t0=$SECONDS; timeout 120 $pre tests/mp/$cmd >"$OUT/diag_$name.log" 2>&1; rc=$?
    say "$(printf '%-12s rc=%-4s %4ss  %s PASS lines' "$name" "$rc" "$((SECONDS - t0))" "$(grep -c PASS "$OUT/diag_$name.log")")"
    [ $rc -ne 0 ] && grep -E "Error|error|FAIL|assert|Traceback" "$OUT/diag_$name.log" | head -8 | cut -c1-300 | tee -a "$OUT/summary.txt"
  done
  ;;
newbench)  # the varlen and FP8 benchmarks: varlen gather/scatter, and the FP8 output next to the fused op
  step bench_varlen 170 $PY -m jax_nvcomm.bench varlen --out "$OUT/varlen" --reps 5
  grep -v "^\[" "$OUT/all.log" | grep -A30 "=== bench_varlen" | tail -28 | tee -a "$OUT/summary.txt"
  step bench_arq 170 $PY -m jax_nvcomm.bench allreduce --quick --out "$OUT/arq" --reps 5
  ;;
stepI)  # the step benchmark, example preset, steps in turns with the no-communication bound;
  # STEP_ENV (e.g. JAX_NVCOMM_GRAPH_CAPTURE=0) and STEP_TAG name a variant; traces stay in /tmp
  tag=${STEP_TAG:-A}
  step "step_$tag" 300 env ${STEP_ENV:-} $PY -m jax_nvcomm.bench step --presets ${STEP_PRESETS:-example} \
    --out "/tmp/step$tag" --iters 40 ${STEP_ARGS:-}
  cp /tmp/step$tag/bench_*_step.json "$OUT/step$tag.json" 2>/dev/null
  cat /tmp/step$tag/bench_*_step.txt 2>&1 | sed "s/^/[$tag] /" | tee -a "$OUT/summary.txt"
  ;;
kernlat)  # the kernel-latency work: (1) the all-reduce harness's graph timing (--bench: plain / fused / FP8,
  # one- and two-shot, hidden 4096 and 7168, 1-512 tokens) and its phase probes (a -DNVC_PROBE
  # build); (2) device time per call (--device-time on) of the ops at the targets' sizes;
  # (3) MoE at the example's decode shape and EP2 4 / 128 tokens x 7168. docs/perf/bench_h200x2_kernel_latency.txt
  mkdir -p build
  NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -diag-suppress 128,177 -I csrc"
  AR="tests/cuda_harness/allreduce_harness.cu csrc/cuda/allreduce.cu csrc/cuda/allreduce_wf32.cu"
  [ -x build/ar_h ] || $NV -o build/ar_h $AR
  [ -x build/ar_probe ] || $NV -DNVC_PROBE -o build/ar_probe $AR
  step ar_lat_graph 120 build/ar_h --gpus "$NG" --bench
  step ar_lat_probe 120 build/ar_probe --gpus "$NG" --probe
  step ar_lat 300 $PY -m jax_nvcomm.bench allreduce --hidden 4096 7168 --tokens 1 8 64 128 \
    --methods "nvc oneshot" "nvc fused oneshot" "nvc quant oneshot" "nvc twoshot" "nvc fused twoshot" \
    --device-time on --out /tmp/ar_lat
  step moe_lat_x 150 $PY -m jax_nvcomm.bench moe --tokens 4 --moe-hidden 2048 --experts 128 \
    --methods nvc --dtypes bf16 --device-time on --out /tmp/moe_lat_x
  step moe_lat 200 $PY -m jax_nvcomm.bench moe --tokens 4 128 --methods nvc --dtypes bf16 \
    --device-time on --out /tmp/moe_lat
  for d in ar_lat moe_lat moe_lat_x; do cp /tmp/$d/*.json "$OUT/$d.json" 2>/dev/null; done
  grep -h "^#\|speedup\|^[0-9]\|^shape\|^graph\|oneshot\|twoshot" "$OUT/all.log" | grep -v "^\[" | tail -120 > "$OUT/kernlat.txt"
  ;;
onegpulat)  # kernel-latency A/B timings that one GPU can give (virtual ranks share it: kernel variants
  # compared with each other, not with 2 GPUs): all-reduce graph table with 2 ranks, the cluster
  # kernel off / 4 / 4+2, MoE graph time (fused and split), world 1 against a device copy
  mkdir -p build
  NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -diag-suppress 128,177 -I csrc"
  [ -x build/ar_h ] || $NV -o build/ar_h tests/cuda_harness/allreduce_harness.cu csrc/cuda/allreduce.cu csrc/cuda/allreduce_wf32.cu &
  [ -x build/moe_h ] || $NV -o build/moe_h tests/cuda_harness/moe_harness.cu csrc/cuda/moe.cu &
  wait
  for on in 0 4 2; do
    step og_ar_cl$on 120 env JAX_NVCOMM_AR_CLUSTER=$on build/ar_h --bench --ranks 2
  done
  step og_moe 120 build/moe_h --graph-time
  step og_local 120 build/ar_h --bench-local
  grep -A30 "=== og_" "$OUT/all.log" | grep -E "===|^[0-9]+x|^shape|floor|^ *[0-9]+x[0-9]+ |^example|^EP2|^config" > "$OUT/onegpulat.txt"
  ;;
clusterab)  # the cluster-split fused one-shot (allreduce_oneshot_cluster.cuh): bitwise harness
  # checks, then graph timing off / clusters of 4 / of 4 and 2, in turns (JAX_NVCOMM_AR_CLUSTER)
  mkdir -p build
  NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -diag-suppress 128,177 -I csrc"
  [ -x build/ar_h ] || $NV -o build/ar_h tests/cuda_harness/allreduce_harness.cu csrc/cuda/allreduce.cu csrc/cuda/allreduce_wf32.cu
  step cl_harness1 120 build/ar_h --quick
  [ "$NG" -ge 2 ] && step cl_harness2 120 build/ar_h --gpus 2 --quick
  for i in 1 2; do
    for on in 0 4 2; do  # off, clusters of 4 only, clusters of 4 then 2 (the default)
      step cl_bench_$on$i 120 env JAX_NVCOMM_AR_CLUSTER=$on build/ar_h --gpus "$NG" --bench
    done
  done
  grep -A22 "=== cl_bench" "$OUT/all.log" | grep -E "===|^[0-9]+x|^shape" > "$OUT/clusterab.txt"
  ;;
probes)  # phase probes (-DNVC_PROBE builds): all-reduce block 0 and last block (2 GPUs), MoE
  # kernels (2 virtual ranks on one GPU); docs/perf/kernel_latency.md reads them
  mkdir -p build
  NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -diag-suppress 128,177 -I csrc -DNVC_PROBE"
  [ -x build/ar_probe ] || $NV -o build/ar_probe tests/cuda_harness/allreduce_harness.cu csrc/cuda/allreduce.cu csrc/cuda/allreduce_wf32.cu &
  [ -x build/ar_probe_last ] || $NV -DNVC_PROBE_LAST -o build/ar_probe_last tests/cuda_harness/allreduce_harness.cu csrc/cuda/allreduce.cu csrc/cuda/allreduce_wf32.cu &
  [ -x build/moe_probe ] || $NV -o build/moe_probe tests/cuda_harness/moe_harness.cu csrc/cuda/moe.cu &
  wait
  step probe_ar 120 build/ar_probe --gpus "$NG" --probe
  step probe_ar_last 120 build/ar_probe_last --gpus "$NG" --probe
  step probe_moe 120 build/moe_probe --probe
  grep -E "^[0-9]+x|^shape|^config|^(example|EP2)" "$OUT/all.log" > "$OUT/probes.txt"
  ;;
stepmp)  # one process per GPU, the way multi-host jobs run
  [ "$NG" -ge 2 ] && step step_mpN 300 $L -n "$NG" --timeout 295 -m jax_nvcomm.bench step --presets example --out "$OUT/stepmp" --iters 30 --no-trace --machine "h200x${NG}_mp"
  tail -5 "$OUT"/stepmp/bench_*_step.txt 2>&1 | tee -a "$OUT/summary.txt"
  ;;
stepslice)  # the moe-slice preset (hidden 7168, 256 experts top-8), one process
  step step_slice 400 $PY -m jax_nvcomm.bench step --presets moe-slice --out "$OUT/stepslice" --iters 20 --no-trace
  tail -5 "$OUT"/stepslice/bench_*_step.txt 2>&1 | tee -a "$OUT/summary.txt"
  ;;
stepfull)  # the step benchmark with both presets, one process; then one process per GPU
  step step_full 420 $PY -m jax_nvcomm.bench step --out "$OUT/step" --iters 30
  [ "$NG" -ge 2 ] && step step_mpN 300 $L -n "$NG" --timeout 295 -m jax_nvcomm.bench step --presets example --out "$OUT/step_mp" --iters 30 --machine "h200x${NG}_mp"
  tail -12 "$OUT"/step*/bench_*_step.txt 2>&1 | tee -a "$OUT/summary.txt"
  ;;
tune1)  # one GPU: `python -m jax_nvcomm.tune` at world 1 (the world-1 rows for the built-in
  # table: tune1/tuning_w1.json + .png; paste with `python -m jax_nvcomm.tune --adopt
  # tune1/tuning_w1.json --worlds 1 --into jax_nvcomm/tuning_builtin.json`), then `bench
  # allreduce --quick` with the XLA-best column (best1/allreduce.json + .png; the header lists
  # the flags this jax accepts). TUNE1_ARGS: more tune options (e.g. --dtypes bfloat16)
  step tune_w1 330 env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" \
    $PY -m jax_nvcomm.tune --worlds 1 ${TUNE1_ARGS:-} --out "$OUT/tune1/tuning_w1.json"
  step bench_best1 220 env CUDA_VISIBLE_DEVICES="${CUDA_VISIBLE_DEVICES:-0}" \
    $PY -m jax_nvcomm.bench allreduce --quick --out "$OUT/best1"
  grep -A40 "## tuning rows" "$OUT/all.log" | head -45 >"$OUT/tune1.txt"
  ;;
tuneN)  # all local GPUs: tune every world size (bf16 and the other dtypes), then the quick
  # all-reduce and MoE benchmarks with their XLA-best columns (needs 2+ GPUs to mean anything)
  step tune_all 590 $PY -m jax_nvcomm.tune ${TUNE_ARGS:---quick} --out "$OUT/tuneN/tuning.json"
  step bench_bestN 300 $PY -m jax_nvcomm.bench allreduce --quick --out "$OUT/bestN"
  step moe_bestN 300 $PY -m jax_nvcomm.bench moe --quick --out "$OUT/bestN"
  ;;
ragged)  # ragged_all_to_all: tests/gpu/test_gpu_ragged.py (it starts tests/mp/ragged_mp.py)
  step ragged_pytest 500 env JAX_NVCOMM_TEST_GPU=1 $PY -m pytest -q -p no:cacheprovider -rfEs -m gpu \
    tests/gpu/test_gpu_ragged.py
  ;;
parity)  # lax parity in-process: tests/test_parity.py's matrix on the local GPUs (world 1 on one)
  step parity_pytest 580 env JAX_NVCOMM_TEST_GPU=1 $PY -m pytest -q -p no:cacheprovider -rfEs -m gpu \
    tests/gpu/test_gpu_parity.py -k in_process ;;
paritymp)  # lax parity across processes: 2 and 4 processes sharing GPU 0, one per GPU on 2+
  step parity_sh2 280 $L -n 2 --share-gpu --timeout 270 tests/mp/parity_mp.py
  step parity_sh4 300 $L -n 4 --share-gpu --timeout 290 tests/mp/parity_mp.py
  [ "$NG" -ge 2 ] && step parity_mp2 280 $L -n 2 --timeout 270 tests/mp/parity_mp.py ;;
raggedmem)  # ragged_all_to_all in one process under compute-sanitizer memcheck
  step ragged_memcheck 500 env XLA_PYTHON_CLIENT_PREALLOCATE=false JAX_NVCOMM_TIMEOUT_S=120 \
    compute-sanitizer --tool memcheck --leak-check no $PY tests/mp/ragged_mp.py --rounds=8
  grep -E "ERROR SUMMARY|Invalid|PASS ragged" "$OUT/all.log" | tail -4 | tee -a "$OUT/summary.txt"
  ;;
moeragged)  # examples/moe_ragged.py: world 1 (nvc, lax and the dense reference agree; lax's
  # results stored), then ranks sharing GPU 0 (no NCCL: nvc only) against the stored results
  step mr_1gpu 240 $PY examples/moe_ragged.py --devices 1 --save-ref /tmp/moe_ragged_ref.npz
  for n in 2 4; do
    step mr_sh$n 240 $L -n $n --share-gpu --timeout 235 examples/moe_ragged.py --impl nvc \
      --ref /tmp/moe_ragged_ref.npz
  done
  grep -E "^(\[rank [0-9]+\] )?(moe_ragged:|lax :|nvc :|nvc vs|lax vs|error)" "$OUT/all.log" | \
    tail -20 | tee -a "$OUT/summary.txt"
  ;;
benchragged)  # nvc.ragged_all_to_all vs lax.ragged_all_to_all at MoE shapes, every local GPU
  step bench_ragged 560 $PY -m jax_nvcomm.bench ragged --out "$OUT/ragged" --reps 7
  grep -A40 "^## ragged_all_to_all" "$OUT/all.log" | grep -v "^\[" | tee -a "$OUT/summary.txt"
  ;;
raggedbig)  # ragged_all_to_all's chunked path (any output size in the communicator's memory):
  # the harness rebuilt from this tree, its chunked cases and error cases (child processes), the
  # one-round graph/mixed cases beside them, memcheck on small chunked cases, then the A/B
  # table (world 1: chunked within 10% of one round; 2 / 4 virtual ranks with a slot sweep)
  mkdir -p build "$OUT/raggedbig"
  NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I csrc"
  step raggedbig_build 120 $NV -o build/ragged_h tests/cuda_harness/ragged_harness.cu \
    csrc/cuda/ragged.cu
  step raggedbig_cases 120 build/ragged_h --only "chunked|W8 graph|W4 150|W2 k=70|W1 self"
  grep -A60 "=== raggedbig_cases" "$OUT/all.log" | grep -E "PASS|FAIL|failure" \
    > "$OUT/raggedbig/cases.txt"
  step raggedbig_memcheck 120 compute-sanitizer --tool memcheck --error-exitcode 1 \
    build/ragged_h --no-fork --only "chunked W2 k=1|k=200 0/1|chunked W4 all|chunked W2 graph|chunked, bad slice, send|chunked, recv_sizes disagree (own"
  step raggedbig_ab 90 build/ragged_h --ab
  grep -A60 "=== raggedbig_ab" "$OUT/all.log" | grep -vE "^===" > "$OUT/raggedbig/ab.txt"
  grep -E "FAIL|failure" "$OUT/raggedbig/cases.txt" | tee -a "$OUT/summary.txt"
  cat "$OUT/raggedbig/ab.txt" | tee -a "$OUT/summary.txt"
  ;;
raggedbig2)  # the chunked path through the package: big outputs in-process (world 1, all
  # GPUs), world 1's bad send size named, ragged_mp.py under command buffers (its big section)
  mkdir -p "$OUT/raggedbig2"
  step raggedbig2_pytest 240 env JAX_NVCOMM_TEST_GPU=1 $PY -m pytest -q -p no:cacheprovider \
    -rfEs -m gpu tests/gpu/test_gpu_ragged.py \
    -k "outputs_many_times or world1_bad or command_buffers"
  grep -A40 "=== raggedbig2_pytest" "$OUT/all.log" | grep -E "passed|failed|FAILED|PASS" |
    tail -12 | tee "$OUT/raggedbig2/result.txt" | tee -a "$OUT/summary.txt"
  ;;
stepragged)  # bench step's ep-ragged layout beside high-throughput, both presets, one process;
  # then 2 processes sharing GPU 0 (jax_nvcomm's steps only)
  step step_ragged 360 $PY -m jax_nvcomm.bench step --layouts ep-ragged high-throughput \
    --out "$OUT/step_ragged" --iters 20 --no-trace
  step step_ragged_sh2 200 $L -n 2 --share-gpu --timeout 195 -m jax_nvcomm.bench step \
    --presets example --layouts ep-ragged --out "$OUT/step_ragged_sh2" --iters 10 --no-trace
  tail -8 "$OUT"/step_ragged*/bench_*_step.txt 2>&1 | tee -a "$OUT/summary.txt"
  ;;
docs)  # the user's first contact, on this machine's GPUs (tests/test_guide.py etc. run on CPU)
  step docs_topology 60 $PY -W error -m jax_nvcomm.topology
  step docs_readme 180 $PY tests/doc_blocks.py README.md --first
  step docs_guide 400 $PY tests/doc_blocks.py docs/guide.md
  for ex in tp_mlp ep_moe dp_attention; do step "ex_$ex" 180 $PY "examples/$ex.py"; done
  $PY tests/doc_blocks.py docs/guide.md --launch-script /tmp/guide_launch.py
  for n in 2 4; do
    step "docs_launch_sh$n" 180 $L -n $n --share-gpu --timeout 175 /tmp/guide_launch.py
  done
  [ "$NG" -ge 2 ] && step docs_launch2 180 $L -n 2 --timeout 175 /tmp/guide_launch.py
  local shown="^(backend |custom calls|max \||--- |.*: relative|.*equal|.*agree|2-D mesh|FP8"
  shown+="|DP ->|error|graph capture|oneshot|twoshot|xla:|host |  GPU|  link|\[rank 0\] .*proc)"
  grep -E "$shown" \
    "$OUT/all.log" | tail -40 | tee -a "$OUT/summary.txt"
  ;;
styles)  # the public-style models under nvc.jit: world 1 (float64, jax.jit, loop times), then
  # 2 and 4 processes sharing GPU 0 (a model that keeps an XLA collective prints SKIP there)
  step styles_w1 200 $PY tests/mp/public_styles_mp.py --time
  step styles_sh2 150 $L -n 2 --share-gpu --timeout 145 tests/mp/public_styles_mp.py
  step styles_sh4 180 $L -n 4 --share-gpu --timeout 175 tests/mp/public_styles_mp.py
  grep -E "^(\[rank 0\] )?public_styles|ratio " "$OUT/all.log" | cut -c1-200 | tail -60 | \
    tee -a "$OUT/summary.txt"
  ;;
w8ab)  # the 8-bit kernel's MMA loop variants (harness cases, --time, memcheck; table last), then
  # the FP8 (block-scaled) layer rows at 32 and 256 experts
  step w8ab 420 bash tests/cuda_harness/run_w8_ab.sh "$OUT/w8ab"
  grep -A 40 "^total " "$OUT/all.log" | tail -42 | tee -a "$OUT/summary.txt"
  step w8fp8 200 $PY -m jax_nvcomm.bench moelayer --weights fp8 --experts 32 256 --tokens 8 32 128 \
    --ops block --layer-methods layer xla --out "$OUT/w8fp8"
  grep -A 10 "^experts  tokens" "$OUT/all.log" | tail -10 | tee -a "$OUT/summary.txt"
  ;;
jit)  # nvc.jit on the decoder and the MoE layer of tests/ (tests/mp/jit_check.py): world 1, then
  # 2 processes sharing GPU 0 (our kernels only: NCCL refuses shared GPUs, so no jax.jit row)
  step jit_w1 150 $PY tests/mp/jit_check.py
  step jit_sh2 150 $L -n 2 --share-gpu --timeout 145 tests/mp/jit_check.py
  grep -E "^(\[rank 0\] )?(decoder|moe|jit_check)" "$OUT/all.log" | tail -30 | \
    tee -a "$OUT/summary.txt"
  ;;
jitprof)  # nvc.jit vs hand-written, measured harder: world 1 with 40 alternated rounds and a
  # profiler trace of each program (device time per kernel), then 4 processes sharing GPU 0
  mkdir -p "$OUT/traces"
  step jitp_w1 200 env JIT_CHECK_REPS=40 JIT_CHECK_TRACE="$OUT/traces" JIT_CHECK_HLO=1 \
    $PY tests/mp/jit_check.py
  cp /tmp/jit_check_*.hlo "$OUT/" 2>/dev/null
  local t ts  # the summariser of the machine's shared tools (next to the checkout)
  ts=$(ls {..,../..,../../..}/shared/tools/trace_summary.py 2>/dev/null | head -1)
  say "trace summariser: ${ts:-none found}; traces: $(ls "$OUT/traces" 2>/dev/null | tr '\n' ' ')"
  for t in "$OUT"/traces/*/; do
    [ -n "$ts" ] && step "trace_$(basename "$t")" 60 $PY "$ts" "$t" --steps 1
  done
  step jitp_sh4 200 $L -n 4 --share-gpu --timeout 190 tests/mp/jit_check.py
  rm -rf "$OUT/traces"
  grep -E "^(\[rank 0\] )?(decoder|moe|jit_check)|busy|^== |program|device 0" "$OUT/all.log" | \
    tail -60 | tee -a "$OUT/summary.txt"
  ;;
wheel)  # build the wheel here, install it into a fresh venv, import it and run one op
  rm -rf /tmp/nvc_dist /tmp/nvc_wheel_venv
  step wheel_build 200 env JAX_NVCOMM_CUDA=ON JAX_NVCOMM_CUDA_ARCHS=90a AUDITWHEEL=off \
    PYTHON="$PY" DIST=/tmp/nvc_dist bash scripts/build_wheel.sh
  local whl t0
  whl=$(ls /tmp/nvc_dist/jax_nvcomm-*.whl 2>/dev/null | head -1)
  say "wheel: ${whl:-NONE} ($(grep -o 'built jax_nvcomm.* in [0-9]* s' "$OUT/all.log" | tail -1))"
  [ -n "$whl" ] || return 0
  t0=$SECONDS
  # a venv without pip of its own (ensurepip may be missing) that sees $PY's packages (jax, pip)
  # after its own, through a .pth file (--system-site-packages would show the base
  # interpreter's, not those of a venv that $PY may be); no index (no network)
  local vsp
  $PY -m venv --without-pip /tmp/nvc_wheel_venv &&
    vsp=$(/tmp/nvc_wheel_venv/bin/python -c "import sysconfig; print(sysconfig.get_paths()['purelib'])") &&
    $PY -c "import sys; print('\n'.join(p for p in sys.path if p.endswith(('site-packages', 'dist-packages'))))" \
      >"$vsp/outer_packages.pth" &&
    env -u PYTHONPATH /tmp/nvc_wheel_venv/bin/python -m pip install -q --no-index --no-deps \
      "$whl" >>"$OUT/all.log" 2>&1
  say "wheel: installed into a fresh venv in $((SECONDS - t0)) s (rc $?)"
  cat >/tmp/nvc_wheel_check.py <<'PY'
import time
t = time.time()
import jax, jax.numpy as jnp, numpy as np
from jax.sharding import PartitionSpec as P
import jax_nvcomm as nvc
from jax_nvcomm import _ffi
print(f"wheel import: {time.time() - t:.1f} s; {nvc.__file__}")
print("wheel CUDA_BUILT", nvc.CUDA_BUILT, _ffi._cuda.compiled_archs() if nvc.CUDA_BUILT
      else _ffi.CUDA_IMPORT_ERROR)
maps = open("/proc/self/maps").read().splitlines()
print("wheel cudart loaded:", sorted({l.split()[-1] for l in maps if "libcudart" in l}))
mesh = jax.sharding.Mesh(np.array(jax.devices()), ("x",))
comm = nvc.Communicator(mesh, "x", max_message_bytes=1 << 20)
f = jax.jit(jax.shard_map(lambda x: nvc.all_reduce(x, comm, strategy="oneshot"), mesh=mesh,
                          in_specs=P("x"), out_specs=P()))
W = mesh.size
x = jax.random.normal(jax.random.key(0), (W * 8, 1024), jnp.float32)
calls = sorted(set(__import__("re").findall(r"nvc_\w+", f.lower(x).as_text())))
y = np.asarray(f(x))
ref = np.asarray(x, np.float64).reshape(W, 8, 1024).sum(0)
err = float(np.max(np.abs(y - ref)))
comm.check()
comm.close()
print(f"wheel all_reduce on {W} GPU(s): custom calls {calls}; max |ours - numpy| {err:.1e}; "
      f"{'PASS' if err < 1e-4 and calls else 'FAIL'}")
PY
  # from /tmp and without this script's PYTHONPATH (the checkout would shadow the install)
  step wheel_run 120 env -u PYTHONPATH -u PYTHONSAFEPATH bash -c \
    "cd /tmp && /tmp/nvc_wheel_venv/bin/python /tmp/nvc_wheel_check.py"
  grep -E "^wheel |Traceback|Error" "$OUT/all.log" | tail -12 | tee -a "$OUT/summary.txt"
  ;;
opforms1)  # the fused all-reduce kernels with a float32 weight (16-bit x) and zero-padded odd
  # widths (csrc/kernels/rmsnorm.cuh, rmsnorm_regs.cuh, allreduce_oneshot_cluster.cuh): the
  # all-reduce harness rebuilt from this tree (its two translation units in parallel), --wtail
  # (the float64 reference with the float32 weight and the mean over the true width; a float32
  # weight holding dt values gives the dt weight's bytes, plain and FP8; every epilogue variant
  # the shapes reach; W = 1, 2, 4, 8 virtual ranks on GPU 0; validation of the new arguments),
  # then --quick (every earlier case: the dt-weight paths unchanged) in the time left
  local t0=$SECONDS d="$OUT/opforms1"
  mkdir -p build "$d"
  local NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I csrc"
  step opf_build 150 bash -c "$NV -c -o build/opf_h.o tests/cuda_harness/allreduce_harness.cu &
    $NV -c -o build/opf_ar.o csrc/cuda/allreduce.cu & $NV -c -o build/opf_arw.o csrc/cuda/allreduce_wf32.cu & wait
    $NV -o build/opf_h build/opf_h.o build/opf_ar.o build/opf_arw.o"
  step opf_wtail 90 bash -c "build/opf_h --wtail > $d/wtail.log 2>&1; rc=\$?; cat $d/wtail.log; exit \$rc"
  local left=$((170 - (SECONDS - t0)))
  [ "$left" -gt 20 ] && step opf_quick "$left" bash -c "build/opf_h --quick > $d/quick.log 2>&1; rc=\$?; cat $d/quick.log; exit \$rc"
  { echo "--- opforms1 (float32 weight / padded widths)"; grep -E "FAIL|float32 weight|host validation|RESULT" "$d/wtail.log";
    [ -f "$d/quick.log" ] && { echo "--- --quick"; grep -E "FAIL|RESULT|bitwise" "$d/quick.log" | tail -8; }; } 2>&1 | tee -a "$OUT/summary.txt"
  ;;
opforms)  # the ops' new argument forms (tests/mp/opforms_mp.py) on the built package: world 1
  # (the fused ops' world-1 kernels), then 2 processes sharing GPU 0 (one-shot, two-shot and the
  # cluster kernel, ragged over the shared GPU); logs in $OUT/opforms
  local d="$OUT/opforms"
  mkdir -p "$d"
  step opf_w1 120 bash -c "$PY tests/mp/opforms_mp.py > $d/w1.log 2>&1; rc=\$?; cat $d/w1.log; exit \$rc"
  step opf_sh2 150 bash -c "$L -n 2 --share-gpu --timeout 140 tests/mp/opforms_mp.py > $d/sh2.log 2>&1; rc=\$?; cat $d/sh2.log; exit \$rc"
  { echo "--- opforms (world 1 | 2 processes sharing GPU 0)"; grep -hE "ok$|PASS|Error|error|FAIL" "$d/w1.log" "$d/sh2.log" | grep -v "^\[rank 1\]" | tail -16; } 2>&1 | tee -a "$OUT/summary.txt"
  ;;
moefast)  # MoE dispatch / combine at moe_layer's decode sizes, this tree's kernels, and those of
  # the tree at $MOE_BASE (e.g. a `git archive` of an older commit) when it is set: the MoE
  # harness (this tree's file) built in parallel from this tree's csrc and $MOE_BASE/csrc, each
  # plain and with -DNVC_PROBE; every case
  # (this tree), --error, memcheck of the tiny packed / bounded cases, then --layer-time (fused
  # packed calls, W 1 and 2 virtual ranks on GPU 0, tokens 8/32/128, H 7168, top-8, 32 and 256
  # experts per rank) old then new, and in the time left the phase probes of both and a second
  # timing (new, old; best of the two kept); logs in $OUT/moefast, the before/after table last
  local t0=$SECONDS d="$OUT/moefast" old=/tmp/moefast_old
  mkdir -p build "$d"
  rm -rf "$old" build/mf_*; mkdir -p "$old"
  if [ -n "${MOE_BASE:-}" ]; then cp -r "$MOE_BASE/csrc" "$old/"; else say "moefast: no MOE_BASE: this tree only"; fi
  local NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a" H=tests/cuda_harness/moe_harness.cu
  step mf_build 150 bash -c "$NV -I csrc -o build/mf_new $H csrc/cuda/moe.cu &
    $NV -DNVC_PROBE -I csrc -o build/mf_new_probe $H csrc/cuda/moe.cu &
    if [ -d $old/csrc ]; then $NV -I $old/csrc -o build/mf_old $H $old/csrc/cuda/moe.cu &
      $NV -DNVC_PROBE -I $old/csrc -o build/mf_old_probe $H $old/csrc/cuda/moe.cu & fi; wait
    ls -l build/mf_*"
  local b
  for b in old new; do  # the table first: it is what this part is for
    [ -x build/mf_$b ] && timeout 40 build/mf_$b --layer-time $b >> "$d/layer_time.log" 2>&1
  done
  step mf_cases 90 bash -c "build/mf_new > $d/cases.log 2>&1; rc=\$?; cat $d/cases.log; exit \$rc"
  step mf_error 30 bash -c "build/mf_new --error > $d/error.log 2>&1; rc=\$?; cat $d/error.log; exit \$rc"
  step mf_memcheck 60 bash -c "compute-sanitizer --tool memcheck --error-exitcode 1 build/mf_new \
    --only 'packed tiny|bounded tiny|W4 T=5|groups W2 tiny|groups W2 graph' > $d/memcheck.log 2>&1; rc=\$?; cat $d/memcheck.log; exit \$rc"
  for b in old new; do  # in the time left: the phase probes, a second timing of each build
    [ $((SECONDS - t0)) -lt 125 ] && [ -x build/mf_${b}_probe ] && timeout 20 build/mf_${b}_probe --probe > "$d/probe_$b.log" 2>&1
  done
  for b in new old; do
    [ $((SECONDS - t0)) -lt 130 ] && [ -x build/mf_$b ] && timeout 20 build/mf_$b --layer-time $b >> "$d/layer_time.log" 2>&1
  done
  { echo "--- moefast (MoE dispatch / combine, virtual ranks on GPU 0; $((SECONDS - t0)) s)"
    grep -E "FAIL|failure" "$d/cases.log" | tail -8
    grep -E "^PASS|FAIL" "$d/error.log" | tail -3
    grep -E "ERROR SUMMARY|PASS:|FAIL" "$d/memcheck.log" | tail -3
    for b in old new; do [ -f "$d/probe_$b.log" ] && grep -E "^(config|layer|example|EP2)" "$d/probe_$b.log" | sed "s/^/$b: /"; done
    $PY - "$d/layer_time.log" <<'PYEOF'
import sys, collections
# layer_time.log lines: build W L T | disp comb; best of the two runs of each build
best = collections.defaultdict(lambda: [1e30, 1e30])
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) == 7 and f[0] in ("old", "new") and f[4] == "|":
        k = (f[0], int(f[1]), int(f[2]), int(f[3]))
        best[k] = [min(best[k][0], float(f[5])), min(best[k][1], float(f[6]))]
print("us per call (graph time, fused packed, H 7168 bf16 top-8; W 2 = virtual ranks on one GPU)")
print(f"{'W':>2} {'L/rank':>6} {'tok':>4} | {'disp old':>8} {'new':>7} {'x':>5} | {'comb old':>8} {'new':>7} {'x':>5}")
nan = [float("nan")] * 2
for (W, L, T) in sorted({k[1:] for k in best}):
    o, n = best.get(("old", W, L, T), nan), best.get(("new", W, L, T), nan)
    print(f"{W:>2} {L:>6} {T:>4} | {o[0]:8.2f} {n[0]:7.2f} {o[0] / n[0]:5.2f} | {o[1]:8.2f} {n[1]:7.2f} {o[1] / n[1]:5.2f}")
PYEOF
  } 2>&1 | tee -a "$OUT/summary.txt"
  ;;
moeboundk)  # MoE dispatch / combine with bounded slots: the MoE harness rebuilt from this tree,
  # every case (the bounded ones and the whole-call ones, whose kernels changed beside them),
  # --error (bounded: a bad id in the last round found in the first, every rank at once),
  # memcheck on the tiny bounded cases, the rounds' cost (--bounded-time); logs in $OUT/moeboundk
  local d="$OUT/moeboundk"
  mkdir -p build "$d"
  local NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a -I csrc"
  step moeb_build 120 $NV -o build/moeb_h tests/cuda_harness/moe_harness.cu csrc/cuda/moe.cu
  step moeb_cases 120 bash -c "build/moeb_h > $d/cases.log 2>&1; rc=\$?; cat $d/cases.log; exit \$rc"
  step moeb_error 45 bash -c "build/moeb_h --error > $d/error.log 2>&1; rc=\$?; cat $d/error.log; exit \$rc"
  step moeb_memcheck 120 bash -c "compute-sanitizer --tool memcheck --error-exitcode 1 build/moeb_h \
    --only 'bounded tiny' > $d/memcheck.log 2>&1; rc=\$?; cat $d/memcheck.log; exit \$rc"
  step moeb_time 60 bash -c "build/moeb_h --bounded-time > $d/time.log 2>&1; rc=\$?; cat $d/time.log; exit \$rc"
  { echo "--- moeboundk (bounded MoE slots, virtual ranks on GPU 0)"
    grep -E "^bounded|FAIL|failure" "$d/cases.log"
    grep -E "bounded slots|FAIL|^PASS" "$d/error.log"
    grep -E "ERROR SUMMARY|PASS:|FAIL" "$d/memcheck.log"
    grep -E "^EP2|^config|bounded-time" "$d/time.log"; } 2>&1 | tee -a "$OUT/summary.txt"
  ;;
moebound)  # bounded MoE slots through the package (tests/mp/moe_bounded_mp.py: calls in rounds,
  # direct and a fori_loop under XLA command buffers, against numpy) and ragged_all_to_all's
  # outputs of 64 x max_message_bytes (ragged_mp.py --graph=1, its chunked section), 2 and 4
  # processes sharing GPU 0 (our kernels only: NCCL refuses shared GPUs), then world 1 in the
  # time left; logs in $OUT/moebound
  local t0=$SECONDS d="$OUT/moebound"
  mkdir -p "$d"
  for n in 2 4; do
    step "moeb_sh$n" 75 bash -c "$L -n $n --share-gpu --timeout 70 tests/mp/moe_bounded_mp.py --graph=1 > $d/moe_sh$n.log 2>&1; rc=\$?; cat $d/moe_sh$n.log; exit \$rc"
  done
  for n in 2 4; do
    local left=$((150 - (SECONDS - t0)))
    [ "$left" -gt 20 ] && step "ragbig_sh$n" "$left" bash -c "$L -n $n --share-gpu --timeout $((left - 5)) tests/mp/ragged_mp.py --rounds=2 --graph=1 > $d/ragged_sh$n.log 2>&1; rc=\$?; cat $d/ragged_sh$n.log; exit \$rc"
  done
  local left=$((150 - (SECONDS - t0)))
  [ "$left" -gt 20 ] && step moeb_w1 "$left" bash -c "$PY tests/mp/moe_bounded_mp.py --graph=1 > $d/moe_w1.log 2>&1; rc=\$?; cat $d/moe_w1.log; exit \$rc"
  { echo "--- moebound (bounded MoE slots | ragged chunked; processes sharing GPU 0, CUDA-graph loops)"
    for f in "$d"/moe_sh2.log "$d"/moe_sh4.log "$d"/moe_w1.log; do
      [ -f "$f" ] && grep -hE "^(\[rank 0\] )?\[p0\] (layout|bounded|3 direct|fori_loop|moe_bounded_mp)|Error|FAIL" "$f" | tail -6
    done
    for f in "$d"/ragged_sh2.log "$d"/ragged_sh4.log; do
      [ -f "$f" ] && grep -hE "64 x max_message_bytes|graph check|PASS ragged|Error|FAIL" "$f" | grep -v "^\[rank [1-9]" | tail -4
    done; } 2>&1 | tee -a "$OUT/summary.txt"
  ;;
*) echo "usage: $0 [quick|shared|harness|share|faults|demo1|vmm|bench1|topology|multi|multitest|multibench|pytest|order|step|stepD|stepAD|stepE|stepI|kernlat|onegpulat|clusterab|probes|diag|newbench|stepmp|stepslice|stepfull|ragged|raggedmem|raggedk|parity|paritymp|tune1|tuneN|moeragged|benchragged|stepragged|docs|twogpu1|twogpu2|twogpu3|mend|opforms1|rdot|rdotsweep|rdotlayer|rdotpy|rdotfinal|rdotb32|rdotb256|opforms|wheel|moelayer|moelayerbench|moelayerk|raggedbig|raggedbig2|mcemu|multicast_real|jit|jitprof|styles|w8ab|moeboundk|moebound|moefast]..." >&2; exit 2 ;;
esac
}
for m in "${MODES[@]}"; do run_part "$m"; done
[ -n "${BUILD_PID:-}" ] && wait "$BUILD_PID"
cat "$OUT/summary.txt"

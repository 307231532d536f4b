#!/usr/bin/env bash
# A/B of the one-shot all-reduce's tag check on one GPU: base (the kernels of main before the
# tag check moved into the first poll, kept for this A/B under tests/cuda_harness/ab_base/,
# which mirrors the repository paths of every file that differs) against this tree (the
# variant, csrc/kernels/allreduce_oneshot.cuh step 5). Needs no git: run from the repository
# root of the branch's working tree on a machine with one GPU and nvcc.
#   1. builds tests/cuda_harness/allreduce_harness.cu twice, base and variant, four nvcc jobs
#      in parallel (harness and csrc/cuda/allreduce.cu of each), then links: build/ab/ar_base,
#      build/ab/ar_var
#   2. the variant's correctness: --quick (must print RESULT: PASS) and --error (the fault
#      cases: timeouts, and ranks calling other sizes, named within 1 s; RESULT: PASS)
#   3. --bench --ranks 2 (two virtual ranks sharing the GPU, CUDA graphs of 200 calls) of base
#      and variant in turns, ROUNDS rounds each (order base/var, var/base, ...)
#   4. a table per shape: medians of the rounds, base, variant and variant - base, for the
#      one-shot columns and the two-shot ones (the same two-shot fast path in both: a control
#      for drift between the runs)
# Logs: $OUT (default ab_out): summary.txt, build_*.log, var_quick.log, var_error.log,
# bench_*_N.log, table.txt. About 3 minutes on one H200 with 16 cores (the base compiles while
# the variant's checks run).
# usage: bash scripts/ab_oneshot.sh [--rounds N] [--build-only] [--table DIR]
#   --rounds N     bench rounds per build (default 3)
#   --build-only   steps 1 only (no GPU needed)
#   --table DIR    step 4 only, from the bench logs in DIR
set -u
cd "$(dirname "$0")/.." || exit 2
OUT=${OUT:-ab_out}
ROUNDS=3
BUILD_ONLY=0
TABLE_DIR=""
while [ $# -gt 0 ]; do
  case "$1" in
    --rounds) ROUNDS=${2:?--rounds needs a number}; shift 2 ;;
    --build-only) BUILD_ONLY=1; shift ;;
    --table) TABLE_DIR=${2:?--table needs a folder}; shift 2 ;;
    -h|--help) sed -n '2,/^set -u/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "unknown argument: $1 (see --help)"; exit 2 ;;
  esac
done
case "$ROUNDS" in ''|*[!0-9]*|0) echo "--rounds: a positive number, got '$ROUNDS'"; exit 2 ;; esac

# Step 4: medians per shape and column from the bench logs of one folder.
table() {
  python3 - "$1" <<'EOF'
import glob, os, re, statistics, sys

folder = sys.argv[1]
cols = ["plain1", "plain2", "fused1", "fused2", "quant1", "quant2"]
row = re.compile(r"^(\d+x\d+)\s+\d+\s+\|" + r"\s+(\S+)" * 2 + r"\s+\|" + r"\s+(\S+)" * 2 +
                 r"\s+\|" + r"\s+(\S+)" * 2 + r"\s*$")
data, floor, shapes, runs = {}, {}, [], {}
for build in ("base", "var"):
    files = sorted(glob.glob(os.path.join(folder, f"bench_{build}_*.log")))
    runs[build] = 0
    for f in files:
        text = open(f).read()
        if not re.search(r"^shape\s+bytes", text, re.M):
            continue
        runs[build] += 1
        m = re.search(r"graph node floor \(empty kernel\): ([\d.]+) us", text)
        if m:
            floor.setdefault(build, []).append(float(m.group(1)))
        for line in text.splitlines():
            m = row.match(line)
            if not m:
                continue
            shape = m.group(1)
            if shape not in shapes:
                shapes.append(shape)
            for c, v in zip(cols, m.groups()[1:]):
                if v != "-":
                    data.setdefault((build, shape, c), []).append(float(v))
if not runs.get("base") or not runs.get("var"):
    print(f"no complete bench logs of both builds in {folder} (base {runs.get('base', 0)}, "
          f"variant {runs.get('var', 0)})")
    sys.exit(1)

def med(build, shape, c):
    v = data.get((build, shape, c))
    return statistics.median(v) if v else None

print(f"us per call, median of {runs['base']} (base) / {runs['var']} (variant) runs of "
      "--bench --ranks 2; d = variant - base")
if floor:
    print("graph node floor (empty kernel): base %.2f, variant %.2f" %
          tuple(statistics.median(floor.get(b, [float("nan")])) for b in ("base", "var")))
for title, group in (("one-shot", ["plain1", "fused1", "quant1"]),
                     ("two-shot (same fast path in both builds: a control)",
                      ["plain2", "fused2", "quant2"])):
    print(f"\n{title}")
    print("%-10s" % "shape" + "".join(" | %-6s %6s %6s %6s" % (c, "base", "var", "d")
                                      for c in group))
    sums = {c: [] for c in group}
    for shape in shapes:
        cells = []
        for c in group:
            b, v = med("base", shape, c), med("var", shape, c)
            if b is None or v is None:
                cells.append(" | %-6s %6s %6s %6s" % ("", "-", "-", "-"))
                continue
            sums[c].append(v - b)
            cells.append(" | %-6s %6.2f %6.2f %+6.2f" % ("", b, v, v - b))
        print("%-10s" % shape + "".join(cells))
    print("%-10s" % "mean d" + "".join(
        " | %-6s %6s %6s %+6.2f" % ("", "", "", statistics.mean(sums[c])) if sums[c]
        else " | %-6s %6s %6s %6s" % ("", "", "", "-") for c in group))
EOF
}

if [ -n "$TABLE_DIR" ]; then
  table "$TABLE_DIR"
  exit $?
fi

mkdir -p "$OUT"
say() { echo "$*" | tee -a "$OUT/summary.txt"; }
: >"$OUT/summary.txt"
T0=$SECONDS
B=build/ab
NV="nvcc -std=c++17 -O2 -gencode=arch=compute_90a,code=sm_90a"

# Step 1. The base tree: this tree's csrc and harness with main's versions laid over them.
if [ ! -d tests/cuda_harness/ab_base/csrc ]; then
  say "tests/cuda_harness/ab_base/csrc is missing: no base to compare with"; exit 2
fi
rm -rf "$B" && mkdir -p "$B/base/tests/cuda_harness" || exit 2
cp -r csrc "$B/base/csrc" &&
  cp tests/cuda_harness/allreduce_harness.cu "$B/base/tests/cuda_harness/" &&
  cp -r tests/cuda_harness/ab_base/. "$B/base/" || { say "copying the base tree failed"; exit 2; }
say "base tree: $(cd tests/cuda_harness/ab_base && find . -type f | sed 's|^\./||' | tr '\n' ' ')"
say "nvcc: $(nvcc --version | tail -1)"

compile() {  # compile NAME INCLUDE_DIR SOURCE: one object, its log, its exit status in a file
  $NV -I "$2" -c -o "$B/$1.o" "$3" >"$OUT/build_$1.log" 2>&1
  echo $? >"$B/$1.rc"
}
link() {  # link BUILD: build/ab/ar_BUILD from its two objects; 1 when it failed
  if [ "$(cat "$B/$1_h.rc")" = 0 ] && [ "$(cat "$B/$1_ar.rc")" = 0 ] &&
     $NV -o "$B/ar_$1" "$B/$1_h.o" "$B/$1_ar.o" >"$OUT/build_$1_link.log" 2>&1; then
    say "build $1: ok ($B/ar_$1, $((SECONDS - T0)) s from the start)"
  else
    say "build $1: FAILED (see $OUT/build_$1_*.log)"; return 1
  fi
}
build_base() {  # the base's two objects in parallel, then its link
  compile base_h "$B/base/csrc" "$B/base/tests/cuda_harness/allreduce_harness.cu" &
  compile base_ar "$B/base/csrc" "$B/base/csrc/cuda/allreduce.cu" &
  wait
  link base
}
# The variant first; the base compiles while the variant's checks run on the GPU.
compile var_h csrc tests/cuda_harness/allreduce_harness.cu &
compile var_ar csrc csrc/cuda/allreduce.cu &
wait
link var; var_ok=$?
if [ "$BUILD_ONLY" = 1 ]; then
  build_base || exit 1
  [ "$var_ok" = 0 ] || exit 1
  exit 0
fi
build_base >"$B/build_base.out" 2>&1 &
BASE_PID=$!

# Step 2. The variant's correctness.
check() {  # check NAME TIMEOUT ARGS...: runs the variant, one summary line from RESULT:
  local name=$1 tmo=$2 t=$SECONDS; shift 2
  timeout "$tmo" "$B/ar_var" "$@" >"$OUT/var_$name.log" 2>&1
  local rc=$? res
  res=$(grep -o 'RESULT: [A-Z]*' "$OUT/var_$name.log" | tail -1)
  say "variant $*: rc=$rc ${res:-no RESULT line} ($((SECONDS - t)) s)"
}
if [ "$var_ok" = 0 ]; then
  check quick 150 --quick
  grep -E "FAIL" "$OUT/var_quick.log" | head -20 | tee -a "$OUT/summary.txt"
  check error 90 --error
  grep -E "^  (sizes|timeout)" "$OUT/var_error.log" | tee -a "$OUT/summary.txt"
fi
wait "$BASE_PID"; base_ok=$?
cat "$B/build_base.out"
[ "$var_ok" = 0 ] && [ "$base_ok" = 0 ] || exit 1

# Step 3. Timings in turns.
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then order="base var"; else order="var base"; fi
  for b in $order; do
    t=$SECONDS
    timeout 120 "$B/ar_$b" --bench --ranks 2 >"$OUT/bench_${b}_$r.log" 2>&1
    say "bench $b round $r: rc=$? ($((SECONDS - t)) s)"
  done
done

# Step 4.
table "$OUT" | tee "$OUT/table.txt" | tee -a "$OUT/summary.txt"
say "total $((SECONDS - T0)) s"

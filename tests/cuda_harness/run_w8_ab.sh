#!/usr/bin/env bash
# A/B of the 8-bit-weight ragged_dot kernels' MMA loops on one Hopper GPU (sm_90a), with no
# package build: the package's mma.sync loop (NVC_W8_R64_WG=0, the default) against wgmma with
# A from registers (kernels/ragged_dot_w8_wgmma.cuh; NVC_W8_R64_WG=1: the R 64 tiles, i.e.
# ~32 rows a group, 32 experts x 128 tokens; 2: the R 16 tiles too).
# From the repository root (about 4-5 minutes on an H100; needs nvcc 12.3+ and compute-sanitizer):
#   bash tests/cuda_harness/run_w8_ab.sh [OUTDIR]          (default build/w8_ab)
#   VARIANTS="0 1" MEMCHECK="1" bash tests/cuda_harness/run_w8_ab.sh    (a subset)
# A variant is NVC_W8_R64_WG's value, optionally followed by other macros of
# cuda/ragged_dot_family.cuh after commas: "1,NVC_W8_R64_MT=1" is the wgmma R 64 tile with
# 16 warps of one m16 tile each (4 warpgroups; 128 registers, the cap of 512 threads).
# Steps: build the harness once per variant (the units without 8-bit kernels once; all units in
# parallel; ptxas -v of the 8-bit units kept in OUTDIR/wgV/*.ptxas), then per variant the
# harness's cases against float64 (every line must PASS), `--time` (us per call, x the 8-bit
# weight-read bound), compute-sanitizer memcheck of `--quick` for the wgmma variants; last a
# table: per timed row the us and x of each variant side by side.
# Exit status 1 when a build, a case or a memcheck failed (the table still prints).
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${1:-build/w8_ab}
VARIANTS=${VARIANTS:-"0 1 2 1,NVC_W8_R64_MT=1"}
MEMCHECK=${MEMCHECK:-"2"}
NV="nvcc -std=c++17 -O3 -gencode=arch=compute_90a,code=sm_90a --expt-relaxed-constexpr -Icsrc"
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
W8_UNITS="bf16_i8 bf16_e4m3 f16_i8 f16_e4m3"
bad=0
# a variant's -D flags and its folder name
vflags() { local f="-DNVC_W8_R64_WG=${1%%,*}" x; [ "$1" = "${1#*,}" ] && { echo "$f"; return; }
  IFS=, read -ra x <<< "${1#*,}"; for m in "${x[@]}"; do f="$f -D$m"; done; echo "$f"; }
vname() { echo "wg$1" | tr ',=' '__'; }
mkdir -p "$OUT/common"
t0=$(date +%s)

# ---- build ----
pids=()
for u in ragged_dot ragged_dot_bf16 ragged_dot_f16 ragged_dot_swiglu_bf16 ragged_dot_swiglu_f16; do
  $NV -c csrc/cuda/$u.cu -o "$OUT/common/$u.o" > "$OUT/common/$u.log" 2>&1 & pids+=($!)
done
for v in $VARIANTS; do
  d="$OUT/$(vname $v)"
  mkdir -p "$d"
  for u in $W8_UNITS; do
    $NV $(vflags $v) -Xptxas -v -c csrc/cuda/ragged_dot_w8_$u.cu -o "$d/$u.o" > "$d/$u.ptxas" 2>&1 &
    pids+=($!)
  done
done
for p in "${pids[@]}"; do wait "$p" || bad=1; done
[ $bad = 0 ] || { echo "BUILD FAILED (logs in $OUT/common/*.log, $OUT/wg*/*.ptxas)"; exit 1; }
pids=()
for v in $VARIANTS; do
  n=$(vname $v)
  $NV -o "$OUT/rdot_w8_$n" tests/cuda_harness/ragged_dot_w8_harness.cu "$OUT"/common/*.o \
    "$OUT"/$n/*.o > "$OUT/link_$n.log" 2>&1 & pids+=($!)
done
for p in "${pids[@]}"; do wait "$p" || bad=1; done
[ $bad = 0 ] || { echo "LINK FAILED ($OUT/link_wg*.log)"; exit 1; }
echo "built in $(( $(date +%s) - t0 )) s"

# ptxas of the 8-bit kernels: registers (min-max), spills, local memory, and every C75xx note
# (wgmma serialized, warpgroup.wait / arrive injected), which must not appear
ptx_summary() {
  local f="$OUT/$(vname $1)"
  local regs spills notes
  regs=$(grep -h "Used .* registers" "$f"/*.ptxas | awk '{print $5}' | sort -n | uniq | tr '\n' ' ')
  spills=$(grep -h "spill" "$f"/*.ptxas | awk '$5 != 0 || $9 != 0 || $1 != 0' | wc -l)
  notes=$(grep -h "C75[0-9][0-9]" "$f"/*.ptxas | wc -l)
  echo "registers {$regs} / kernels with spills or stack: $spills / wgmma notes (C75xx): $notes"
}

# ---- runs (each under a time limit: a hang costs at most that) ----
# limited SECONDS LOG CMD...: runs CMD > LOG; non-zero (and a line saying so) on failure
limited() {
  local lim=$1 log=$2 rc; shift 2
  timeout "$lim" "$@" > "$log" 2>&1; rc=$?
  [ $rc = 124 ] && echo "   TIMED OUT after $lim s: $*"
  return $rc
}
for v in $VARIANTS; do
  n=$(vname $v)
  echo "== $(vflags $v): $(ptx_summary $v)"
  limited 150 "$OUT/cases_$n.txt" "$OUT/rdot_w8_$n" || bad=1
  echo "   cases: $(tail -n 1 "$OUT/cases_$n.txt")"
  grep -m 5 "^FAIL\|error" "$OUT/cases_$n.txt" | sed 's/^/   /'
  limited 120 "$OUT/time_$n.txt" "$OUT/rdot_w8_$n" --time || bad=1
  echo "   time: $(head -n 1 "$OUT/time_$n.txt") ($(( $(date +%s) - t0 )) s so far)"
done
for v in $MEMCHECK; do
  case " $VARIANTS " in *" $v "*) ;; *) continue ;; esac
  n=$(vname $v)
  limited 180 "$OUT/memcheck_$n.txt" "$SAN" --tool memcheck --error-exitcode 1 "$OUT/rdot_w8_$n" \
    --quick || bad=1
  echo "== memcheck $(vflags $v) --quick: $(grep "ERROR SUMMARY" "$OUT/memcheck_$n.txt")," \
       "$(grep "passed, .* failed" "$OUT/memcheck_$n.txt" | tail -n 1)"
done

# ---- table: us (x the 8-bit bound) per variant; the 16-bit kernel's x of the first variant ----
echo
echo "total $(( $(date +%s) - t0 )) s; logs in $OUT; rows: E experts, T tokens, the product"
files=()
for v in $VARIANTS; do files+=("$OUT/time_$(vname $v).txt"); done
awk -v vars="$VARIANTS" '
  BEGIN { nv = split(vars, V, " ") }
  FNR == 1 { fi++ }
  $1 ~ /^[0-9]+$/ && NF >= 11 {
    key = $1 " " $2; for (i = 4; i <= NF - 7; i++) key = key " " $i
    if (!(key in seen)) { seen[key] = 1; order[++n] = key; x16[key] = $(NF - 1) }
    t[fi, key] = $(NF - 6); x[fi, key] = $(NF - 4)
  }
  END {
    printf "%-38s", "E T product"
    for (i = 1; i <= nv; i++) printf " %15s", "[" i "] us (x)"
    printf " %7s\n", "16b x"
    for (r = 1; r <= n; r++) {
      k = order[r]; printf "%-38s", k
      for (i = 1; i <= nv; i++)
        if ((i, k) in t) printf " %7.1f (%5s)", t[i, k], x[i, k]; else printf " %15s", "-"
      printf " %7s\n", x16[k]
    }
    # geometric means of x: the R 64 shape (32 experts x 128 tokens) and every row
    for (g = 0; g < 2; g++) {
      printf "%-38s", g == 0 ? "geomean x, 32 x 128 (R 64 tile)" : "geomean x, every row"
      for (i = 1; i <= nv; i++) {
        s = 0; c = 0
        for (r = 1; r <= n; r++) {
          k = order[r]
          if (!((i, k) in x) || x[i, k] <= 0 || (g == 0 && k !~ /^32 128 /)) continue
          s += log(x[i, k]); c++
        }
        if (c > 0) printf " %15.3f", exp(s / c); else printf " %15s", "-"
      }
      printf "\n"
    }
  }' "${files[@]}"
i=0; for v in $VARIANTS; do i=$((i + 1)); echo "[$i] $(vflags $v)"; done
[ $bad = 0 ] && echo "ALL PASS" || echo "SOMETHING FAILED (see above)"
exit $bad

#!/usr/bin/env bash
# gpu-check.sh RESULTS_DIR — the project's single GPU entry point (run it on the GPU machine).
#
#   1. configure + build with CUDA (Ninja, sm_90a by default; deps from .deps/ if present:
#      run tools/fetch-deps.sh on a machine with a package registry and carry .deps along)
#   2. ctest: the whole suite, GPU tests included
#   3. test_cuda_kernels verbose (per-case errors vs the float64 reference)
#   4. compute-sanitizer memcheck (+ racecheck) on small flash and naive cases
#   5. the peer benchmark: bench/peer_bench.py (ioattn vs PyTorch SDPA flash/cudnn, same run)
#   6. sm90 (Hopper kernel vs cuDNN/FA2), backward (fwd+bwd vs SDPA), decode (vs SDPA cudnn/flash),
#      cp (ring attention per-rank time vs ideal), python (pip install + pytest with torch)
#   7. optional tile sweep (GPU_CHECK_TUNE=1): ioattn_cuda_tune
#   prefill (not in the default stages; ~1 min): decode() with > 16 query rows on CUDA (the mma.sync
#      forward's KV-cache mode): its tests (test_cuda_serving *CachePrefill*, bounded), then
#      ioattn_cuda_decode_bench --seqlen-q 512 (ours through the cache vs forward() on contiguous K / V,
#      same run; GPU_CHECK_PREFILL_ARGS overrides the grid) -> prefill.json and a table in the summary.
#   sm90cache (not in the default stages; ~1-2 min): the Hopper kernel's KV-cache rows (direct for
#      contiguous caches and page pieces >= 64 rows, the gathered copy for smaller / odd pages and 8-bit
#      caches since session 31): test_cuda_serving *CachePrefill*, compute-sanitizer memcheck and
#      racecheck on the same filter (IOATTN_SM90_CACHE=1), then ioattn_cuda_decode_bench --seqlen-q 512
#      (bf16 / f8e4m3 caches, contiguous / page 1 / 16 / 64) per mode (default, mma.sync only, direct
#      only, the copy for all) -> sm90cache.json and a table of ratios to forward() in the summary.
#   fp8varlen (not in the default stages; ~1 min): the fp8 kernel's varlen rows (session 28; the
#      default since session 30): ioattn_tests Fp8Cuda.*,
#      compute-sanitizer memcheck and racecheck on Fp8Cuda.VarlenOnDevice, then ioattn_cuda_bench local
#      --dtype f8e4m3 --features causal,varlen -> fp8varlen.json and a table in the summary.
#   bwdtune (not in the default stages; ~1 min build of the target alone + <= GPU_CHECK_BWDTUNE_BUDGET
#      s of runs): ioattn_cuda_bwd_tune, the backward tile sweep -> bwdtune.json (JSON lines) and a
#      best-per-shape table in the summary. Alone: GPU_CHECK_STAGES=bwdtune tools/gpu-check.sh OUT
#   cpnccl (not in the default stages; needs >= 2 GPUs, ~2-3 min): test_cp_nccl (ring vs one GPU through
#      NCCL), then ioattn_bench_cp --nccl 1 at GPU_CHECK_CP_TOKENS tokens per GPU (default 8192 16384
#      32768), causal and not, with and without overlap -> cp_nccl.json and tables in the summary.
#   readbw (not in the default stages; ~30 s incl. its build): ioattn_cuda_readbw, the HBM read ceiling
#      by load mechanism (LDG, cp.async with/without L2 prefetch hints, 1-D bulk copy) and access
#      pattern (contiguous, the decode cache's rows) -> readbw.json and a table in the summary.
#   ncupeer (not in the default stages; ~2 min): the forward against cuDNN at equal clocks, one
#      Nsight Compute reading per kernel (duration, SM clock, DRAM read) for every bf16 shape of
#      GPU_CHECK_NCUPEER_HDIMS x GPU_CHECK_NCUPEER_SEQLENS x causal 0 / 1 (default 64 128 256 x
#      2048 4096 16384), joined by bench/ncu_table.py (cuDNN cycles / ours) -> summary.
#   ncubwd (not in the default stages; ~1 min): Nsight Compute sections (speed of light, warp
#      states, scheduler, pipes, memory) plus the stall reasons per issued instruction, each pipe's
#      active cycles and the shared-memory wavefronts of the wgmma backward kernel at hdim 128, 4k, per
#      IOATTN_BWD_SM90_VARIANT in GPU_CHECK_NCU_VARIANTS (default "tmald pp") -> ncu_bwd.log.
#      The logs are packed into logs.tgz at the end: read them there (or grep them in the command).
#   ncudec (not in the default stages; ~3 min): Nsight Compute on the mma decode kernel (bf16, b64 x 32k and
#      b16 x 128k contiguous, and b64 x 32k paged by 16), on the readbw kvloop probe's
#      four forms and on cuDNN's SDPA decode kernel (b64 x 32k, enable_gqa): launch shape, occupancy,
#      stall reasons per issued instruction, pipes, memory, L2 hit rate -> ncu_dec_ours.log,
#      ncu_dec_probe.log, ncu_dec_cudnn.log, a full report of ours with its per-instruction source page
#      (ncu_dec_ours_full.ncu-rep, ncu_dec_ours_source.csv) and the deciding lines in the summary.
#   ncufwd (not in the default stages; ~2-3 min): Nsight Compute on one launch each of the sm90 forward's
#      hdim-128 bf16 kernels (v3 body non-causal, v4 body causal, 8k) and the fp8 kernel -> ncu_fwd.log;
#      a full report of one fp8 launch (16k) with its per-instruction source page -> ncu_fp8_full.ncu-rep,
#      ncu_fp8_source.csv.
#   GPU_CHECK_POWER=1 (with stage sm90): SM clock / power / throttle reasons sampled through ours and
#      the peers' runs -> power.csv and one line per phase in the summary.
#   interleave (~3 min per mode and distribution; the like-for-like peer table): ioattn through its Python
#      extension (built in BUILD) timed beside cuDNN and FA2 in one process, every order, each after
#      GPU_CHECK_WARM_S s of its own calls, GPU_CHECK_ROUNDS rounds, GPU_CHECK_INTERLEAVE_DISTS, per
#      mode in GPU_CHECK_INTERLEAVE_MODES (fwd, fwdbwd = forward+backward; default fwd) ->
#      interleave_*.csv, tables and SM clock / power per implementation in the summary.
#   sm90qregs (not in the default stages; ~2 min): forward A/Bs: the test cases per switch (GPU_CHECK_QREGS_TESTS,
#      default "IOATTN_SM90_QREGS=0 IOATTN_SM90_MAX_CTAS=3"), then
#      ioattn_cuda_bench grid per mode (off = no Q in registers, on = defaults, NAME:ENV=V,... any
#      switches) -> sm90qregs.json and a table in the summary.
#   sm90local (not in the default stages; ~2 min): the forward's kLocal rows (windows, sinks,
#      softcap, ALiBi, varlen; IOATTN_SM90_LOCAL=1) against the mma.sync kernel on the same shapes
#      (ioattn_cuda_bench local), a table in the summary -> sm90local.json.
#   bwdtrace (not in the default stages; ~1.5 min incl. its own build in BUILD-trace): the wgmma
#      backward's step timeline, mean SM cycles per phase per warpgroup (IOATTN_BWD_TRACE=1 build),
#      per variant in GPU_CHECK_TRACE_VARIANTS and seqlen in GPU_CHECK_TRACE_SEQLENS -> summary.
#   fp8trace (not in the default stages; ~1 min incl. its own build in BUILD-fp8trace): the fp8
#      forward's consumer-loop phases, mean SM cycles per phase per warpgroup (IOATTN_FP8_TRACE=1
#      build), 128x192 and 128x128 (GPU_CHECK_FP8TRACE_BLOCKN) -> summary.
#   fp8ab (not in the default stages; ~30 s per mode and pass): A/B of the fp8 forward's switches:
#      per mode of GPU_CHECK_FP8AB_MODES (NAME:ENV=V[,ENV=V...], or "default"; default "default
#      n128:IOATTN_SM90_FP8_BLOCKN=128") the fp8 correctness cases (hdim 64, 128 and 256), then
#      GPU_CHECK_FP8AB_PASSES (default 2) interleaved passes of the fp8 bench -> fp8ab.log, ms per
#      mode and hdim-128 row in the summary (the bench's hdim-64 / 256 rows, prefixed "d64" / "d256", are in
#      the log).
#   fwdtrace (not in the default stages; ~2 min incl. its own build in BUILD-fwdtrace): the forward's
#      per-tile phases (Q wait, first block, steady loop, last P V, epilogue; IOATTN_FWD_TRACE=1 build),
#      per GPU_CHECK_FWDTRACE_CFGS (HDIM:CAUSAL) and GPU_CHECK_FWDTRACE_SEQLENS -> summary. Without a
#      second tree: tools/gpu-variant.sh OUT "-DIOATTN_FWD_TRACE=1" src/cuda/hopper/flash_fwd_sm90_hdim*.cu.
#   dectrace (not in the default stages; ~1.5 min incl. its own build in BUILD-dtrace): the mma decode
#      kernel's phases (IOATTN_DECODE_TRACE=1 build), SM cycles per phase over the CTAs of a launch,
#      per cell in GPU_CHECK_DECTRACE_CELLS -> summary.
#   wgmmarate (not in the default stages; seconds): ioattn_sm90_wgmma_rate, cycles per wgmma by
#      shape (m64nN) and operand source (ss / rs, K- or MN-major), 1-3 warpgroups -> summary.
#   report (not in the default stages; ~4-5 min): tools/report/report.sh — ioattn bench sweeps (CPU
#      and CUDA), Nsight Compute DRAM traffic vs the model, ceilings, charts; packed into report.tgz.
#      Run it with the stages that write its peer inputs: GPU_CHECK_STAGES="build bench sm90 report"
# Each stage logs to its own file in RESULTS_DIR; a short summary table is printed last.
#
# Environment: GPU_CHECK_PREBUILT (a tarball from tools/gpu-pack.sh: the build stage extracts its
# binaries instead of building; ctest is skipped), GPU_CHECK_ARCHS (default 90a), GPU_CHECK_STAGES (default "build ctest tests sanitizer
# bench sm90 interleave backward decode cp python"), GPU_CHECK_TUNE=1, GPU_CHECK_BENCH_ARGS (extra peer_bench.py args),
# GPU_CHECK_JOBS (build parallelism, default nproc), GPU_CHECK_BWD_SM90 (0: skip the wgmma-backward
# test and bench in the backward stage), GPU_CHECK_DECODE_BULK (0: skip the bulk-loader
# test and A/B in the decode stage), GPU_CHECK_DECODE_SPLITS (split counts to sweep, e.g. "1 2 4 8";
# shapes from GPU_CHECK_DECODE_SPLIT_SHAPES, default "--batch 16,64 --kv 32768,131072"; page sizes
# from GPU_CHECK_DECODE_SPLIT_PAGES, default 0 = contiguous, e.g. "0,16"), GPU_CHECK_BWDTUNE_BUDGET (seconds, default 100),
# GPU_CHECK_BWDTUNE_ARGS (extra ioattn_cuda_bwd_tune args), GPU_CHECK_REPORT_INPUTS (folder holding
# peer.json / sm90.csv / peer_sm90.csv / peer_decode.json for the report's charts; default RESULTS_DIR).
set -uo pipefail
OUT=${1:?usage: tools/gpu-check.sh RESULTS_DIR}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${GPU_CHECK_BUILD:-$ROOT/build-gpu}
ARCHS=${GPU_CHECK_ARCHS:-90a}
STAGES=${GPU_CHECK_STAGES:-build ctest tests sanitizer bench sm90 interleave backward decode cp python}
JOBS=${GPU_CHECK_JOBS:-$(nproc)}
export PATH=/usr/local/cuda/bin:$PATH
SUMMARY=$OUT/summary.txt
: >"$SUMMARY"

note() { echo "$*" | tee -a "$SUMMARY"; }
want() { [[ " $STAGES " == *" $1 "* ]]; }
stamp() { date +%s; }
# bounded_test LABEL SECONDS BINARY FILTER LOG: one gtest binary under a timeout (a hang in new
# GPU code must not eat the session), its rc in the summary; returns that rc.
bounded_test() {
  local label=$1 secs=$2 bin=$3 filter=$4 log=$5 t0 rc
  t0=$(stamp)
  timeout "$secs" "$bin" --gtest_filter="$filter" >"$log" 2>&1
  rc=$?
  note "$label rc=$rc  $(( $(stamp) - t0 )) s  ($(basename "$log"))"
  return $rc
}

# The one cmake line (the build stage, bwdtune and bwdtrace, which may run alone on a fresh machine;
# tools/gpu-pack.sh uses it too). configure [DIR [CMAKE_ARGS...]]: DIR defaults to $BUILD (bwdtrace
# configures a second one).
# shellcheck source=tools/gpu-configure.sh
source "$ROOT/tools/gpu-configure.sh"
# Binaries built elsewhere (GPU_CHECK_PREBUILT) carry the build machine's rpath: the carried
# .deps libraries (Highway, ...) by path.
[[ -d $ROOT/.deps/usr/lib ]] &&
  export LD_LIBRARY_PATH=$ROOT/.deps/usr/lib:$ROOT/.deps/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}

# ---- 1. build ----------------------------------------------------------------------------
# GPU_CHECK_PREBUILT=TARBALL (tools/gpu-pack.sh): extract the binaries into BUILD instead of building.
if want build && [[ -n ${GPU_CHECK_PREBUILT:-} ]]; then
  t0=$(stamp)
  mkdir -p "$BUILD"
  if python3 -c "import sys, tarfile; tarfile.open(sys.argv[1]).extractall(sys.argv[2])" "$GPU_CHECK_PREBUILT" "$BUILD"; then
    note "build      prebuilt  $(( $(stamp) - t0 )) s  ($(cat "$BUILD/PREBUILT" 2>/dev/null))"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv,noheader 2>&1 | tee -a "$SUMMARY"
  else
    note "build      prebuilt: cannot extract $GPU_CHECK_PREBUILT"
    exit 1
  fi
  # ctest's files name the build machine's paths: not with prebuilt binaries
  want ctest && note "ctest      skipped (prebuilt binaries: run the stages' binaries, or build on the device)"
  STAGES=${STAGES//ctest/}
elif want build; then
  t0=$(stamp)
  (
    echo "## $(date -u) $(uname -n)"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv || true
    nvcc --version | tail -1
    configure &&
      { ninja -C "$BUILD" -j "$JOBS" -k 0 ||
        { echo "## full build failed; building the CUDA targets alone";
          ninja -C "$BUILD" -j "$JOBS" ioattn test_cuda_kernels ioattn_cuda_bench; }; }
    rc=$?
    if [[ ${GPU_CHECK_TUNE:-0} == 1 ]]; then ninja -C "$BUILD" -j "$JOBS" ioattn_cuda_tune; fi
    exit $rc
  ) >"$OUT/build.log" 2>&1
  rc=$?
  note "build      rc=$rc  $(( $(stamp) - t0 )) s  (archs $ARCHS; log build.log)"
  grep -E "spill stores" "$OUT/build.log" | grep -v " 0 bytes spill stores" | head -3 | sed 's/^/  SPILL: /' | tee -a "$SUMMARY"
  # wgmma serialised or a wait injected by ptxas (C7510-C7519): a kernel running far below its rate
  grep -oE "\(C751[0-9]\)[^']*'[^']*'" "$OUT/build.log" | sort -u | head -5 | cut -c1-220 | sed 's/^/  WGMMA: /' |
    tee -a "$SUMMARY"
  [[ $rc == 0 ]] || { tail -30 "$OUT/build.log"; exit 1; }
fi

# ---- 2. ctest -------------------------------------------------------------------------------
if want ctest; then
  t0=$(stamp)
  # GPU_CHECK_CTEST_REGEX: only the tests whose names match (ctest -R), e.g. "cuda_kernels|serving"
  (cd "$BUILD" && ctest --output-on-failure -j 4 --timeout 600 ${GPU_CHECK_CTEST_REGEX:+-R "$GPU_CHECK_CTEST_REGEX"}) >"$OUT/ctest.log" 2>&1
  rc=$?
  note "ctest      rc=$rc  $(( $(stamp) - t0 )) s  $(grep -E 'tests passed|tests failed' "$OUT/ctest.log" | tail -1)"
fi

# ---- 3. CUDA kernel tests, verbose -------------------------------------------------------------
if want tests; then
  t0=$(stamp)
  "$BUILD/test_cuda_kernels" >"$OUT/cuda_tests.log" 2>&1
  rc=$?
  note "cuda tests rc=$rc  $(( $(stamp) - t0 )) s  $(grep -E '^\[  (PASSED|FAILED) ' "$OUT/cuda_tests.log" | tr '\n' ' ')"
fi

# ---- 4. compute-sanitizer ------------------------------------------------------------------------
if want sanitizer; then
  t0=$(stamp)
  small='*one_token*:*naive_odd*:*seq17_f16*:*113x203*:*203x113*:*varlen_empty_seq:*padded_hdim40*:*sinks_empty_rows*:*naive_varlen*:*naive_bf16_causal*:*hdim256_bf16*'
  {
    compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/test_cuda_kernels" --gtest_filter="$small"
    echo "memcheck rc=$?"
    compute-sanitizer --tool racecheck --error-exitcode 9 "$BUILD/test_cuda_kernels" \
      --gtest_filter='*113x203*:*varlen_empty_seq:*hdim192_bf16*'
    echo "racecheck rc=$?"
    # The opt-in kLocal rows of the sm90 forward (windows, sinks, softcap, ALiBi) on small shapes.
    IOATTN_SM90_LOCAL=1 compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/test_cuda_kernels" \
      --gtest_filter='*local_diagonal_only*:*local_empty_rows*:*local_sinks_noncausal*:*local_varlen_window*'
    echo "memcheck (sm90 local) rc=$?"
    IOATTN_SM90_LOCAL=1 compute-sanitizer --tool racecheck --error-exitcode 9 "$BUILD/test_cuda_kernels" \
      --gtest_filter='*local_diagonal_only*:*local_empty_rows*'
    echo "racecheck (sm90 local) rc=$?"
    if [[ -x $BUILD/test_cuda_backward ]]; then
      # (*len17* also matches the experimental wgmma backward's case: memcheck covers it on purpose)
      compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/test_cuda_backward" \
        --gtest_filter='*len17*:*varlen_empty*:*hdim40*:*hdim256_gqa*:*sinks_norows*'
      echo "memcheck (backward) rc=$?"
      compute-sanitizer --tool racecheck --error-exitcode 9 "$BUILD/test_cuda_backward" \
        --gtest_filter='Cases/CudaBackward.*q113_k203_causal_bf16*'
      echo "racecheck (backward) rc=$?"
    fi
    if [[ -x $BUILD/test_cuda_serving ]]; then
      compute-sanitizer --tool memcheck --error-exitcode 9 "$BUILD/test_cuda_serving" \
        --gtest_filter='CudaDecode.EmptyAndSingleTokenSequences:CudaDecode.PagedEqualsContiguousBitwise:CudaAppendKv.*:CudaMergeStates.*'
      echo "memcheck (serving) rc=$?"
    fi
  } >"$OUT/sanitizer.log" 2>&1
  note "sanitizer  $(( $(stamp) - t0 )) s  $(grep -E '^(memcheck|racecheck).* rc=|ERROR SUMMARY' "$OUT/sanitizer.log" | tr '\n' ' ')"
fi

# ---- 5. peer benchmark --------------------------------------------------------------------------
if want bench; then
  t0=$(stamp)
  PYTHONUNBUFFERED=1 python3 "$ROOT/bench/peer_bench.py" --bench "$BUILD/ioattn_cuda_bench" \
    --out "$OUT/peer.json" ${GPU_CHECK_BENCH_ARGS:-} >"$OUT/bench.log" 2>&1
  rc=$?
  note "bench      rc=$rc  $(( $(stamp) - t0 )) s  (bench.log, peer.json)"
fi

# ---- 6. Hopper kernel vs cuDNN / FA2 (same run) ---------------------------------------------------
# GPU_CHECK_POWER=1: nvidia-smi samples SM clock, power and throttle reasons every 100 ms through
# the two phases (ours, then the peers) -> power.csv, and the summary says, per phase, the mean and
# lowest SM clock, the mean power and the throttle reasons seen (are both sides clocked alike?).
if want sm90 && [[ -x $BUILD/ioattn_sm90_check ]]; then
  t0=$(stamp)
  smi_pid=
  if [[ ${GPU_CHECK_POWER:-0} == 1 ]] && command -v nvidia-smi >/dev/null; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
      --format=csv,noheader,nounits -lms 100 >"$OUT/power.csv" 2>/dev/null &
    smi_pid=$!
  fi
  {
    echo "phase ours $(date +%s.%N)" >"$OUT/power_phases.txt"
    "$BUILD/ioattn_sm90_check" --bench-only --csv "$OUT/sm90.csv" &&
      { echo "phase peers $(date +%s.%N)" >>"$OUT/power_phases.txt"; } &&
      PYTHONUNBUFFERED=1 python3 "$ROOT/src/cuda/hopper/peer_sdpa.py" --ours sm90="$OUT/sm90.csv" --csv "$OUT/peer_sm90.csv" \
        --dist "${GPU_CHECK_PEER_DIST:-uniform}"
    rc_sm90=$?
    echo "phase end $(date +%s.%N)" >>"$OUT/power_phases.txt"
  } >"$OUT/sm90.log" 2>&1
  note "sm90 bench rc=$rc_sm90  $(( $(stamp) - t0 )) s  (sm90.log, peer_sm90.csv)"
  if [[ -n $smi_pid ]]; then
    kill "$smi_pid" 2>/dev/null
    python3 - "$OUT/power.csv" "$OUT/power_phases.txt" <<'PY' | tee -a "$SUMMARY"
import sys, datetime
phases = [l.split() for l in open(sys.argv[2]) if l.startswith("phase")]
bounds = [(phases[i][1], float(phases[i][2]), float(phases[i + 1][2])) for i in range(len(phases) - 1)]
rows = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    if len(f) < 5:
        continue
    try:
        ts = datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp()
        rows.append((ts, float(f[1]), float(f[2]), f[4]))
    except ValueError:
        continue
for name, a, b in bounds:
    sel = [r for r in rows if a <= r[0] < b and r[2] > 150]  # busy samples (> 150 W)
    if not sel:
        print(f"power {name:6s}: no busy samples"); continue
    clk = [r[1] for r in sel]; pw = [r[2] for r in sel]
    reasons = sorted({r[3] for r in sel})
    print(f"power {name:6s}: {len(sel)} busy samples, SM clock mean {sum(clk) / len(clk):.0f} MHz (min {min(clk):.0f}), "
          f"power mean {sum(pw) / len(pw):.0f} W (max {max(pw):.0f}), reasons {' '.join(reasons)}")
PY
  fi
fi

# ---- interleave: ioattn (through its Python package) and the peers in one process ----------------
# The like-for-like forward table: the extension _C is built in BUILD (-DIOATTN_BUILD_PYTHON=ON; the
# library is already built, so this compiles the bindings alone) and imported from a copy of
# python/ioattn; peer_sdpa.py --ioattn then times ioattn, cuDNN and FA2 row by row, in every order
# over the grid, GPU_CHECK_ROUNDS rounds (default 2), each timing after GPU_CHECK_WARM_S seconds
# (default 1) of its own back-to-back calls (the sustained state under the power cap), on the inputs
# of GPU_CHECK_INTERLEAVE_DISTS (default uniform; "uniform normal" for both), with the power samples.
if want interleave; then
  t0=$(stamp)
  {
    # The python3 that holds torch, and the option switched off again afterwards (whatever
    # happened), so that later builds in BUILD never depend on nanobind.
    cmake -DIOATTN_BUILD_PYTHON=ON -DPython_EXECUTABLE="$(command -v python3)" "$BUILD" >/dev/null &&
      cmake --build "$BUILD" --target _C -j "$JOBS" &&
      rm -rf "$BUILD/pyroot" && mkdir -p "$BUILD/pyroot" && cp -r "$ROOT/python/ioattn" "$BUILD/pyroot/" &&
      find "$BUILD/python" -name "_C*.so" -exec cp {} "$BUILD/pyroot/ioattn/" \;
    rc_py=$?
    cmake -DIOATTN_BUILD_PYTHON=OFF "$BUILD" >/dev/null
    (exit $rc_py)
  } >"$OUT/interleave_build.log" 2>&1
  rc=$?
  if [[ $rc == 0 ]]; then
    smi_pid=
    if command -v nvidia-smi >/dev/null; then
      nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_event_reasons.active \
        --format=csv,noheader,nounits -lms 100 >"$OUT/interleave_power.csv" 2>/dev/null &
      smi_pid=$!
    fi
    for mode in ${GPU_CHECK_INTERLEAVE_MODES:-fwd}; do
      for dist in ${GPU_CHECK_INTERLEAVE_DISTS:-uniform}; do
        tag=${mode}_$dist
        extra=()
        case $mode in
          fwd) ;;
          fwdbwd) extra=(--fwdbwd) ;;
          *) note "interleave: unknown mode '$mode' (fwd, fwdbwd): skipped"; continue ;;
        esac
        PYTHONPATH="$BUILD/pyroot" PYTHONUNBUFFERED=1 python3 "$ROOT/src/cuda/hopper/peer_sdpa.py" --ioattn "${extra[@]}" \
          --rounds "${GPU_CHECK_ROUNDS:-2}" --warm-s "${GPU_CHECK_WARM_S:-1}" --dist "$dist" \
          --csv "$OUT/interleave_$tag.csv" >"$OUT/interleave_$tag.log" 2>&1
        rc=$?
        note "interleave $tag rc=$rc  $(( $(stamp) - t0 )) s  (interleave_$tag.log)"
        sed -n '/^hdim/,$p' "$OUT/interleave_$tag.log" | sed "s/^/$tag: /" | tee -a "$SUMMARY" >/dev/null
      done
    done
    [[ -n $smi_pid ]] && kill "$smi_pid" 2>/dev/null
    # SM clock and power over each implementation's rows' windows (its warm-up calls included)
    [[ -n $smi_pid ]] && python3 - "$OUT/interleave_power.csv" "$OUT"/interleave_*.csv <<'PY' | tee -a "$SUMMARY"
import csv, datetime, sys
samples = []
for line in open(sys.argv[1]):
    f = [x.strip() for x in line.split(",")]
    try:
        samples.append((datetime.datetime.strptime(f[0], "%Y/%m/%d %H:%M:%S.%f").timestamp(), float(f[1]), float(f[2])))
    except (ValueError, IndexError):
        continue
for path in sys.argv[2:]:
    if path.endswith("_power.csv"):
        continue
    per = {}
    for r in csv.DictReader(open(path)):
        a, b = float(r["t_start"]), float(r["t_end"])
        per.setdefault(r["impl"], []).extend(s for s in samples if a <= s[0] <= b)
    for impl, sel in sorted(per.items()):
        if sel:
            print(f"{path.rsplit('/', 1)[-1]}: {impl:7s} {len(sel)} samples, SM clock mean {sum(s[1] for s in sel) / len(sel):.0f} MHz "
                  f"(min {min(s[1] for s in sel):.0f}), power mean {sum(s[2] for s in sel) / len(sel):.0f} W")
PY
    interleave_built=1
  else
    note "interleave build rc=$rc (interleave_build.log)"
  fi
fi

# ---- forward+backward vs PyTorch SDPA flash / cudnn (same run) -----------------------------------
if want backward; then
  t0=$(stamp)
  PYTHONUNBUFFERED=1 python3 "$ROOT/bench/peer_bench.py" --bench "$BUILD/ioattn_cuda_bench" --bwd \
    --seqlens ${GPU_CHECK_BWD_SEQLENS:-1024,4096,16384} --out "$OUT/bwd.json" >"$OUT/backward.log" 2>&1
  note "backward   rc=$?  $(( $(stamp) - t0 )) s  (backward.log, bwd.json)"
  # The wgmma backward (sm_90's default at hdim 64 and 128): its reference test over every variant
  # first (bounded), then ioattn alone on the same grid per IOATTN_BWD_SM90_VARIANT ->
  # bwd_sm90_<v>.json (lag: dQ one step late by TMA reduce-add, the default below 2048 query rows at
  # hdim 128; tmald: lag with Q / dO by TMA; pp: tmald without CTA barriers in the
  # step loop, the default at hdim 128 from 2048 rows since session 9; ppw: pp with per-warp dQ
  # reduce-adds; ppwide: pp with 128-row steps, hdim 64's default since session 23;
  # GPU_CHECK_BWD_OLD=1 adds the older redlag, split and red)
  # and with IOATTN_BWD_KERNEL=mma (the mma.sync table) -> bwd_sm90_mma.json, beside bwd.json's peers.
  # The two head dims' tests run as separate processes: a fault or hang in one must not take the
  # other's results (or their A/B) with it.
  bwd_ab() {  # bwd_ab NAME HDIMS ENV...: ioattn alone on the grid -> bwd_sm90_NAME.json
    local name=$1 hd=$2 t0
    shift 2
    t0=$(stamp)
    env "$@" timeout 300 "$BUILD/ioattn_cuda_bench" bwd --hdims "$hd" \
      --seqlens ${GPU_CHECK_BWD_SEQLENS:-1024,4096,16384} >"$OUT/bwd_ab.log" 2>&1
    note "bwd bench $name rc=$?  $(( $(stamp) - t0 )) s  (bwd_sm90_${name}.json)"
    grep '^{' "$OUT/bwd_ab.log" >"$OUT/bwd_sm90_${name}.json"
    cat "$OUT/bwd_ab.log" >>"$OUT/bwd_sm90.log"
    rm -f "$OUT/bwd_ab.log"
  }
  if [[ ${GPU_CHECK_BWD_SM90:-1} == 1 && -x $BUILD/test_cuda_backward ]]; then
    if bounded_test "bwd sm90 test (hdim 128)" 300 "$BUILD/test_cuda_backward" 'Cases/CudaBackwardSm90.*:-*d64_*' \
      "$OUT/bwd_sm90.log"; then
      for v in lag ${GPU_CHECK_BWD_OLD:+redlag split red}; do bwd_ab "$v" 128 IOATTN_BWD_SM90_VARIANT="$v"; done
      bwd_ab mma 64,128 IOATTN_BWD_KERNEL=mma
    fi
    bounded_test "bwd sm90 test (hdim 64)" 200 "$BUILD/test_cuda_backward" 'Cases/CudaBackwardSm90.*d64_*' \
      "$OUT/bwd_sm90_d64.log" && for v in lag ${GPU_CHECK_BWD_OLD:+redlag split}; do bwd_ab "d64_$v" 64 IOATTN_BWD_SM90_VARIANT="$v"; done
    # Pieces with their own suites (a failure gates only their own A/B): variant tmald, varlen.
    bounded_test "bwd tmald test" 300 "$BUILD/test_cuda_backward" '*CudaBackwardSm90Tmald*' "$OUT/bwd_tmald.log" &&
      { bwd_ab tmald 128 IOATTN_BWD_SM90_VARIANT=tmald; bwd_ab d64_tmald 64 IOATTN_BWD_SM90_VARIANT=tmald; }
    bounded_test "bwd varlen test" 200 "$BUILD/test_cuda_backward" '*CudaBackwardSm90Varlen.*' "$OUT/bwd_varlen.log"
    # Varlen through pp / ppwide and at hdim 256 (session 23; the defaults since session 24): their
    # suites, then a varlen A/B per variant at hdim 64.
    bounded_test "bwd varlen pp test" 300 "$BUILD/test_cuda_backward" \
      '*CudaBackwardSm90VarlenPingPong*:*CudaBackwardSm90D256Varlen*' \
      "$OUT/bwd_varlen_pp.log" && for v in lag pp ppwide; do
      env IOATTN_BWD_SM90_VARIANT=$v timeout 300 "$BUILD/ioattn_cuda_bench" bwd --varlen 1 --hdims 64 \
        --seqlens ${GPU_CHECK_BWD_SEQLENS:-1024,4096,16384} | grep '^{' >"$OUT/bwd_sm90_varlen_d64_$v.json"
      note "bwd varlen bench d64 $v  (bwd_sm90_varlen_d64_$v.json)"
    done
    # Variant pp (the default from 2048 query rows at hdim 128 since session 9; at hdim 64 until session 23).
    bounded_test "bwd pp test" 300 "$BUILD/test_cuda_backward" '*CudaBackwardSm90PingPong.*' "$OUT/bwd_pp.log" &&
      { bwd_ab pp 128 IOATTN_BWD_SM90_VARIANT=pp; bwd_ab d64_pp 64 IOATTN_BWD_SM90_VARIANT=pp; }
    # Variant ppw (pp with per-warp dQ reduce-adds, no warpgroup barrier before them; session 12).
    bounded_test "bwd ppw test" 300 "$BUILD/test_cuda_backward" '*CudaBackwardSm90PingPongWarp*' "$OUT/bwd_ppw.log" &&
      { bwd_ab ppw 128 IOATTN_BWD_SM90_VARIANT=ppw; bwd_ab d64_ppw 64 IOATTN_BWD_SM90_VARIANT=ppw; }
    # Variant ppwide (pp with 128-row steps at hdim 64; its default since session 23).
    bounded_test "bwd ppwide test" 300 "$BUILD/test_cuda_backward" '*CudaBackwardSm90PingPongWide*' \
      "$OUT/bwd_ppwide.log" && bwd_ab d64_ppwide 64 IOATTN_BWD_SM90_VARIANT=ppwide
  fi
fi

# ---- Nsight Compute sections of the backward's wgmma kernel (optional stage ncubwd) --------------
if want ncubwd && command -v ncu >/dev/null; then
  t0=$(stamp)
  for v in ${GPU_CHECK_NCU_VARIANTS:-tmald pp}; do
    IOATTN_BWD_SM90_VARIANT=$v timeout 240 ncu --clock-control none -k regex:flash_bwd_sm90 -c 1 \
      --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section ComputeWorkloadAnalysis \
      --section MemoryWorkloadAnalysis --section Occupancy \
      --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum' \
      "$BUILD/ioattn_cuda_bench" bwd --hdims 128 --seqlens 4096 >>"$OUT/ncu_bwd.log" 2>&1
  done
  note "ncu bwd    rc=$?  $(( $(stamp) - t0 )) s  (ncu_bwd.log)"
  # The lines that decide the next step, in the summary (the log itself travels in logs.tgz).
  grep -E 'flash_bwd_sm90_kernel|Duration|pipe_(tensor|shared|alu|fma)_cycles|wavefronts_mem_shared|stalled_(wait|dispatch_stall|mio_throttle|long_scoreboard|short_scoreboard|barrier|gmma|math_pipe_throttle)_per|Eligible Warps' \
    "$OUT/ncu_bwd.log" | grep -v '^==' | sed -E 's/  +/ /g; s/^ //' | cut -c1-150 | tee -a "$SUMMARY"
fi

# ---- the forward against cuDNN at equal clocks (optional stage ncupeer) ---------------------------
# Session 35's method for power-capped cards: one Nsight Compute reading per kernel (duration, SM
# clock, DRAM read), ours through ioattn_cuda_bench grid --causal C, cuDNN's through
# bench/cudnn_ncu.py in profiler ranges; bench/ncu_table.py joins them (cuDNN cycles / ours).
if want ncupeer && command -v ncu >/dev/null; then
  t0=$(stamp)
  NCU_PEER=(ncu --clock-control none --metrics gpu__time_duration.sum,sm__cycles_elapsed.avg.per_second,sm__cycles_elapsed.avg,dram__bytes_read.sum)
  hd=${GPU_CHECK_NCUPEER_HDIMS:-64 128 256}
  sl=${GPU_CHECK_NCUPEER_SEQLENS:-2048 4096 16384}
  : >"$OUT/ncupeer_ours.log"
  for d in $hd; do
    for s in $sl; do
      for c in 0 1; do
        echo "=== hdim $d seqlen $s causal $c" >>"$OUT/ncupeer_ours.log"
        timeout 60 "${NCU_PEER[@]}" -k regex:flash_fwd_sm90 --launch-skip 2 -c 1 "$BUILD/ioattn_cuda_bench" grid \
          --hdims "$d" --seqlens "$s" --dtypes bf16 --f16-hdims 0 --repeats 1 --causal "$c" >>"$OUT/ncupeer_ours.log" 2>&1
      done
    done
  done
  timeout 400 "${NCU_PEER[@]}" --profile-from-start off -k regex:cudnn python3 "$ROOT/bench/cudnn_ncu.py" \
    --hdims "${hd// /,}" --seqlens "${sl// /,}" >"$OUT/ncupeer_cudnn.log" 2>&1
  note "ncupeer    rc=$?  $(( $(stamp) - t0 )) s  (ncupeer_ours.log, ncupeer_cudnn.log)"
  python3 "$ROOT/bench/ncu_table.py" "$OUT/ncupeer_ours.log" "$OUT/ncupeer_cudnn.log" | tee -a "$SUMMARY"
fi

# ---- Nsight Compute on the decode, ours and cuDNN's (optional stage ncudec) -----------------------
# Session 13's question: the decode's ring and row pattern read at 4.59 TB/s with up to ~2,000
# cycles of work per tile (readbw kvloop), the kernel at 4.27-4.29: where do a tile's cycles go,
# and what launch shape does cuDNN's 4.6 TB/s kernel have?
if want ncudec && command -v ncu >/dev/null; then
  t0=$(stamp)
  NCU_DEC=(--clock-control none -c 1 --section SpeedOfLight --section LaunchStats --section Occupancy
    --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,smsp__inst_executed.sum,smsp__cycles_active.avg')
  # The cells (contiguous, and b64 x 32k paged by 16), then the readbw kvloop probe in its four forms
  # (plain, per-warp, zero-fill form, the padded shared rows that gave the decode kernel 34% L2 hits
  # until session 14; the project's ioattn_cuda_readbw target, as the readbw stage builds it).
  for cell in "64 32768 0" "16 131072 0" "64 32768 16"; do
    read -r b kv pg <<<"$cell"
    timeout 150 ncu "${NCU_DEC[@]}" -k regex:decode_mma_kernel \
      "$BUILD/ioattn_cuda_decode_bench" --batch "$b" --kv "$kv" \
      --pages "$pg" --caches bf16 --eager 1 --copy 0 --repeats 2 >>"$OUT/ncu_dec_ours.log" 2>&1
  done
  if cmake --build "$BUILD" --target ioattn_cuda_readbw -j "$JOBS" >>"$OUT/ncu_dec_probe.log" 2>&1; then
    for m in 0 1 2 3; do  # kvloop forms: 0 plain, 1 per warp, 2 zero-fill form, 3 padded shared rows
      timeout 100 ncu --clock-control none --kernel-name-base demangled -k "regex:read_kvloop<\\(int\\)$m>" -c 1 \
        --section SpeedOfLight --section MemoryWorkloadAnalysis "$BUILD/ioattn_cuda_readbw" --gib 2 --ctas-per-sm 2 \
        --kvloop-spins 0 >>"$OUT/ncu_dec_probe.log" 2>&1
    done
  fi
  grep -E 'read_kvloop<|DRAM Throughput|L2 Cache Throughput|L2 Hit Rate' "$OUT/ncu_dec_probe.log" | sed -E 's/  +/ /g' |
    cut -c1-120 | sed 's/^/probe: /' | tee -a "$SUMMARY"
  cat >"$OUT/ncu_dec_cudnn.py" <<'PY'
import torch, torch.nn.functional as F
from torch.nn.attention import sdpa_kernel, SDPBackend
b, s, hq, hk, d = 64, 32768, 32, 8, 128
q = torch.randn(b, hq, 1, d, device="cuda", dtype=torch.bfloat16)
k = torch.randn(b, hk, s, d, device="cuda", dtype=torch.bfloat16)
v = torch.randn_like(k)
with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
    for _ in range(3):
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
torch.cuda.synchronize()
PY
  timeout 200 ncu "${NCU_DEC[@]}" -k 'regex:sdpa|fmha|attn|cudnn|fprop|flash|Sdpa|Fmha|Attn' --launch-skip 1 \
    python3 "$OUT/ncu_dec_cudnn.py" >>"$OUT/ncu_dec_cudnn.log" 2>&1
  note "ncu dec    rc=$?  $(( $(stamp) - t0 )) s  (ncu_dec_ours.log, ncu_dec_cudnn.log)"
  # Session 13 found our kernel's L2 hit rate at 34% with 134 M "excessive" global sectors (cuDNN and
  # the kvloop probe: < 1%): a full report of one launch (b64 x 32k) kept in RESULTS_DIR, and its
  # source page (per-SASS-instruction metrics, excessive sectors included) as CSV.
  timeout 200 ncu --clock-control none -c 1 --set full --import-source no -k regex:decode_mma_kernel \
    -o "$OUT/ncu_dec_ours_full" -f "$BUILD/ioattn_cuda_decode_bench" --batch 64 --kv 32768 --pages 0 --caches bf16 \
    --eager 1 --copy 0 --repeats 2 >>"$OUT/ncu_dec_full.log" 2>&1 &&
    ncu --import "$OUT/ncu_dec_ours_full.ncu-rep" --page source --print-source sass --csv \
      >"$OUT/ncu_dec_ours_source.csv" 2>>"$OUT/ncu_dec_full.log"
  note "ncu dec full rc=$?  (ncu_dec_ours_full.ncu-rep, ncu_dec_ours_source.csv: per-instruction)"
  for f in ncu_dec_ours ncu_dec_cudnn; do
    echo "$f:" | tee -a "$SUMMARY"
    grep -E '^  [a-zA-Z_].*\(|Duration|L2 Hit Rate|L2 Cache Throughput|Registers Per|Block Size|Grid Size|Dynamic Shared|Achieved Occupancy|Theoretical Occ|DRAM Throughput|Issued Warp|Eligible Warps|No Eligible|stalled_(long_scoreboard|barrier|wait|short_scoreboard|mio_throttle|lg_throttle|math_pipe_throttle|dispatch_stall|no_instruction|not_selected|selected|branch_resolving)_per|inst_executed.sum|cycles_active.avg|pipe_(alu|fma|tensor|lsu|uniform|xu|fmaheavy)_cycles' \
      "$OUT/$f.log" | grep -v '^==' | sed -E 's/  +/ /g; s/^ //' | cut -c1-150 | tee -a "$SUMMARY"
  done
fi

# ---- Nsight Compute on the sm90 forward (optional stage ncufwd) -----------------------------------
# One launch each of the hdim-128 bf16 kernels at 8k (the v3 body of the non-causal rows, the v4
# body of the causal ones) and of the fp8 kernel: pipes, issue stalls, eligible warps -> ncu_fwd.log
# and the deciding lines in the summary.
if want ncufwd && command -v ncu >/dev/null; then
  t0=$(stamp)
  NCU_FWD=(--clock-control none -c 1 --section SpeedOfLight --section WarpStateStats --section SchedulerStats
    --metrics 'regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,regex:sm__pipe_.*_cycles_active\.avg\.pct_of_peak_sustained_active,sm__inst_executed.sum,smsp__inst_executed_op_mufu.sum')
  for k in flash_fwd_sm90_v3_kernel flash_fwd_sm90_kernel; do
    timeout 240 ncu "${NCU_FWD[@]}" -k "regex:$k" "$BUILD/ioattn_cuda_bench" grid --hdims 128 --seqlens 8192 \
      --dtypes bf16 --repeats 3 >>"$OUT/ncu_fwd.log" 2>&1
  done
  [[ -x $BUILD/ioattn_sm90_check ]] && timeout 240 ncu "${NCU_FWD[@]}" -k regex:flash_fwd_sm90_fp8_kernel \
    "$BUILD/ioattn_sm90_check" --bench-only --fp8-only >>"$OUT/ncu_fwd.log" 2>&1
  note "ncu fwd    rc=$?  $(( $(stamp) - t0 )) s  (ncu_fwd.log)"
  # Session 16: the fp8 softmax takes ~1,600-2,000 cycles per step for 772 of MUFU work. A full
  # report of one fp8 launch (16k, no mask: the bench's 113th fp8 launch) and its source page
  # (per-SASS-instruction stall reasons and warp-state samples) as CSV.
  [[ -x $BUILD/ioattn_sm90_check ]] && timeout 240 ncu --clock-control none -c 1 --launch-skip 112 --set full \
    --import-source no -k regex:flash_fwd_sm90_fp8_kernel -o "$OUT/ncu_fp8_full" -f \
    "$BUILD/ioattn_sm90_check" --bench-only --fp8-only >>"$OUT/ncu_fwd.log" 2>&1 &&
    ncu --import "$OUT/ncu_fp8_full.ncu-rep" --page source --print-source sass --csv \
      >"$OUT/ncu_fp8_source.csv" 2>>"$OUT/ncu_fwd.log"
  note "ncu fp8 full rc=$?  (ncu_fp8_full.ncu-rep, ncu_fp8_source.csv: per-instruction)"
  grep -E 'flash_fwd_sm90|Duration|pipe_(tensor|alu|fma|xu|fmaheavy)_cycles|inst_executed|stalled_(wait|dispatch_stall|mio_throttle|long_scoreboard|short_scoreboard|barrier|gmma|math_pipe_throttle|no_instruction)_per|Eligible Warps|Issued Warp' \
    "$OUT/ncu_fwd.log" | grep -v '^==' | sed -E 's/  +/ /g; s/^ //' | cut -c1-150 | tee -a "$SUMMARY"
fi

# ---- forward A/Bs at hdim 128 (optional stage sm90qregs) -----------------------------------------
# The forward's switches: off = IOATTN_SM90_QREGS=0 (hdim-128 causal 128x128 without Q in
# registers); on = the defaults; any other mode NAME:ENV=V[,ENV=V...] sets those variables (an A/B
# of a new switch without editing this script). First the test cases with Q in registers off and on
# 3 persistent CTAs, then ioattn_cuda_bench grid at GPU_CHECK_QREGS_HDIMS (default 64,128,256) per
# mode of GPU_CHECK_QREGS_MODES (default "off on"), interleaved GPU_CHECK_QREGS_PASSES times
# (default 2), each timing after
# GPU_CHECK_QREGS_WARM_MS (default 300) ms of its own calls -> sm90qregs.json; TFLOP/s per mode with
# its ratio to the first mode per row in the summary. (Session 10's cross-tile variants,
# mode xtile, lost 0-15% in session 11 and were removed.)
if want sm90qregs; then
  t0=$(stamp)
  rc=0
  for envs in ${GPU_CHECK_QREGS_TESTS:-IOATTN_SM90_QREGS=0 IOATTN_SM90_MAX_CTAS=3}; do
    echo "## $envs" >>"$OUT/sm90qregs_test.log"
    env $envs timeout 300 "$BUILD/test_cuda_kernels" --gtest_filter='*tiles_*:*1023x1024*:*seq17*:*bhsd*:*hdim*:*causal*' \
      >>"$OUT/sm90qregs_test.log" 2>&1 || rc=1
  done
  note "qregs test rc=$rc  $(( $(stamp) - t0 )) s  (sm90qregs_test.log)"
  if [[ $rc == 0 ]]; then
    brc=0
    for pass in $(seq 1 "${GPU_CHECK_QREGS_PASSES:-2}"); do
      for mode in ${GPU_CHECK_QREGS_MODES:-off on}; do
        case $mode in
          off) envs="IOATTN_SM90_QREGS=0" ;;
          on) envs="" ;;  # the defaults
          *:*) envs=${mode#*:}; envs=${envs//,/ }; mode=${mode%%:*} ;;
          *) note "sm90qregs: unknown mode '$mode' (off, on, NAME:ENV=V,...): skipped"; continue ;;
        esac
        env IOATTN_BENCH_WARM_MS="${GPU_CHECK_QREGS_WARM_MS:-300}" $envs timeout 200 "$BUILD/ioattn_cuda_bench" grid --hdims ${GPU_CHECK_QREGS_HDIMS:-64,128,256} \
          --seqlens 2048,4096,8192,16384 \
          --dtypes bf16,f16 2>>"$OUT/sm90qregs.log" >"$OUT/sm90qregs_run.json" || brc=1
        sed "s/^{/{\"mode\": \"$mode\", \"pass\": $pass, /" "$OUT/sm90qregs_run.json" >>"$OUT/sm90qregs.json"
      done
    done
    rm -f "$OUT/sm90qregs_run.json"
    note "sm90qregs  rc=$brc  $(( $(stamp) - t0 )) s  (sm90qregs.json)"
    python3 - "$OUT/sm90qregs.json" <<'PY' | tee -a "$SUMMARY"
import json, sys, collections
rows = collections.defaultdict(lambda: collections.defaultdict(list))
modes = []
for line in open(sys.argv[1]):
    if not line.startswith("{"): continue
    r = json.loads(line)
    rows[(r["dtype"], r["hdim"], r["seqlen"], r["causal"])][r["mode"]].append(r["tflops"])
    if r["mode"] not in modes: modes.append(r["mode"])
if not modes:
    print("qregs: no rows (every bench run failed?)"); sys.exit(0)
print("qregs: dtype hdim seqlen causal | " + " ".join(f"{m:>12s}" for m in modes) + f"   (TFLOP/s, x {modes[0]})")
for k in sorted(rows):
    m = {x: sum(v) / len(v) for x, v in rows[k].items()}
    off = m.get(modes[0])
    cells = [f"{m[x]:6.1f} {m[x] / off:4.2f}" if x in m and off else f"{'-':>12s}" for x in modes]
    print(f"qregs: {k[0]:5s} {k[1]:4d} {k[2]:6d} {str(k[3]):5s} | " + " ".join(f"{c:>12s}" for c in cells))
PY
  fi
fi

# ---- the sm90 forward's kLocal rows vs mma.sync (optional stage sm90local) -------------------------
# ioattn_cuda_bench local with IOATTN_SM90_LOCAL=1 (windows, sinks, softcap, ALiBi, varlen on the
# wgmma kernel) and without (the mma.sync kernel), interleaved twice; a table in the summary.
if want sm90local; then
  t0=$(stamp)
  for pass in 1 2; do
    for on in 1 0; do
      IOATTN_SM90_LOCAL=$on timeout 200 "$BUILD/ioattn_cuda_bench" local ${GPU_CHECK_LOCAL_ARGS:-} 2>>"$OUT/sm90local.log" |
        sed "s/^{/{\"local\": $on, \"pass\": $pass, /" >>"$OUT/sm90local.json"
    done
  done
  note "sm90local  rc=$?  $(( $(stamp) - t0 )) s  (sm90local.json)"
  python3 - "$OUT/sm90local.json" <<'PY' | tee -a "$SUMMARY"
import json, sys, collections
rows = collections.defaultdict(lambda: {0: [], 1: []})
kern = {}
for line in open(sys.argv[1]):
    if not line.startswith("{"): continue
    r = json.loads(line)
    key = (r["feature"], r["hdim"], r["seqlen"])
    rows[key][r["local"]].append(r["tflops"])
    if r["local"] == 1: kern[key] = r["kernel"]
print("## sm90 kLocal rows vs mma.sync (bf16 fwd TFLOP/s over visible pairs, mean of 2 passes)")
print("feature  hdim seqlen |  local   mma  ratio | local kernel")
for key in sorted(rows):
    a, b = rows[key][1], rows[key][0]
    if not a or not b: continue
    la, lb = sum(a) / len(a), sum(b) / len(b)
    print(f"{key[0]:8s} {key[1]:4d} {key[2]:6d} | {la:6.1f} {lb:6.1f} {la / lb:5.2f} | {kern.get(key, '')[:70]}")
PY
fi

# ---- the wgmma backward's step timeline (optional stage bwdtrace) -----------------------------------
# A second build with -DIOATTN_BWD_TRACE=1 (SM clock stamps per phase of every step of 8 CTAs, see
# flash_bwd_sm90.cu); the bench prints the mean cycles per phase after the 20th launch.
if want bwdtrace; then
  t0=$(stamp)
  TBUILD="$BUILD-trace"
  { configure "$TBUILD" -DCMAKE_CUDA_FLAGS=-DIOATTN_BWD_TRACE=1 &&
      ninja -C "$TBUILD" -j "$JOBS" ioattn_cuda_bench; } >"$OUT/bwdtrace.log" 2>&1
  for v in ${GPU_CHECK_TRACE_VARIANTS:-tmald pp}; do
    hd=128
    [[ ${GPU_CHECK_TRACE_D64:-0} == 1 ]] && hd=64  # the hdim-64 kernel instead
    for s in ${GPU_CHECK_TRACE_SEQLENS:-4096 16384}; do
      echo "## variant $v hdim $hd seqlen $s" >>"$OUT/bwdtrace.log"
      IOATTN_BWD_SM90_VARIANT=$v timeout 120 "$TBUILD/ioattn_cuda_bench" bwd --hdims $hd --seqlens "$s" >>"$OUT/bwdtrace.log" 2>&1
    done
  done
  note "bwdtrace   rc=$?  $(( $(stamp) - t0 )) s  (bwdtrace.log)"
  grep -E '^## variant|^bwd trace' "$OUT/bwdtrace.log" | tee -a "$SUMMARY"
fi

# ---- the 16-bit forward's per-tile phases (optional stage fwdtrace) -------------------------------
# A second build with -DIOATTN_FWD_TRACE=1 (flash_fwd_sm90.cuh: SM clock stamps per tile of the v3 and
# v4 bodies, every consumer warpgroup, and the v3 producer); ioattn_cuda_bench grid prints the trace
# after an instance's 10th launch, per HDIM:CAUSAL of GPU_CHECK_FWDTRACE_CFGS (default "128:0 64:1
# 256:0": the three rows that trailed cuDNN at 2k in session 35) and seqlen of
# GPU_CHECK_FWDTRACE_SEQLENS (default "2048 16384"), one process each.
if want fwdtrace; then
  t0=$(stamp)
  WBUILD="$BUILD-fwdtrace"
  { configure "$WBUILD" -DCMAKE_CUDA_FLAGS=-DIOATTN_FWD_TRACE=1 &&
      ninja -C "$WBUILD" -j "$JOBS" ioattn_cuda_bench; } >"$OUT/fwdtrace.log" 2>&1
  for cfg in ${GPU_CHECK_FWDTRACE_CFGS:-128:0 64:1 256:0}; do
    for s in ${GPU_CHECK_FWDTRACE_SEQLENS:-2048 16384}; do
      echo "## hdim ${cfg%:*} causal ${cfg#*:} seqlen $s" >>"$OUT/fwdtrace.log"
      timeout 120 "$WBUILD/ioattn_cuda_bench" grid --hdims "${cfg%:*}" --seqlens "$s" --dtypes bf16 --f16-hdims 0 \
        --causal "${cfg#*:}" >>"$OUT/fwdtrace.log" 2>&1
    done
  done
  note "fwdtrace   rc=$?  $(( $(stamp) - t0 )) s  (fwdtrace.log)"
  grep -E '^## hdim|^fwd trace' "$OUT/fwdtrace.log" | tee -a "$SUMMARY"
fi

# ---- the fp8 forward's consumer-loop phases (optional stage fp8trace) ------------------------------
# A second build with -DIOATTN_FP8_TRACE=1 (flash_fwd_sm90_fp8.cuh: SM clock stamps per phase of the
# steady-state steps, both consumer warpgroups); ioattn_sm90_check's fp8 bench prints the trace after
# the 10th launch of each seqlen, per tile width in GPU_CHECK_FP8TRACE_BLOCKN (default "192 128").
if want fp8trace; then
  t0=$(stamp)
  FBUILD="$BUILD-fp8trace"
  { configure "$FBUILD" -DCMAKE_CUDA_FLAGS=-DIOATTN_FP8_TRACE=1 &&
      ninja -C "$FBUILD" -j "$JOBS" ioattn_sm90_check; } >"$OUT/fp8trace.log" 2>&1
  for bn in ${GPU_CHECK_FP8TRACE_BLOCKN:-192 128}; do
    IOATTN_SM90_FP8_BLOCKN=$bn timeout 120 "$FBUILD/ioattn_sm90_check" --bench-only --fp8-only >>"$OUT/fp8trace.log" 2>&1
  done
  note "fp8trace   rc=$?  $(( $(stamp) - t0 )) s  (fp8trace.log)"
  grep -E '^fp8 trace' "$OUT/fp8trace.log" | tee -a "$SUMMARY"
fi

# ---- A/B of the fp8 forward's switches (optional stage fp8ab) ---------------------------------------
# Session 17's calls as a stage: each mode's correctness (ioattn_sm90_check --check-only --fp8-only,
# hdim 64, 128 and 256 cases) and its fp8 ms (--bench-only --fp8-only: 16k tokens, bf16 O, the V^T
# pre-pass included; the summary takes the hdim-128 rows, 16 heads) over interleaved passes; a mode
# that fails its checks is not timed.
if want fp8ab && [[ -x $BUILD/ioattn_sm90_check ]]; then
  t0=$(stamp)
  declare -A FP8AB_ENV=()
  FP8AB_MODES=()
  for mode in ${GPU_CHECK_FP8AB_MODES:-default n128:IOATTN_SM90_FP8_BLOCKN=128}; do
    case $mode in
      default) envs="" ;;
      *:*) envs=${mode#*:}; envs=${envs//,/ }; mode=${mode%%:*} ;;
      *) note "fp8ab: unknown mode '$mode' (default, NAME:ENV=V,...): skipped"; continue ;;
    esac
    echo "## check $mode ($envs)" >>"$OUT/fp8ab.log"
    if env $envs timeout 120 "$BUILD/ioattn_sm90_check" --check-only --fp8-only >>"$OUT/fp8ab.log" 2>&1; then
      FP8AB_ENV[$mode]=$envs
      FP8AB_MODES+=("$mode")
    fi
    note "fp8ab check $mode: $(grep 'fp8 correctness' "$OUT/fp8ab.log" | tail -1)"
  done
  for pass in $(seq 1 "${GPU_CHECK_FP8AB_PASSES:-2}"); do
    for mode in "${FP8AB_MODES[@]}"; do
      echo "## bench $mode pass $pass" >>"$OUT/fp8ab.log"
      env ${FP8AB_ENV[$mode]} timeout 120 "$BUILD/ioattn_sm90_check" --bench-only --fp8-only 2>&1 |
        awk -v m="$mode" '/^[0-9]+ +(no|yes) /{print "fp8ab_row", m, $1, $2, $3, $5} {print}' >>"$OUT/fp8ab.log"
    done
  done
  note "fp8ab      $(( $(stamp) - t0 )) s  (fp8ab.log)"
  python3 - "$OUT/fp8ab.log" <<'PY' | tee -a "$SUMMARY"
import sys, collections
ms = collections.defaultdict(lambda: collections.defaultdict(list))
bf = collections.defaultdict(list)
modes = []
for line in open(sys.argv[1]):
    f = line.split()
    if len(f) == 6 and f[0] == "fp8ab_row":
        mode, key = f[1], (int(f[2]), f[3])
        ms[key][mode].append(float(f[5]))
        bf[key].append(float(f[4]))
        if mode not in modes: modes.append(mode)
if not modes:
    print("fp8ab: no rows"); sys.exit(0)
print("fp8ab: seqlen causal | bf16 ms | " + " | ".join(f"{m} fp8 ms (passes)" for m in modes))
for k in sorted(ms):
    cells = [" / ".join(f"{x:.3f}" for x in ms[k].get(m, [])) or "-" for m in modes]
    print(f"fp8ab: {k[0]:6d} {k[1]:5s} | {min(bf[k]):.3f} | " + " | ".join(cells))
PY
fi

# ---- the mma decode kernel's phases (optional stage dectrace) ---------------------------------------
# A second build with -DIOATTN_DECODE_TRACE=1 (SM clock stamps per phase of the first 1024 CTAs, see
# serving_decode_mma.cu); the bench's eager calls print per-phase cycles after the 40th launch, per
# cell in GPU_CHECK_DECTRACE_CELLS ("batch:kv:splits", splits 0 = the heuristic's).
if want dectrace; then
  t0=$(stamp)
  DBUILD="$BUILD-dtrace"
  { configure "$DBUILD" -DCMAKE_CUDA_FLAGS=-DIOATTN_DECODE_TRACE=1 &&
      ninja -C "$DBUILD" -j "$JOBS" ioattn_cuda_decode_bench; } >"$OUT/dectrace.log" 2>&1
  for cell in ${GPU_CHECK_DECTRACE_CELLS:-1:4096:0 1:4096:8 1:4096:64 1:32768:0 16:4096:0 64:32768:0}; do
    IFS=: read -r cb ck cs <<<"$cell"
    echo "## batch $cb kv $ck splits $cs" >>"$OUT/dectrace.log"
    timeout 120 "$DBUILD/ioattn_cuda_decode_bench" --batch "$cb" --kv "$ck" --splits "$cs" --pages 0 --caches bf16 \
      --eager 1 --copy 0 --repeats 12 >>"$OUT/dectrace.log" 2>&1
  done
  note "dectrace   rc=$?  $(( $(stamp) - t0 )) s  (dectrace.log)"
  grep -E '^## batch|^decode trace|"impl"' "$OUT/dectrace.log" | sed -E 's/"heads_q".*"impl"/"impl"/' | tee -a "$SUMMARY"
fi

# ---- decode vs PyTorch SDPA cudnn / flash (enable_gqa), same run ----------------------------------
if want decode; then
  t0=$(stamp)
  # With the extension the interleave stage built in this run (BUILD/pyroot): ioattn.decode timed
  # beside SDPA in the same process too (eager).
  pyargs=()
  [[ ${interleave_built:-0} == 1 ]] && pyargs=(--ioattn-python)
  PYTHONPATH="$BUILD/pyroot${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 python3 "$ROOT/bench/peer_decode.py" \
    --bench "$BUILD/ioattn_cuda_decode_bench" "${pyargs[@]}" ${GPU_CHECK_DECODE_ARGS:-} --out "$OUT/peer_decode.json" \
    >"$OUT/decode.log" 2>&1
  note "decode     rc=$?  $(( $(stamp) - t0 )) s  (decode.log, peer_decode.json)"
  sed -n '/^same process/,/^ioattn: the dispatcher/p' "$OUT/decode.log" | tee -a "$SUMMARY" >/dev/null
  # The experimental bulk-copy loader (IOATTN_DECODE_LOADER=bulk): its bitwise test first (bounded:
  # a wrong mbarrier count would spin for ever), then ioattn alone on the same grid -> decode_bulk.json.
  if [[ ${GPU_CHECK_DECODE_BULK:-1} == 1 && -x $BUILD/test_cuda_serving ]]; then
    if bounded_test "bulk test " 180 "$BUILD/test_cuda_serving" 'CudaDecode.BulkLoader*' "$OUT/decode_bulk.log"; then
      t0=$(stamp)
      IOATTN_DECODE_LOADER=bulk timeout 300 "$BUILD/ioattn_cuda_decode_bench" --pages 0,16 --caches bf16 \
        ${GPU_CHECK_DECODE_ARGS:-} >>"$OUT/decode_bulk.log" 2>&1
      note "bulk bench rc=$?  $(( $(stamp) - t0 )) s  (decode_bulk.log, decode_bulk.json)"
      grep '^{' "$OUT/decode_bulk.log" >"$OUT/decode_bulk.json"
    fi
  fi
  # Ring depths of the mma kernel (16-bit caches at head_dim 128; IOATTN_DECODE_STAGES=3: the 3-stage
  # ring where the default now picks 2 (short sequences); =2: a
  # 2-stage ring, 3 CTAs per SM; =5: a 5-stage ring, 1 CTA per SM with 4 tiles in flight): per
  # "ring:splits,..." entry of GPU_CHECK_DECODE_RINGS (default "2:0 5:0,1,2"; splits 0 = the
  # heuristic, which counts the ring's CTAs per SM), its bitwise test, then the grid at each split
  # count -> appended to decode_bulk.json (the kernel name says "stagesN"). "" skips it.
  if [[ -x $BUILD/test_cuda_serving ]]; then
    for spec in ${GPU_CHECK_DECODE_RINGS-2:0 5:0,1,2}; do
      ring=${spec%%:*}
      case $ring in
        2) tname='CudaDecode.TwoStageRing*' ;;
        3) tname='CudaDecode.ShortSequencesTakeTheTwoStageRing' ;;
        5) tname='CudaDecode.FiveStageRing*' ;;
        *) continue ;;
      esac
      bounded_test "stages$ring test" 180 "$BUILD/test_cuda_serving" "$tname" "$OUT/decode_stages$ring.log" || continue
      for sp in $(tr , ' ' <<<"${spec#*:}"); do
        t0=$(stamp)
        IOATTN_DECODE_STAGES=$ring timeout 200 "$BUILD/ioattn_cuda_decode_bench" --pages 0,16 --caches bf16 --eager 0 \
          --copy 0 --splits "$sp" ${GPU_CHECK_DECODE_ARGS:-} >>"$OUT/decode_stages$ring.log" 2>&1
        note "stages$ring splits=$sp rc=$?  $(( $(stamp) - t0 )) s  (decode_stages$ring.log)"
      done
      grep '^{' "$OUT/decode_stages$ring.log" >>"$OUT/decode_bulk.json"
    done
  fi
  # Split-count sweep (GPU_CHECK_DECODE_SPLITS="1 2 4 8"): does the heuristic leave speed at large
  # batch (wave quantisation at 2 CTAs per SM)? Appended to decode_bulk.json, impl "ioattn" rows.
  for sp in ${GPU_CHECK_DECODE_SPLITS:-}; do
    t0=$(stamp)
    timeout 200 "$BUILD/ioattn_cuda_decode_bench" ${GPU_CHECK_DECODE_SPLIT_SHAPES:---batch 16,64 --kv 32768,131072} \
      --pages ${GPU_CHECK_DECODE_SPLIT_PAGES:-0} --caches bf16 --eager 0 --copy 0 --splits "$sp" >>"$OUT/decode_splits.log" 2>&1
    note "splits=$sp   rc=$?  $(( $(stamp) - t0 )) s  (decode_splits.log)"
  done
  [[ -f $OUT/decode_splits.log ]] && grep '^{' "$OUT/decode_splits.log" >>"$OUT/decode_bulk.json"
  # One line per bulk-loader / split-sweep row (graph replay; compare with the decode table above).
  [[ -s $OUT/decode_bulk.json ]] && python3 - "$OUT/decode_bulk.json" <<'PY' | tee -a "$SUMMARY"
import json, re, sys
for line in open(sys.argv[1]):
    r = json.loads(line)
    if r.get("impl") != "ioattn":
        continue
    kern = r.get("kernel", "")
    ring = re.search(r" mma (stages\d+)", kern)
    loader = "bulk" if " bulk" in kern else ring.group(1) if ring else "cp.async"
    print(f"decode {loader:8s} b{r['batch']:<3d} kv {r['kv_len']:<6d} page {r['page_size']:<3d} {r['cache']:7s} "
          f"splits {r['splits']:<3d} {r['tbps']:.3f} TB/s")
PY
fi

# ---- ring attention: time per rank vs single device / P, NVLink hop model -------------------------
# ---- the Hopper kernel's KV-cache rows (optional stage sm90cache; forced by IOATTN_SM90_CACHE=1) -----
if want sm90cache && [[ -x $BUILD/test_cuda_serving ]]; then
  # (the defaults; Sm90RowsTakeSixteenBitCaches runs every case forced / default / off / copy-all / copy-off)
  bounded_test "sm90cache tests" 120 "$BUILD/test_cuda_serving" '*CachePrefill*' "$OUT/sm90cache_tests.log" || true
  grep -E '^\[  FAILED|Failure' "$OUT/sm90cache_tests.log" | head -20 | tee -a "$SUMMARY" >/dev/null
  for tool in memcheck racecheck; do
    IOATTN_SM90_CACHE=1 timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 "$BUILD/test_cuda_serving" \
      --gtest_filter='*CachePrefill*' >"$OUT/sm90cache_$tool.log" 2>&1
    note "sm90cache $tool rc=$?  $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/sm90cache_$tool.log" | tail -1)"
  done
  # modes: the default (direct pieces >= 64 rows, the gathered copy for the rest), mma.sync only,
  # direct only (no copy: small pages and 8-bit caches on mma.sync), the copy for every paged cache
  for mode in default:IOATTN_X=1 mma:IOATTN_SM90_CACHE=0 direct:IOATTN_SM90_CACHE_GATHER=0 copy:IOATTN_SM90_CACHE_GATHER=1; do
    env "${mode#*:}" timeout 120 "$BUILD/ioattn_cuda_decode_bench" --seqlen-q 512 --copy 0 --batch 1,4 \
      --kv 4096,16384 --pages 0,1,16,64 --caches bf16,f8e4m3 2>&1 | grep '^{' | sed "s/^{/{\"mode\": \"${mode%%:*}\", /" \
      >>"$OUT/sm90cache.json"
  done
  python3 - "$OUT/sm90cache.json" <<'PY' | tee -a "$SUMMARY"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
modes = ["default", "mma", "direct", "copy"]
t = {}
for r in rows:
    k = (r["cache"], r["batch"], r["kv_len"], r["page_size"], r["causal"])
    t.setdefault(k, {})["fwd" if r["impl"] == "forward_contiguous" else r["mode"]] = r["tflops"]
print("sm90cache (512 rows, bf16 q; x forward() on contiguous K / V): cache batch kv page causal | " + " | ".join(modes))
for k in sorted(t):
    d = t[k]
    f = d.get("fwd") or 0
    print("  %s %d %d %d %d | " % k + " | ".join("%.2f" % (d[m] / f) if f and m in d else "-" for m in modes))
PY
fi

# ---- the fp8 kernel's varlen rows (optional stage fp8varlen) ----------------------------------------
if want fp8varlen && [[ -x $BUILD/tests/ioattn_tests ]]; then
  bounded_test "fp8 tests" 150 "$BUILD/tests/ioattn_tests" 'Fp8Cuda.*' "$OUT/fp8varlen_tests.log" || true
  grep -E '^\[  FAILED|Failure|naive fp8 error' "$OUT/fp8varlen_tests.log" | head -20 | tee -a "$SUMMARY" >/dev/null
  for tool in memcheck racecheck; do
    timeout 300 compute-sanitizer --tool $tool --error-exitcode 9 "$BUILD/tests/ioattn_tests" \
      --gtest_filter='Fp8Cuda.VarlenOnDevice' >"$OUT/fp8varlen_$tool.log" 2>&1
    note "fp8varlen $tool rc=$?  $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$OUT/fp8varlen_$tool.log" | tail -1)"
  done
  if [[ -x $BUILD/ioattn_cuda_bench ]]; then
    timeout 200 "$BUILD/ioattn_cuda_bench" local --dtype f8e4m3 --hdims 64,128,256 \
      --seqlens 2048,8192 --features causal,varlen 2>&1 | grep '^{' >"$OUT/fp8varlen.json"
    python3 - "$OUT/fp8varlen.json" <<'PY' | tee -a "$SUMMARY"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
t = {}
for r in rows:
    t.setdefault((r["hdim"], r["seqlen"]), {})[r["feature"]] = r["tflops"]
print("fp8varlen (e4m3, bf16 O, causal): hdim seqlen | causal TFLOP/s | varlen (same sequences packed) | ratio")
for k in sorted(t):
    d = t[k]
    print("  %d %d | %.1f | %.1f | %.2f" % (k + (d.get("causal", 0), d.get("varlen", 0),
                                                 d.get("varlen", 0) / d["causal"] if d.get("causal") else 0)))
PY
  fi
fi

# ---- prefill through the KV cache (optional stage prefill) ----------------------------------------
if want prefill && [[ -x $BUILD/test_cuda_serving ]]; then
  if bounded_test "prefill tests" 300 "$BUILD/test_cuda_serving" '*CachePrefill*' "$OUT/prefill_tests.log"; then :; fi
  grep -E '^\[  FAILED|Failure|error' "$OUT/prefill_tests.log" | head -20 | tee -a "$SUMMARY" >/dev/null
  t0=$(stamp)
  timeout 300 "$BUILD/ioattn_cuda_decode_bench" --seqlen-q 512 --copy 0 \
    ${GPU_CHECK_PREFILL_ARGS:---batch 1,4 --kv 4096,16384 --pages 0,16 --caches bf16,f8e4m3} \
    >"$OUT/prefill.log" 2>&1
  note "prefill bench rc=$?  $(( $(stamp) - t0 )) s  (prefill.log, prefill.json)"
  # The 8-bit tiles through registers (IOATTN_PREFILL_8BIT=regs; the default stages them and its kernel
  # names end in "8bit-staged"), same grid.
  IOATTN_PREFILL_8BIT=regs timeout 300 "$BUILD/ioattn_cuda_decode_bench" --seqlen-q 512 --copy 0 \
    ${GPU_CHECK_PREFILL_ARGS:---batch 1,4 --kv 4096,16384 --pages 0,16 --caches f8e4m3} \
    >>"$OUT/prefill.log" 2>&1
  note "prefill regs rc=$?"
  grep '^{' "$OUT/prefill.log" >"$OUT/prefill.json"
  python3 - "$OUT/prefill.json" <<'PY' | tee -a "$SUMMARY"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
key = lambda r: (r["batch"], r["kv_len"], r["page_size"], r["cache"], r["causal"])
peer = {}  # the first run's forward() rows (the staged run times forward() again; those are not the baseline)
for r in rows:
    if r.get("impl") == "forward_contiguous":
        peer.setdefault(key(r), r)
print("prefill (512 rows): batch kv page cache causal | through the cache TFLOP/s | forward() contiguous | ratio")
for r in rows:
    if r.get("impl") != "ioattn_prefill":
        continue
    p = peer.get(key(r))
    ratio = r["tflops"] / p["tflops"] if p and p["tflops"] > 0 else float("nan")
    tag = " staged" if "8bit-staged" in r.get("kernel", "") else ""
    print("  %d %d %d %s%s %d | %.1f | %s | %.2f" % (r["batch"], r["kv_len"], r["page_size"], r["cache"], tag, r["causal"],
                                                 r["tflops"], "%.1f" % p["tflops"] if p else "-", ratio))
PY
fi

if want cp; then
  t0=$(stamp)
  NCCL_NVLS_ENABLE=0 "$BUILD/bench/ioattn_bench_cp" --seqlen 32768 --heads 16 --head-dim 128 --ranks 1,2,4,8 \
    >"$OUT/cp.log" 2>&1
  note "cp bench   rc=$?  $(( $(stamp) - t0 )) s  (cp.log)"
fi

# ---- ring attention over NCCL on every visible GPU (stage cpnccl; multi-GPU machines) ------------
if want cpnccl; then
  t0=$(stamp)
  export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
  ngpu=$(nvidia-smi -L 2>/dev/null | wc -l)
  # A rank that faults leaves its partner waiting in NCCL: bound every run (rc 124 = hung).
  NCCL_DEBUG=WARN timeout 240 "$BUILD/tests/test_cp_nccl" >"$OUT/cp_nccl_test.log" 2>&1
  rc=$?
  note "cp_nccl    rc=$rc  $(( $(stamp) - t0 )) s  $ngpu GPUs  $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/cp_nccl_test.log" | sort | uniq -c | tr -s ' ' | tr '\n' ';')"
  ranks=$(seq -s, 2 "$ngpu" | sed 's/,$//')
  if [[ $rc != 0 ]]; then
    ranks=""
    note "cp nccl bench skipped: the NCCL test failed"
    tail -30 "$OUT/cp_nccl_test.log" | tee -a "$SUMMARY"
  fi
  : >"$OUT/cp_nccl.log"
  for tok in ${ranks:+${GPU_CHECK_CP_TOKENS:-8192 16384 32768}}; do
    for causal in 1 0; do
      t1=$(stamp)
      for P in ${ranks//,/ }; do
        NCCL_DEBUG=WARN timeout 150 "$BUILD/bench/ioattn_bench_cp" --nccl 1 --ranks "$P" --seqlen $((tok * P)) --heads 16 --head-dim 128 \
          --causal $causal --repeats 5 >>"$OUT/cp_nccl.log" 2>&1
        note "cp nccl    rc=$?  $(( $(stamp) - t1 )) s  P=$P tokens/GPU=$tok causal=$causal"
      done
    done
  done
  grep '^{' "$OUT/cp_nccl.log" >"$OUT/cp_nccl.json"
  grep -E '^(## ring|\| )' "$OUT/cp_nccl.log" | tee -a "$SUMMARY" >/dev/null
fi

# ---- HBM read ceiling by load mechanism (stage readbw) ------------------------------------------
if want readbw; then
  t0=$(stamp)
  cmake --build "$BUILD" --target ioattn_cuda_readbw -j "$JOBS" >"$OUT/readbw.log" 2>&1 &&
    timeout 120 "$BUILD/ioattn_cuda_readbw" --gib 2 --ctas-per-sm 1,2,3,4 >>"$OUT/readbw.log" 2>&1
  note "readbw     rc=$?  $(( $(stamp) - t0 )) s  (readbw.log, readbw.json)"
  grep '^{' "$OUT/readbw.log" >"$OUT/readbw.json"
  sed -n '/^## read bandwidth/,$p' "$OUT/readbw.log" | tee -a "$SUMMARY" >/dev/null
fi

# ---- wgmma rate per shape / operand source (optional stage wgmmarate; seconds) -------------------
if want wgmmarate; then
  t0=$(stamp)
  cmake --build "$BUILD" --target ioattn_sm90_wgmma_rate -j "$JOBS" >"$OUT/wgmmarate.log" 2>&1 &&
    timeout 60 "$BUILD/ioattn_sm90_wgmma_rate" >>"$OUT/wgmmarate.log" 2>&1
  note "wgmmarate  rc=$?  $(( $(stamp) - t0 )) s  (wgmmarate.log)"
  grep '^{' "$OUT/wgmmarate.log" | tee -a "$SUMMARY" >/dev/null
fi

# ---- 7. Python package: pip install with CUDA, pytest with torch (CUDA, autograd, compile) -------
if want python; then
  t0=$(stamp)
  {
    PREFIX=()
    [[ -d $ROOT/.deps/usr ]] && PREFIX=(-Ccmake.define.CMAKE_PREFIX_PATH="$ROOT/.deps/usr")
    python3 -m pip install -q --no-build-isolation --no-deps --no-index "$ROOT" "${PREFIX[@]}" \
      -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCHS" -Cbuild-dir="$BUILD-python" &&
      (cd "$ROOT/python/tests" && PYTHONUNBUFFERED=1 python3 -m pytest -q -p no:cacheprovider .) &&
      PYTHONUNBUFFERED=1 python3 "$ROOT/python/examples/transformer_block.py" --device cuda --dtype bf16 --compile
  } >"$OUT/python.log" 2>&1
  rc=$?
  note "python     rc=$rc  $(( $(stamp) - t0 )) s  $(grep -E '[0-9]+ passed' "$OUT/python.log" | tail -1)"
fi

# ---- report: JSON + charts from the built tree (tools/report/report.sh), one archive --------------
if want report; then
  t0=$(stamp)
  [[ -x $BUILD/ioattn || ! -f $BUILD/build.ninja ]] || ninja -C "$BUILD" -j "$JOBS" ioattn_cli >"$OUT/report.log" 2>&1
  "$ROOT/tools/report/report.sh" "$OUT/report" "$BUILD" "${GPU_CHECK_REPORT_INPUTS:-$OUT}" >>"$OUT/report.log" 2>&1
  rc=$?
  note "report     rc=$rc  $(( $(stamp) - t0 )) s  (report.tgz: PNG charts + JSON; report.log)"
  [[ -f $OUT/report/steps.txt ]] && sed 's/^/  /' "$OUT/report/steps.txt" | tee -a "$SUMMARY"
  grep -E "skipped \(|FAILED" "$OUT/report.log" | sort -u | sed 's/^ */  /' | tee -a "$SUMMARY"
  # The charts and JSON travel as one file (at most 8 come back from the device machine).
  (cd "$OUT" && [[ -d report ]] && tar czf report.tgz report && rm -rf report)
fi

# ---- 8. tile sweep -------------------------------------------------------------------------------
if [[ ${GPU_CHECK_TUNE:-0} == 1 && -x $BUILD/ioattn_cuda_tune ]]; then
  t0=$(stamp)
  "$BUILD/ioattn_cuda_tune" ${GPU_CHECK_TUNE_ARGS:-} >"$OUT/tune.log" 2>&1
  note "tune       rc=$?  $(( $(stamp) - t0 )) s  (tune.log)"
fi

# ---- backward tile sweep (stage bwdtune, not in the default list) ----------------------------------
# Builds only ioattn_cuda_bwd_tune (and the library it links), so it also runs alone. The ptxas -v
# lines of the candidates (registers, spills) are in bwdtune.log.
if want bwdtune; then
  t0=$(stamp)
  {
    { [[ -f $BUILD/build.ninja ]] || configure; } &&
      ninja -C "$BUILD" -j "$JOBS" ioattn_cuda_bwd_tune &&
      echo "## build done after $(( $(stamp) - t0 )) s" &&
      "$BUILD/ioattn_cuda_bwd_tune" --budget-s "${GPU_CHECK_BWDTUNE_BUDGET:-100}" ${GPU_CHECK_BWDTUNE_ARGS:-}
  } >"$OUT/bwdtune.log" 2>&1
  rc=$?
  grep '^{' "$OUT/bwdtune.log" >"$OUT/bwdtune.json"
  note "bwdtune    rc=$rc  $(( $(stamp) - t0 )) s  (bwdtune.log, bwdtune.json)"
  sed -n '/^## backward tile sweep/,$p' "$OUT/bwdtune.log" | tee -a "$SUMMARY"
  [[ $rc == 0 ]] || tail -20 "$OUT/bwdtune.log" | tee -a "$SUMMARY"
fi

echo
echo "==== gpu-check summary ($OUT) ===="
cat "$SUMMARY"
[[ -f $OUT/cuda_tests.log ]] && grep -E '^\[  FAILED|Failure|error' "$OUT/cuda_tests.log" | head -20
[[ -f $OUT/bench.log ]] && sed -n '/^## forward/,$p' "$OUT/bench.log"
[[ -f $OUT/sm90.log ]] && tail -40 "$OUT/sm90.log"
[[ -f $OUT/backward.log ]] && sed -n '/^## forward+backward/,$p' "$OUT/backward.log"
[[ -f $OUT/decode.log ]] && sed -n '/^GQA/,$p' "$OUT/decode.log"
[[ -f $OUT/cp.log ]] && sed -n '/^## ring/,$p' "$OUT/cp.log"
[[ -f $OUT/report.log ]] && sed -n '/^==== report/,$p' "$OUT/report.log"
# At most 8 files come back from the device machine: keep the summary and the JSON/CSV results,
# pack every log into one archive.
(cd "$OUT" && ls *.log >/dev/null 2>&1 && tar czf logs.tgz *.log && rm -f *.log)
# Still more than 8 (a long stage list: session 7 lost summary.txt this way): the JSON/CSV results
# go into data.tgz too, so summary.txt and the two archives always come back.
(cd "$OUT" && [[ $(ls | wc -l) -gt 8 ]] && tar czf data.tgz $(ls | grep -E '\.(json|csv)$') &&
  rm -f $(ls | grep -E '\.(json|csv)$')) || true
exit 0

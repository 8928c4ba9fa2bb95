#!/usr/bin/env bash
# One GPU session for the sm90 kernel: PTX unit tests, correctness, speed, peer (cuDNN / flash).
#   src/cuda/hopper/gpu_run.sh OUTDIR [VARIANT_DIR...]   (logs: OUTDIR/logs.tgz)
# Uses the binaries in build-sm90/v0 (built by build.sh, carried) when they load on this machine,
# else rebuilds them. Correctness: the default table; the default on 3 CTAs (every CTA runs many
# tiles: dynamic claims, the cross-tile pipeline); the v4 body everywhere (hdim128 too) with the
# early rescale on 5 CTAs. Speed, 50 launches per shape, interleaved so each variant runs twice:
# the default, IOATTN_SM90_BODY=v4 / v3 (hdim128 rows: current vs v3 kernel body), the v3 policy
# on the v4 body (IOATTN_SM90_OLD_POLICY=1); each extra VARIANT_DIR (another build, e.g. the
# previous version) is timed only. Then the peer (cuDNN, flash) prints one table, every column.
set -uo pipefail
final=$1; shift
out=$final/raw  # everything lands here and is packed into $final/logs.tgz at exit (few files come back)
mkdir -p "$out"
trap 'tar czf "$final/logs.tgz" -C "$out" . && rm -rf "$out"' EXIT
t0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - t0 ))s] $*"; }
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw \
  --format=csv 2>&1 | tee "$out/smi.txt"
bin=build-sm90/v0
if ! "$bin/ioattn_sm90_check" --probe >/dev/null 2>&1; then
  stamp "carried binaries do not load here: rebuilding"
  src/cuda/hopper/build.sh "$bin" > "$out/build.log" 2>&1 || { cat "$out/build.log"; exit 1; }
fi
check() {  # name, env...
  local name=$1; shift
  stamp "correctness $name"
  env "$@" timeout 200 "$bin/ioattn_sm90_check" --check-only > "$out/check_$name.log" 2>&1
  grep -E "FAIL|passed" "$out/check_$name.log"
}
ours=()
bench() {  # name, binary dir, env...
  local name=$1 dir=$2; shift 2
  stamp "speed $name"
  env "$@" timeout 100 "$dir/ioattn_sm90_check" --bench-only --csv "$out/ours_$name.csv" > "$out/bench_$name.log" 2>&1
  ours+=(--ours "$name=$out/ours_$name.csv")
}
stamp "ptx unit tests"
timeout 60 "$bin/ioattn_test_ptx_sm90" 2>&1 | tee "$out/ptx.log" | grep -E "FAIL|passed"
check default
check 3ctas IOATTN_SM90_MAX_CTAS=3
check knobs5 IOATTN_SM90_BODY=v4 IOATTN_SM90_RESCALE_EARLY=1 IOATTN_SM90_MAX_CTAS=5
export IOATTN_SM90_BENCH_REPS=${IOATTN_SM90_BENCH_REPS:-50}
# Interleaved A B C D .. D C B A: the spread between the two runs of one variant is the noise.
bench default "$bin"
bench body4 "$bin" IOATTN_SM90_BODY=v4
bench body3 "$bin" IOATTN_SM90_BODY=v3
bench v3pol "$bin" IOATTN_SM90_OLD_POLICY=1
for v in "$@"; do bench "$(basename "$v")" "$v"; done
for v in "$@"; do bench "$(basename "$v")2" "$v"; done
bench v3pol2 "$bin" IOATTN_SM90_OLD_POLICY=1
bench body3_2 "$bin" IOATTN_SM90_BODY=v3
bench body4_2 "$bin" IOATTN_SM90_BODY=v4
bench again "$bin"
stamp "peer (torch SDPA cudnn / flash)"
PYTHONUNBUFFERED=1 timeout 200 python3 src/cuda/hopper/peer_sdpa.py "${ours[@]}" --csv "$out/peer.csv" \
  > "$out/peer.log" 2>&1
cat "$out/peer.log"
stamp done

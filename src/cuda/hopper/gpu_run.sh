#!/usr/bin/env bash
# One GPU session for the sm90 kernel: PTX unit tests, correctness, speed, peer (cuDNN / flash).
#   src/cuda/hopper/gpu_run.sh OUTDIR [VARIANT_DIR...]   (logs: OUTDIR/logs.tgz)
# Uses the binaries in build-sm90/v0 (built by build.sh, carried) when they load on this machine,
# else rebuilds them. Correctness runs four ways: the default policy; static persistent grid on 3
# CTAs (every CTA runs many tiles: the cross-tile pipeline, causal zigzag); dynamic scheduler +
# O-rescale skip on the full grid; dynamic + skip + 3 consumer warpgroups (hdim 64) on 3 CTAs.
# Speed runs the default and the policy knobs (see flash_fwd_sm90.cu), then the peer prints one
# table. Each extra VARIANT_DIR (another build, e.g. the previous version) is timed only.
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
check static3 IOATTN_SM90_GRID=static IOATTN_SM90_MAX_CTAS=3
check dynskip IOATTN_SM90_GRID=dynamic IOATTN_SM90_RESCALE_SKIP=1
check all3 IOATTN_SM90_GRID=dynamic IOATTN_SM90_RESCALE_SKIP=1 IOATTN_SM90_WG3=1 IOATTN_SM90_MAX_CTAS=3
bench default "$bin"
bench dyn "$bin" IOATTN_SM90_GRID=dynamic
bench skip "$bin" IOATTN_SM90_RESCALE_SKIP=1
bench dynskip "$bin" IOATTN_SM90_GRID=dynamic IOATTN_SM90_RESCALE_SKIP=1
bench wg3 "$bin" IOATTN_SM90_WG3=1
bench wg3dsk "$bin" IOATTN_SM90_WG3=1 IOATTN_SM90_GRID=dynamic IOATTN_SM90_RESCALE_SKIP=1
bench tile "$bin" IOATTN_SM90_GRID=tile
for v in "$@"; do bench "$(basename "$v")" "$v"; done
bench again "$bin"
stamp "peer (torch SDPA cudnn / flash)"
PYTHONUNBUFFERED=1 timeout 200 python3 src/cuda/hopper/peer_sdpa.py "${ours[@]}" --csv "$out/peer.csv" \
  > "$out/peer.log" 2>&1
cat "$out/peer.log"
stamp done

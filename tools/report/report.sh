#!/usr/bin/env bash
# report.sh OUTDIR BUILD_DIR [INPUTS_DIR] — regenerate the report's JSON and charts from a built tree.
#
# On a GPU machine (BUILD_DIR built with CUDA, `ioattn info` sees a device), in about 4-5 minutes:
#   1. cpu_bench.jsonl  `ioattn bench --device cpu`: naive vs flash, f32      + cpu_table.txt (model vs time)
#   2. bench.jsonl      `ioattn bench --device cuda`: naive vs flash, bf16, causal and not, 1k..16k
#   3. traffic.json     tools/report/traffic.py: Nsight Compute DRAM bytes per forward vs the model
#   4. ceilings.json    tools/report/ceilings.py: copy bandwidth and bf16 GEMM rate (torch)
#   5. *.png            tools/report/charts.py, with INPUTS_DIR's peer.json, sm90.csv, peer_sm90.csv
#                       and peer_decode.json (gpu-check's bench / sm90 / decode stages) where present
# On a machine without a GPU, steps 2-4 are skipped and the charts use what there is.
# Each step logs to OUTDIR/report.log and one status line to OUTDIR/steps.txt; a failed step does
# not stop the later ones. Exit status: 0 when every step that ran succeeded.
#
# Environment: REPORT_SEQLENS (default 1024,2048,4096,8192,16384), REPORT_HDIMS (64,128), IOATTN_COMMIT,
# REPORT_CPU_SEQLENS (1024,2048,4096), PYTHON (python3), NCU (ncu on PATH or /usr/local/cuda/bin).
set -uo pipefail
OUT=${1:?usage: tools/report/report.sh OUTDIR BUILD_DIR [INPUTS_DIR]}
BUILD=${2:?usage: tools/report/report.sh OUTDIR BUILD_DIR [INPUTS_DIR]}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
BUILD=$(cd "$BUILD" && pwd)
IN=$(cd "${3:-$OUT}" && pwd)
HERE=$(cd "$(dirname "$0")" && pwd)
ROOT=$(cd "$HERE/../.." && pwd)
CLI=$BUILD/ioattn
PY=${PYTHON:-python3}
SEQ=${REPORT_SEQLENS:-1024,2048,4096,8192,16384}
HD=${REPORT_HDIMS:-64,128}
CPU_SEQ=${REPORT_CPU_SEQLENS:-1024,2048,4096}
export PATH=$PATH:/usr/local/cuda/bin
LOG=$OUT/report.log
: >"$LOG"
: >"$OUT/steps.txt"
status=0

# step NAME CMD...: runs CMD with its output appended to report.log, notes rc and seconds.
step() {
  local name=$1 t0 rc
  shift
  t0=$(date +%s)
  echo "#### $name: $*" >>"$LOG"
  "$@" >>"$LOG" 2>&1
  rc=$?
  echo "report $name rc=$rc $(( $(date +%s) - t0 )) s" | tee -a "$OUT/steps.txt"
  [[ $rc == 0 ]] || status=1
  return $rc
}

[[ -x $CLI ]] || { echo "report.sh: no ioattn CLI at $CLI (build the ioattn_cli target)"; exit 2; }
GPUS=$("$CLI" info --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["cuda_devices"])' 2>/dev/null || echo 0)
GPU_NAME=$("$CLI" info --json | "$PY" -c 'import json,sys; d=json.load(sys.stdin)["cuda_device_names"]; print(d[0] if d else "")' 2>/dev/null)
[[ -n $GPU_NAME ]] || GPU_NAME="no GPU ($(uname -n), $(nproc) CPU cores)"
# IOATTN_COMMIT names the tree when git cannot (e.g. a worktree copied to another machine).
COMMIT=${IOATTN_COMMIT:-$(git -C "$ROOT" rev-parse --short HEAD 2>/dev/null || echo unknown)}
"$PY" - "$OUT/meta.json" "$GPU_NAME" "tools/report/report.sh OUTDIR BUILD_DIR (ioattn $COMMIT)" <<'EOF'
import json, sys, time
json.dump(dict(date=time.strftime("%Y-%m-%d %H:%M %Z"), gpu=sys.argv[2], command=sys.argv[3]), open(sys.argv[1], "w"))
EOF

# 1. CPU: the same model beside measured time (naive = the float64 reference, flash = SIMD tiles).
step cpu_bench "$CLI" bench --device cpu --seqlen "$CPU_SEQ" --hdim 64,128 --causal 0 --dtype f32 \
  --backend naive,flash --batch 1 --heads 4 --repeats 3 --check-flops 3e8 --out "$OUT/cpu_bench.jsonl"
cpu_table() { "$PY" "$HERE/cpu_table.py" "$OUT/cpu_bench.jsonl" >"$OUT/cpu_table.txt"; }
step cpu_table cpu_table

if [[ $GPUS -gt 0 ]]; then
  # 2. GPU sweep: FlashAttention's grid (batch x seqlen = 16k tokens, hidden 2048), one workload per shape.
  step gpu_bench "$CLI" bench --device cuda --seqlen "$SEQ" --hdim "$HD" --causal 0,1 --dtype bf16 \
    --backend naive,flash --tokens 16384 --hidden 2048 --repeats 10 --warmup 2 --check-flops 3e8 \
    --out "$OUT/bench.jsonl"
  # 3. Measured DRAM traffic, one forward per point under ncu (the 8k hdim-128 pair first).
  step traffic "$PY" "$HERE/traffic.py" --ioattn "$CLI" --out "$OUT/traffic.json" --seqlens "$SEQ" \
    --hdims "$HD" --tokens 16384 --hidden 2048 --budget-s 200 ${NCU:+--ncu "$NCU"}
  # 4. Ceilings for the roofline, in the same run.
  step ceilings "$PY" "$HERE/ceilings.py" --out "$OUT/ceilings.json"
else
  echo "report: no CUDA device visible to $CLI: GPU steps skipped" | tee -a "$OUT/steps.txt"
fi

# 5. Charts from whatever JSON exists.
charts=("$PY" "$HERE/charts.py" --outdir "$OUT" --meta "$OUT/meta.json" --cpu-bench "$OUT/cpu_bench.jsonl")
[[ -f $OUT/bench.jsonl ]] && charts+=(--bench "$OUT/bench.jsonl")
[[ -f $OUT/traffic.json ]] && charts+=(--traffic "$OUT/traffic.json")
[[ -f $OUT/ceilings.json ]] && charts+=(--ceilings "$OUT/ceilings.json")
[[ -f $IN/peer.json ]] && charts+=(--peer "$IN/peer.json")
[[ -f $IN/sm90.csv ]] && charts+=(--sm90 "$IN/sm90.csv")
[[ -f $IN/peer_sm90.csv ]] && charts+=(--peer-sm90 "$IN/peer_sm90.csv")
for f in peer_decode.json decode.json; do
  [[ -f $IN/$f ]] && { charts+=(--decode "$IN/$f"); break; }
done
step charts "${charts[@]}"

echo
echo "==== report ($OUT) ===="
cat "$OUT/steps.txt"
grep -E "^(wrote|.*skipped|.*FAILED)" "$LOG" | grep -v "^####" | sed 's/^/  /'
echo
cat "$OUT/cpu_table.txt" 2>/dev/null
[[ -f $OUT/traffic.json ]] && awk '/^#### /{p=0} /^## measured DRAM traffic/{p=1} p' "$LOG"
exit $status

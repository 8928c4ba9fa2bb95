#!/usr/bin/env bash
# Builds the sm90 kernel's standalone binaries (no CMake needed):
#   src/cuda/hopper/build.sh OUTDIR [extra nvcc flags]
# -> OUTDIR/ioattn_sm90_check, OUTDIR/ioattn_test_ptx_sm90. Run from the repository root.
set -euo pipefail
out=$1; shift
NVCC=${NVCC:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
flags=(-gencode=arch=compute_90a,code=sm_90a -O3 -std=c++17 -I include -I src "$@")
link=(-Xcompiler -static-libstdc++ -Xcompiler -static-libgcc)
mkdir -p "$out"
pids=()
for f in flash_fwd_sm90 flash_fwd_sm90_hdim64 flash_fwd_sm90_hdim128 flash_fwd_sm90_hdim256 sm90_check; do
  "$NVCC" "${flags[@]}" -Xptxas -v -c src/cuda/hopper/$f.cu -o "$out/$f.o" > "$out/$f.ptxas.txt" 2>&1 &
  pids+=($!)
done
"$NVCC" "${flags[@]}" src/cuda/hopper/test_ptx_sm90.cu "${link[@]}" -o "$out/ioattn_test_ptx_sm90" &
pids+=($!)
rc=0
for p in "${pids[@]}"; do wait "$p" || rc=1; done
if [ $rc -ne 0 ]; then cat "$out"/*.ptxas.txt | grep -iE "error|warning" | head -40; exit 1; fi
"$NVCC" "${flags[@]}" "$out"/flash_fwd_sm90*.o "$out/sm90_check.o" "${link[@]}" -o "$out/ioattn_sm90_check"
grep -hE "C75|serializ|spill stores" "$out"/*.ptxas.txt | sort | uniq -c

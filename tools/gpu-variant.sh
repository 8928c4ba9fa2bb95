#!/usr/bin/env bash
# tools/gpu-variant.sh OUT_DIR "NVCC_FLAGS" SOURCE.cu [SOURCE.cu ...] — a compile-time variant of the
# CUDA binaries for an A/B in one device call, without a second build tree: recompiles the named
# library sources (paths relative to the repo) with extra nvcc flags (e.g. -DIOATTN_SM90_EARLY_Q=1),
# swaps those objects into a copy of build-cuda's libioattn.a and relinks ioattn_cuda_bench and
# test_cuda_kernels against it into OUT_DIR. build-cuda must be built (tools/gpu-configure.sh).
#
#   tools/gpu-variant.sh /tmp/earlyq "-DIOATTN_SM90_EARLY_Q=1" src/cuda/hopper/flash_fwd_sm90_hdim128.cu
#
# Environment: GPU_VARIANT_BUILD (default build-cuda), GPU_VARIANT_TARGETS (default "ioattn_cuda_bench
# test_cuda_kernels").
set -euo pipefail
OUTD=${1:?usage: tools/gpu-variant.sh OUT_DIR "NVCC_FLAGS" SOURCE.cu...}
FLAGS=${2:?usage: tools/gpu-variant.sh OUT_DIR "NVCC_FLAGS" SOURCE.cu...}
shift 2
cd "$(dirname "$0")/.."
BUILD=${GPU_VARIANT_BUILD:-build-cuda}
TARGETS=${GPU_VARIANT_TARGETS:-ioattn_cuda_bench test_cuda_kernels}
mkdir -p "$OUTD"
OUTD=$(cd "$OUTD" && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp "$BUILD/libioattn.a" "$work/libioattn.a"
for src in "$@"; do
  obj="CMakeFiles/ioattn.dir/$src.o"
  cmd=$(ninja -C "$BUILD" -t commands libioattn.a | grep -F -- "-o $obj" | grep -v '^:' | head -1 || true)
  [[ -n $cmd ]] || { echo "gpu-variant: no compile command for $src in $BUILD" >&2; exit 1; }
  # the same command with the extra flags, writing the object under the same file name in $work
  cmd=$(sed -E "s# -MD -MT [^ ]+ -MF [^ ]+##; s# -o $obj( |\$)# -o $work/$(basename "$obj")\1#" <<<"$cmd")
  (cd "$BUILD" && eval "${cmd/nvcc /nvcc $FLAGS }")
  ar r "$work/libioattn.a" "$work/$(basename "$obj")"
done
for t in $TARGETS; do
  link=$(ninja -C "$BUILD" -t commands "$t" | tail -1)
  link=${link// libioattn.a / $work/libioattn.a }
  link=${link/ -o $t / -o $OUTD/$(basename "$t") }
  (cd "$BUILD" && eval "$link")
done
echo "gpu-variant: $TARGETS with $FLAGS on $* -> $OUTD"

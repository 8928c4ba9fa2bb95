#!/usr/bin/env bash
# tools/gpu-pack.sh [TARGET...] — build the CUDA binaries on this machine (nvcc, no GPU needed) and
# pack them for the device: tools/gpu-check.sh with GPU_CHECK_PREBUILT=.gpubin/prebuilt.tar.xz then
# extracts them instead of building (saves the ~2-minute build of every device call).
#
#   tools/gpu-pack.sh                                   # the default targets below
#   tools/gpu-pack.sh test_cuda_serving ioattn_cuda_decode_bench
#   # then, through the device tool, carrying .deps and .gpubin (both git-ignored):
#   GPU_CHECK_PREBUILT=.gpubin/prebuilt.tar.xz GPU_CHECK_STAGES="build sm90cache" tools/gpu-check.sh $OUT
#
# Environment: GPU_PACK_BUILD (build folder, default build-cuda; configured by gpu-check.sh's cmake
# line if it has no build.ninja), GPU_CHECK_ARCHS (default 90a), GPU_PACK_OUT (default
# .gpubin/prebuilt.tar.xz). The tarball holds the binaries at their paths in the build folder and a
# PREBUILT file naming the commit they were built from (plus "+dirty" and the diff's hash when the
# tree had changes). Stages that run ctest or rebuild (ctest, python, interleave, bwdtrace, ...)
# still need a real build on the device; gpu-check.sh says so and skips ctest.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=${GPU_PACK_BUILD:-build-cuda}
OUTF=${GPU_PACK_OUT:-.gpubin/prebuilt.tar.xz}
ARCHS=${GPU_CHECK_ARCHS:-90a}
targets=("$@")
((${#targets[@]})) || targets=(test_cuda_kernels test_cuda_serving test_cuda_backward tests/ioattn_tests
  ioattn_cuda_bench ioattn_cuda_decode_bench)
# shellcheck source=tools/gpu-configure.sh
source "$ROOT/tools/gpu-configure.sh"
[[ -f $BUILD/build.ninja ]] || configure "$BUILD"
ninja -C "$BUILD" "${targets[@]}"
rev=$(git rev-parse --short HEAD)
if ! git diff --quiet HEAD; then rev="$rev+dirty $(git diff HEAD | sha1sum | cut -c1-12)"; fi
echo "$rev built $(date -u +%FT%TZ) on $(uname -n) for sm_$ARCHS" >"$BUILD/PREBUILT"
mkdir -p "$(dirname "$OUTF")"
# xz -9: its 64 MiB dictionary spans the binaries, which share most of their fat binaries (~6 MB
# for the six default targets instead of ~100 MB).
tar -C "$BUILD" -cf - PREBUILT "${targets[@]}" | xz -9 -T0 >"$OUTF"
echo "$OUTF: $(du -h "$OUTF" | cut -f1) ($(cat "$BUILD/PREBUILT"))"

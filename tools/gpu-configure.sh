# tools/gpu-configure.sh — sourced by gpu-check.sh and gpu-pack.sh: the one cmake line of a CUDA
# build (needs ROOT and ARCHS set). configure [DIR [CMAKE_ARGS...]]: DIR defaults to $BUILD.
configure() {
  local dir=${1:-$BUILD} PREFIX=()
  (($#)) && shift
  [[ -d $ROOT/.deps/usr ]] && PREFIX=(-DCMAKE_PREFIX_PATH="$ROOT/.deps/usr")
  cmake -S "$ROOT" -B "$dir" -G Ninja -DIOATTN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" \
    -DIOATTN_BUILD_TESTS=ON -DIOATTN_BUILD_BENCH=ON -DIOATTN_PTXAS_VERBOSE=ON -DIOATTN_BUILD_PYTHON=OFF "${PREFIX[@]}" "$@"
}

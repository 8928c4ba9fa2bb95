#!/usr/bin/env bash
# The CPU peer benchmark against llama.cpp's CPU flash attention (ggml_flash_attn_ext):
#   tools/peer-ggml.sh [BUILD_DIR] [-- ioattn_peer_ggml arguments]
# 1. fetches ggml as vendored by the llama-cpp-python sdist on PyPI (pinned below; pip is the only
#    registry the CI machines reach), builds it (static, CPU, -march=native, OpenMP) into .deps/ggml;
# 2. configures BUILD_DIR (default build-peer; a CPU-only build) with -DIOATTN_PEER_GGML=ON and
#    builds ioattn_peer_ggml;
# 3. runs it (JSON lines: ggml, ioattn f16, ioattn f32 per shape; see bench/peer_ggml.cpp).
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
BUILD=build-peer
if [ $# -gt 0 ] && [ "$1" != "--" ]; then
  BUILD=$1
  shift
fi
if [ "${1:-}" = "--" ]; then shift; fi
LLAMA_CPP_PYTHON=0.3.36  # vendors llama.cpp's ggml (ggml 0.25.3)
PREFIX=$ROOT/.deps/ggml
if [ ! -f "$PREFIX/lib/cmake/ggml/ggml-config.cmake" ]; then
  work=$(mktemp -d)
  python3 -m pip download -q --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$LLAMA_CPP_PYTHON"
  tar xzf "$work"/llama_cpp_python-$LLAMA_CPP_PYTHON.tar.gz -C "$work" \
    "llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp/ggml"
  src=$work/llama_cpp_python-$LLAMA_CPP_PYTHON/vendor/llama.cpp/ggml
  touch "$src/ggml.pc.in"  # (the sdist drops this pkg-config template; the install step wants it)
  cmake -S "$src" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
    -DGGML_BUILD_TESTS=OFF -DGGML_BUILD_EXAMPLES=OFF -DGGML_CCACHE=OFF -DCMAKE_INSTALL_PREFIX="$PREFIX" >/dev/null
  ninja -C "$work/build" install >/dev/null
  rm -rf "$work"
fi
[ -d .deps/usr ] || bash tools/fetch-deps.sh >/dev/null
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release -DIOATTN_CUDA=OFF -DIOATTN_PEER_GGML=ON \
  -DCMAKE_PREFIX_PATH="$ROOT/.deps/usr;$PREFIX" >/dev/null
ninja -C "$BUILD" ioattn_peer_ggml >/dev/null
OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive} "$BUILD/bench/ioattn_peer_ggml" "$@"

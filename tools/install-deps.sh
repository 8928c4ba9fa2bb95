#!/usr/bin/env bash
# Installs what building and testing ioattn needs on a fresh Debian/Ubuntu machine, and nothing
# when it is already there. Run as root (or with sudo available).
set -euo pipefail
need=()
[ -f /usr/include/hwy/highway.h ] || [ -f "$(dirname "$0")/../.deps/usr/include/hwy/highway.h" ] || need+=(libhwy-dev)
command -v cmake >/dev/null || need+=(cmake)
command -v ninja >/dev/null || need+=(ninja-build)
command -v g++ >/dev/null || need+=(g++)
[ -f /usr/include/gtest/gtest.h ] || [ -f "$(dirname "$0")/../.deps/usr/include/gtest/gtest.h" ] || need+=(libgtest-dev)
[ -f /usr/include/benchmark/benchmark.h ] || need+=(libbenchmark-dev)
python3 -c 'import venv, ensurepip' 2>/dev/null || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  echo "install-deps: installing ${need[*]}"
  SUDO=""
  [ "$(id -u)" -eq 0 ] || SUDO=sudo
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
fi

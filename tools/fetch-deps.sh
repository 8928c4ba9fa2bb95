#!/usr/bin/env bash
# Unpacks the Debian packages ioattn builds against (Highway, GoogleTest) into .deps/ so that a
# machine with no package registry (the lent GPU machine) can build the project: run this here,
# carry .deps with the call, and configure with -DCMAKE_PREFIX_PATH=$PWD/.deps/usr.
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p .deps/debs
cd .deps/debs
if ! ls libhwy-dev_*.deb >/dev/null 2>&1; then
  apt-get update -qq || true
  apt-get download libhwy-dev libhwy1 googletest libgtest-dev >/dev/null
fi
for f in *.deb; do dpkg -x "$f" ..; done
# Highway's CMake package names its libraries by absolute path under _IMPORT_PREFIX: fine.
echo "deps unpacked under $(cd .. && pwd)/usr"

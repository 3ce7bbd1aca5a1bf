#!/usr/bin/env bash
# compute/cuda's TestKernelsCompile compiles every embedded CUDA kernel with
# NVRTC for sm_80 and sm_90 on a machine without a GPU. Debian 12 ships
# NVRTC 11.8 in its non-free component: package libnvrtc11.2 (soname
# libnvrtc.so.11.2, about 16 MB, with libnvrtc-builtins11.8). This adds the
# component (a sources file of its own; the main one is left alone) and
# installs the package. The package's other tests run the backend on a CPU
# emulator of the GPU that they build with g++ (compute/cuda/testdata/emu),
# so g++ is installed too. Idempotent. scripts/test.sh sets
# DISTILL_REQUIRE_NVRTC=1, so a missing NVRTC or g++ fails those tests.
set -euo pipefail
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
if ! command -v g++ >/dev/null 2>&1; then
  echo "setup (nvrtc): apt-get install g++ (compute/cuda's GPU emulator)"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq g++ >/dev/null
fi
if dpkg -s libnvrtc11.2 >/dev/null 2>&1; then
  exit 0
fi
src=/etc/apt/sources.list.d/distill-nonfree.sources
if ! grep -rqs 'non-free\( \|$\)' /etc/apt/sources.list /etc/apt/sources.list.d/; then
  . /etc/os-release
  echo "setup (nvrtc): adding Debian's non-free component ($src)"
  $SUDO tee "$src" >/dev/null <<SRC
Types: deb
URIs: http://deb.debian.org/debian
Suites: ${VERSION_CODENAME:-bookworm} ${VERSION_CODENAME:-bookworm}-updates
Components: non-free
Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg
SRC
fi
echo "setup (nvrtc): apt-get install libnvrtc11.2 (NVRTC 11.8)"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq libnvrtc11.2 >/dev/null

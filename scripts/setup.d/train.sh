#!/usr/bin/env bash
# train/tbevent checks its TensorBoard event files with an independent
# Python reader (train/tbevent/testdata/read_events.py, stdlib only).
set -euo pipefail
if ! command -v python3 >/dev/null 2>&1; then
  SUDO=""
  [ "$(id -u)" -ne 0 ] && SUDO="sudo"
  echo "setup (train): apt-get install python3"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3 >/dev/null
fi

#!/usr/bin/env bash
# Installs what data/chattmpl's tests need: Debian's python3 with jinja2
# (package python3-jinja2), the reference renderer that testdata/jinja_ref.py
# runs to check chat-template output byte-for-byte. Idempotent.
set -euo pipefail
if /usr/bin/python3 -c 'import jinja2' >/dev/null 2>&1; then
  exit 0
fi
SUDO=""
[ "$(id -u)" -ne 0 ] && SUDO="sudo"
echo "setup: apt-get install python3-jinja2"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq python3 python3-jinja2 >/dev/null

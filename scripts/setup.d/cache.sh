#!/usr/bin/env bash
# Installs what cache's pyarrow-compatibility test needs into
# testdata-fetched/npm-arrow (git-ignored): Apache Arrow's own JavaScript
# implementation (apache-arrow, independent of the Go one that writes the
# chunks) and a pure-JS zstd decoder (fzstd) registered as its codec, so
# that the test reads chunk files with a second Arrow implementation and
# applies the decode formulas of the cache package doc. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=testdata-fetched/npm-arrow
pkgs=(apache-arrow@21.2.0 fzstd@0.1.1)
if grep -q '"version": "21.2.0"' "$dest/node_modules/apache-arrow/package.json" 2>/dev/null &&
  grep -q '"version": "0.1.1"' "$dest/node_modules/fzstd/package.json" 2>/dev/null; then
  exit 0
fi
mkdir -p "$dest"
[ -f "$dest/package.json" ] || echo '{"name":"distill-testdata-npm-arrow","private":true}' >"$dest/package.json"
echo "setup: npm install ${pkgs[*]} into $dest"
npm install --prefix "$dest" --no-audit --no-fund --loglevel=error "${pkgs[@]}" >/dev/null

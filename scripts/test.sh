#!/usr/bin/env bash
# The test command of the README: installs the test prerequisites, then runs
# gofmt, go vet, the whole test suite, and the concurrent packages again
# under -race.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-test.sh
bad=$(gofmt -l $(git ls-files '*.go' | grep -v '\.pb\.go$') 2>/dev/null || true)
if [ -n "$bad" ]; then echo "gofmt would change:"; echo "$bad"; exit 1; fi
go vet ./...
# API: buf lint, and the committed generated code matches the .proto files
# (buf and the plugins come from scripts/setup.d/buf.sh).
PATH="$(go env GOPATH)/bin:$PATH"
buf lint
gen=$(mktemp -d); trap 'rm -rf "$gen"' EXIT
buf generate --template buf.gen.yaml -o "$gen"
diff -r "$gen/proto" proto --exclude='*.proto' || { echo "generated code is stale: run buf generate"; exit 1; }
# compute/cuda's kernels must compile with NVRTC (scripts/setup.d/nvrtc.sh
# installs it): fail, do not skip, when it is missing.
export DISTILL_REQUIRE_NVRTC=1
go test -count=1 -timeout 40m ./... "$@"
# The packages that run goroutines (the batcher and fills, the CPU worker
# pools and every kernel on them, the decoder, the cache's writers and readers,
# dataset loading) once more under the race detector: about 3 minutes on
# 2 busy cores. cmd/cachectl repeats serve's fills in-process and is left out
# (a minute more under -race).
go test -race -count=1 -timeout 30m ./serve/ ./cache/ ./compute/cpu/ ./infer/ ./data/ \
  ./model/decoder/ ./train/ ./train/loss/ ./train/optim/ ./train/trainer/ "$@"

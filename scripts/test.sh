#!/usr/bin/env bash
# The test command of the README: installs the test prerequisites, then runs
# gofmt, go vet and the whole test suite.
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

#!/usr/bin/env bash
# The test command of the README: installs the test prerequisites, then runs
# gofmt, go vet and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup-test.sh
bad=$(gofmt -l $(git ls-files '*.go' | grep -v '\.pb\.go$') 2>/dev/null || true)
if [ -n "$bad" ]; then echo "gofmt would change:"; echo "$bad"; exit 1; fi
go vet ./...
go test -count=1 -timeout 40m ./... "$@"

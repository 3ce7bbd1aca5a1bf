#!/usr/bin/env bash
# Installs buf and the protoc plugins at pinned versions with go install
# (into $(go env GOPATH)/bin; the Go build cache makes re-runs fast), for
# `buf lint` and the generated-code check in scripts/test.sh. Plugins are
# local (buf.gen.yaml): no network to the Buf Schema Registry is needed.
# Idempotent: does nothing when the pinned versions are installed.
set -euo pipefail
bin="$(go env GOPATH)/bin"
BUF=v1.75.0
GEN_GO=v1.36.12     # google.golang.org/protobuf, as in go.mod
GEN_GRPC=v1.6.2     # google.golang.org/grpc/cmd/protoc-gen-go-grpc
have() { [ -x "$bin/$1" ] && "$bin/$1" --version 2>&1 | grep -q -- "${2#v}"; }
have buf "$BUF" || { echo "setup: go install buf@$BUF"; go install "github.com/bufbuild/buf/cmd/buf@$BUF"; }
have protoc-gen-go "$GEN_GO" || go install "google.golang.org/protobuf/cmd/protoc-gen-go@$GEN_GO"
have protoc-gen-go-grpc "$GEN_GRPC" || go install "google.golang.org/grpc/cmd/protoc-gen-go-grpc@$GEN_GRPC"

//go:build tools

// Package deps pins the card's dependencies in go.mod until the packages
// that use them land; `go mod tidy` keeps modules imported under any build tag.
package deps

import (
	_ "github.com/apache/arrow/go/v17/arrow/ipc"
	_ "github.com/apache/arrow/go/v17/parquet/pqarrow"
	_ "github.com/dgraph-io/badger/v4"
	_ "go.uber.org/zap"
	_ "google.golang.org/grpc"
	_ "google.golang.org/grpc/health"
	_ "google.golang.org/grpc/reflection"
	_ "google.golang.org/protobuf/proto"
	_ "gopkg.in/yaml.v3"
)

package serve

import (
	"context"
	"errors"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"distill/cache"
	"distill/data"
	"distill/infer"
)

// Sentinel errors of the daemon core. Every error the core returns wraps
// one of them (or one of packages infer, cache, data) with %w and a message
// that names the sample, range, field or file involved; toStatus maps them
// to gRPC codes.
var (
	// ErrInvalid marks a request that can never succeed as given: a bad
	// token id, an empty or over-long sample, k out of range, bad options.
	ErrInvalid = errors.New("serve: invalid request")
	// ErrOutOfRange marks a sample range outside the dataset.
	ErrOutOfRange = errors.New("serve: range out of dataset")
	// ErrNotFound marks a dataset file that does not exist on the daemon.
	ErrNotFound = errors.New("serve: not found")
	// ErrPrecondition marks a request the daemon cannot serve in its
	// current state: no cache directory, a cache holding another dataset or
	// teacher, no tokenizer for a text dataset, a dataset fingerprint other
	// than the client expects, a dropped sample the cache cannot hold.
	ErrPrecondition = errors.New("serve: failed precondition")
	// ErrOverloaded is returned when the work queue is full; the client
	// should retry later (backpressure, never unbounded memory).
	ErrOverloaded = errors.New("serve: overloaded")
	// ErrShutdown is returned for work submitted or pending while the
	// daemon shuts down.
	ErrShutdown = errors.New("serve: shutting down")
)

// toStatus maps a core error to a gRPC status error: errors.Is picks the
// code, the message is the error's text; context errors pass through as
// Canceled / DeadlineExceeded; anything unknown is logged and becomes
// Internal, so no internal detail is mistaken for a user error.
func toStatus(log *zap.Logger, err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err // already a status (validators)
	}
	code := codes.Unknown
	switch {
	case errors.Is(err, context.Canceled):
		code = codes.Canceled
	case errors.Is(err, context.DeadlineExceeded):
		code = codes.DeadlineExceeded
	case errors.Is(err, ErrInvalid), errors.Is(err, infer.ErrInput),
		errors.Is(err, data.ErrBadRecord), errors.Is(err, data.ErrTemplate),
		errors.Is(err, data.ErrOptions), errors.Is(err, data.ErrSource),
		errors.Is(err, cache.ErrInvalid):
		code = codes.InvalidArgument
	case errors.Is(err, ErrOutOfRange):
		code = codes.OutOfRange
	case errors.Is(err, ErrNotFound):
		code = codes.NotFound
	case errors.Is(err, ErrPrecondition), errors.Is(err, cache.ErrManifestMismatch),
		errors.Is(err, cache.ErrCorrupt), errors.Is(err, cache.ErrNotCache):
		code = codes.FailedPrecondition
	case errors.Is(err, ErrOverloaded):
		code = codes.ResourceExhausted
	case errors.Is(err, ErrShutdown), errors.Is(err, cache.ErrLocked):
		code = codes.Unavailable
	default:
		log.Error("internal error", zap.Error(err))
		return status.Error(codes.Internal, "internal error (see the daemon log): "+err.Error())
	}
	return status.Error(code, err.Error())
}

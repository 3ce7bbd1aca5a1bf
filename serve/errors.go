package serve

import (
	"context"
	"errors"
	"strings"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"distill/cache"
	"distill/data"
	"distill/infer"
	"distill/internal/errkind"
)

// Sentinel errors of the daemon core. Every error the core returns wraps
// one of them (or one of packages infer, cache, data) with a message that
// names the sample, range, field or file involved; toStatus maps them to
// gRPC codes. The gRPC code says what ErrInvalid, ErrPrecondition,
// ErrNotFound and ErrOutOfRange would, so their text is in the chain only
// (errkind), not in front of the message a user reads; ErrOverloaded's
// and ErrShutdown's say why the work was refused, and are kept.
var (
	// ErrInvalid marks a request that can never succeed as given: a bad
	// token id, an empty or over-long sample, k out of range, bad options.
	ErrInvalid = errors.New("serve: invalid request")
	// ErrConfig marks the daemon's (or an in-process teacher's) own
	// configuration as unusable: flags, config file, model, token or TLS
	// files. It is an ErrInvalid too (errors.Is). Its text is not in the
	// messages of the errors it marks (configErrorf): they are read at
	// startup, each one sentence naming the flag and the fix.
	ErrConfig error = configError{}
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

// code picks the gRPC code of a core error with errors.Is; Internal
// for anything unknown (a bug, an I/O failure).
func code(err error) codes.Code {
	switch {
	case errors.Is(err, context.Canceled):
		return codes.Canceled
	case errors.Is(err, context.DeadlineExceeded):
		return codes.DeadlineExceeded
	case errors.Is(err, ErrInvalid), errors.Is(err, infer.ErrInput),
		errors.Is(err, data.ErrBadRecord), errors.Is(err, data.ErrTemplate),
		errors.Is(err, data.ErrOptions), errors.Is(err, data.ErrSource),
		errors.Is(err, cache.ErrInvalid):
		return codes.InvalidArgument
	case errors.Is(err, ErrOutOfRange):
		return codes.OutOfRange
	case errors.Is(err, ErrNotFound):
		return codes.NotFound
	case errors.Is(err, ErrPrecondition), errors.Is(err, cache.ErrManifestMismatch),
		errors.Is(err, cache.ErrCorrupt), errors.Is(err, cache.ErrNotCache), errors.Is(err, cache.ErrIndexLost):
		return codes.FailedPrecondition
	case errors.Is(err, ErrOverloaded):
		return codes.ResourceExhausted
	case errors.Is(err, ErrShutdown), errors.Is(err, cache.ErrLocked):
		return codes.Unavailable
	case errors.Is(err, cache.ErrRangeBusy):
		return codes.Aborted // another writer's claim: retry later
	}
	return codes.Internal
}

// toStatus maps a core error to a gRPC status error for the in-process
// teacher (cachectl fill --model): the user's own process, so the message
// is the error's full text, internal errors included. Errors for remote
// clients go through clientStatus instead.
func toStatus(log *zap.Logger, err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err // already a status (validators)
	}
	c := code(err)
	if c == codes.Internal {
		log.Error("internal error", zap.Error(err))
		return status.Error(codes.Internal, "internal error: "+err.Error())
	}
	return status.Error(c, err.Error())
}

// clientStatus maps a core error to the status a remote client gets. The
// code is toStatus's; the message leaks neither internals nor file
// content:
//   - an internal error (a bug, an I/O failure: its text may hold paths,
//     values, stack traces) is logged with the request id, and the client
//     gets a generic message carrying that id;
//   - a bad record keeps its location, field and reason, but its detail
//     (which quotes the record: field names, CSV header cells, values) is
//     only logged;
//   - a dataset file that cannot be opened or indexed, or a chat template
//     that cannot be used, is named by category only: the message of
//     package data can quote the file (a CSV header, Parquet columns).
func clientStatus(log *zap.Logger, id string, err error) error {
	if err == nil {
		return nil
	}
	if _, ok := status.FromError(err); ok {
		return err // validators and the data-root check: written for clients
	}
	c := code(err)
	var re *data.RecordError
	switch {
	case c == codes.Internal:
		log.Error("internal error", zap.String("request_id", id), zap.Error(err))
		return status.Errorf(codes.Internal, "internal error (request id %s): the daemon's log has the detail under that id", id)
	case errors.As(err, &re):
		log.Info("bad record", zap.String("request_id", id), zap.Error(err))
		short := re.Loc + ": "
		if re.Field != "" {
			short += re.Field + ": "
		}
		short += re.Reason + " (the detail can quote the file, so only the daemon's log has it, under request id " + id +
			"; `cachectl tokenize --data FILE` on the same file shows it)"
		msg := strings.Replace(err.Error(), re.Error(), short, 1)
		if msg == err.Error() {
			msg = short
		}
		return status.Error(c, msg)
	case errors.Is(err, data.ErrSource), errors.Is(err, data.ErrTemplate):
		what := "a dataset source cannot be opened or indexed: check the path, the format (jsonl, csv or parquet; from the extension unless given) and that the file is not compressed"
		if errors.Is(err, data.ErrTemplate) {
			what = "the chat template cannot be used (the request's chat_template, or the tokenizer's)"
		}
		log.Info("dataset refused", zap.String("request_id", id), zap.Error(err))
		return status.Errorf(c, "%s (request id %s: the detail can quote the file, so only the daemon's log has it; `cachectl tokenize --data FILE` on the same file shows it)", what, id)
	}
	return status.Error(c, err.Error())
}

// configErrorf is an ErrConfig error whose message is the format's alone,
// without ErrConfig's "serve: bad configuration" in front of it.
func configErrorf(format string, a ...any) error { return errkind.Errorf(ErrConfig, format, a...) }

type configError struct{}

func (configError) Error() string        { return "serve: bad configuration" }
func (configError) Is(target error) bool { return target == ErrInvalid }

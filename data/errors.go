package data

import (
	"errors"
	"fmt"
)

// Sentinel errors. Every error returned by this package wraps one of them, so
// callers can tell a bad record (skippable with Options.SkipBad) from a bad
// setup (never skippable).
var (
	// ErrBadRecord marks a record that cannot become a sample: malformed
	// JSON/CSV, a missing or mistyped field, an unknown role, an empty
	// conversation, invalid UTF-8, token ids outside the vocabulary.
	ErrBadRecord = errors.New("data: bad record")
	// ErrTemplate marks a chat template that cannot be used for
	// completion-only masks: it fails to render, or it re-renders earlier
	// turns differently when later turns are added (prefix property).
	ErrTemplate = errors.New("data: chat template")
	// ErrSource marks a data source that cannot be opened or indexed: a
	// missing file, an unknown format, a CSV without a header, bad weights.
	ErrSource = errors.New("data: source")
	// ErrOptions marks invalid Options or an invalid Range request.
	ErrOptions = errors.New("data: options")
)

// RecordError is a bad record, located precisely. It wraps ErrBadRecord or
// ErrTemplate (errors.Is works with either).
type RecordError struct {
	Loc    string // "file:line" (JSONL, CSV) or "file:row N" (Parquet)
	Field  string // the offending field path, e.g. "messages[2].role"; may be empty
	Reason string // short fixed category used to count skips, e.g. "unknown role"
	Detail string // what was found and how to fix it
	Err    error  // ErrBadRecord or ErrTemplate
}

func (e *RecordError) Error() string {
	s := e.Loc + ": "
	if e.Field != "" {
		s += e.Field + ": "
	}
	s += e.Reason
	if e.Detail != "" {
		s += ": " + e.Detail
	}
	return s
}

func (e *RecordError) Unwrap() error { return e.Err }

// badf builds a RecordError for a bad record. The location is filled in by
// the caller that knows it (see locate).
func badf(field, reason, format string, args ...any) *RecordError {
	return &RecordError{Field: field, Reason: reason, Detail: fmt.Sprintf(format, args...), Err: ErrBadRecord}
}

// tmplf builds a RecordError for a template problem.
func tmplf(reason, format string, args ...any) *RecordError {
	return &RecordError{Reason: reason, Detail: fmt.Sprintf(format, args...), Err: ErrTemplate}
}

// withLoc sets the location of a RecordError, or wraps any other error with
// it, so every per-record error names file and line.
func withLoc(err error, loc string) error {
	if err == nil {
		return nil
	}
	var re *RecordError
	if errors.As(err, &re) {
		if re.Loc == "" {
			re.Loc = loc
		}
		return re
	}
	return fmt.Errorf("%s: %w", loc, err)
}

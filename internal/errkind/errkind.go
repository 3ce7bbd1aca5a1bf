// Package errkind makes errors that errors.Is and errors.As match against
// a sentinel, their kind, without the sentinel's text in their message.
//
// fmt.Errorf("%w: ...", ErrX, ...) writes the sentinel's text, a package
// prefix such as "serve: bad configuration", in front of the message, and
// an error wrapped so by each package it passes reads as a stack of them:
// "serve: bad configuration: device: unavailable: --devices: GPU 1: cuda:
// device 1 does not exist ...". An error a person reads is one sentence
// that names what is wrong (the flag, the file) and how to fix it; its
// kind is for the code that handles it.
package errkind

import "fmt"

// Errorf is fmt.Errorf(format, a...) (%w included) with kind in its chain
// too: errors.Is(err, kind) holds, and the message is the format's alone.
func Errorf(kind error, format string, a ...any) error {
	return Wrap(kind, fmt.Errorf(format, a...))
}

// Wrap is err with kind added to its chain, err's message unchanged; nil
// for a nil err.
func Wrap(kind, err error) error {
	if err == nil {
		return nil
	}
	return &kindError{kind: kind, err: err, msg: err.Error()}
}

// Reword is an error whose message is format's (which says what cause
// means in the caller's terms, without repeating all of its text), with
// kind and cause in its chain: errors.Is and errors.As see both.
func Reword(kind, cause error, format string, a ...any) error {
	return &kindError{kind: kind, err: cause, msg: fmt.Sprintf(format, a...)}
}

type kindError struct {
	kind, err error
	msg       string
}

func (e *kindError) Error() string   { return e.msg }
func (e *kindError) Unwrap() []error { return []error{e.kind, e.err} }

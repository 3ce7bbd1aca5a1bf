package errkind

import (
	"errors"
	"io/fs"
	"os"
	"testing"
)

var errKind = errors.New("pkg: a kind")

func TestKind(t *testing.T) {
	_, perr := os.Open("/no/such/file")
	err := Errorf(errKind, "--file %s: %w", "/no/such/file", perr)
	if err.Error() != "--file /no/such/file: "+perr.Error() {
		t.Errorf("message %q", err)
	}
	var pe *fs.PathError
	if !errors.Is(err, errKind) || !errors.Is(err, fs.ErrNotExist) || !errors.As(err, &pe) {
		t.Errorf("the chain lost the kind or the wrapped error: %v", err)
	}
	if Wrap(errKind, nil) != nil {
		t.Error("Wrap(kind, nil) is not nil")
	}
	if w := Wrap(errKind, perr); w.Error() != perr.Error() || !errors.Is(w, errKind) || !errors.Is(w, fs.ErrNotExist) {
		t.Errorf("Wrap: %v", w)
	}
}

func TestReword(t *testing.T) {
	_, perr := os.Open("/no/such/file")
	err := Reword(errKind, perr, "--file: there is no such file")
	var pe *fs.PathError
	if err.Error() != "--file: there is no such file" || !errors.Is(err, errKind) || !errors.As(err, &pe) {
		t.Errorf("Reword: %v", err)
	}
}

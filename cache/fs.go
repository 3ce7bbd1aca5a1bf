package cache

import (
	"io"
	"os"

	"distill/internal/atomicfile"
)

// FS is the file-system surface the cache uses for chunk files and their
// directories. It is small on purpose so that tests can wrap it and fail the
// i-th operation (see the errorfs style of pebble). The Badger index and the
// lock files use the operating system directly.
type FS interface {
	// Create creates name exclusively (it must not exist) for writing.
	Create(name string) (File, error)
	// ReadFile returns the whole content of name.
	ReadFile(name string) ([]byte, error)
	// Stat returns the size of name.
	Stat(name string) (int64, error)
	// Rename atomically replaces newname by oldname.
	Rename(oldname, newname string) error
	// Remove removes a file or an empty directory.
	Remove(name string) error
	// RemoveAll removes a directory tree.
	RemoveAll(name string) error
	// MkdirAll creates a directory and its parents.
	MkdirAll(dir string) error
	// ReadDir lists the names in dir.
	ReadDir(dir string) ([]string, error)
	// SyncDir makes the directory entries of dir durable (renames, creates).
	SyncDir(dir string) error
}

// File is a file open for writing.
type File interface {
	io.Writer
	// Sync makes the written data durable.
	Sync() error
	// Close closes the file.
	Close() error
}

// OSFS is the FS of the operating system.
var OSFS FS = osFS{}

type osFS struct{}

func (osFS) Create(name string) (File, error) {
	return os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o644)
}

func (osFS) ReadFile(name string) ([]byte, error) { return os.ReadFile(name) }

func (osFS) Stat(name string) (int64, error) {
	st, err := os.Stat(name)
	if err != nil {
		return 0, err
	}
	return st.Size(), nil
}

func (osFS) Rename(o, n string) error    { return os.Rename(o, n) }
func (osFS) Remove(name string) error    { return os.Remove(name) }
func (osFS) RemoveAll(name string) error { return os.RemoveAll(name) }
func (osFS) MkdirAll(dir string) error   { return os.MkdirAll(dir, 0o755) }
func (osFS) SyncDir(dir string) error    { return atomicfile.Sync(dir) }

func (osFS) ReadDir(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(ents))
	for i, e := range ents {
		names[i] = e.Name()
	}
	return names, nil
}

// Package atomicfile replaces a file so that a crash at any instant leaves
// either its old content or its new content, never a torn or missing file.
//
// The sequence is the usual one: create a temporary file in the target's
// directory (a rename is atomic only within one file system), write it,
// fsync it, close it, rename it over the target, and fsync the directory so
// that the rename itself is durable. On any error the temporary file is
// removed and the target is left as it was.
package atomicfile

import (
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
)

// TempSuffix ends the name of every temporary file this package creates
// (name.<random>.tmp, next to the target), so that leftovers of a crash are
// recognizable.
const TempSuffix = ".tmp"

// Sync fsyncs the file or directory at path: for a directory, that makes
// its entries (a rename, a new file) durable.
func Sync(path string) error {
	f, err := os.Open(path)
	if err != nil {
		return err
	}
	err = f.Sync()
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	return err
}

// syncDir makes the entries of dir durable; a variable so that tests can
// check it is called and can fail it.
var syncDir = Sync

// WriteFile atomically replaces path with data. perm is the mode of a new
// file before the umask (0o644 is usual).
func WriteFile(path string, data []byte, perm fs.FileMode) error {
	return Write(path, perm, func(w io.Writer) error {
		_, err := w.Write(data)
		return err
	})
}

// Write atomically replaces path with what write writes to w, the
// unbuffered temporary file (wrap it in a bufio.Writer, and flush it, for
// many small writes). When write or any later step fails, the temporary
// file is removed, path is untouched, and the error names path.
func Write(path string, perm fs.FileMode, write func(w io.Writer) error) error {
	dir, base := filepath.Split(path)
	if dir == "" {
		dir = "."
	}
	f, tmp, err := createTemp(dir, base, perm)
	if err != nil {
		// The temporary file's name means nothing to the user; the
		// directory it could not be made in does.
		var pe *fs.PathError
		if errors.As(err, &pe) {
			return fmt.Errorf("writing %s: cannot create a file in %s: %w", path, filepath.Clean(dir), pe.Err)
		}
		return fmt.Errorf("writing %s: %w", path, err)
	}
	err = write(f)
	if err == nil {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		os.Remove(tmp)
		return fmt.Errorf("writing %s: %w", path, err)
	}
	if err := syncDir(dir); err != nil {
		// The new content is in place; only its durability across a
		// power loss is in doubt. Report it: the caller may retry.
		return fmt.Errorf("writing %s: syncing directory %s after the rename: %w", path, dir, err)
	}
	return nil
}

// createTemp creates a new file base.<random>.tmp in dir with perm (before
// the umask), exclusively, so that two writers of one path never share a
// temporary file.
func createTemp(dir, base string, perm fs.FileMode) (*os.File, string, error) {
	for try := 0; ; try++ {
		var r [6]byte
		rand.Read(r[:])
		name := filepath.Join(dir, base+"."+hex.EncodeToString(r[:])+TempSuffix)
		f, err := os.OpenFile(name, os.O_WRONLY|os.O_CREATE|os.O_EXCL, perm)
		if err == nil {
			return f, name, nil
		}
		if !errors.Is(err, fs.ErrExist) || try == 10 {
			return nil, "", err
		}
	}
}

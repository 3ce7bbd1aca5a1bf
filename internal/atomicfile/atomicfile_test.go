package atomicfile

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
)

func names(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

// TestFailedWriteLeavesNoPartialFile: a write that fails half-way leaves
// the old file intact (or no file when there was none) and no temporary
// file behind.
func TestFailedWriteLeavesNoPartialFile(t *testing.T) {
	dir := t.TempDir()
	old := filepath.Join(dir, "old.json")
	if err := os.WriteFile(old, []byte("old content"), 0o644); err != nil {
		t.Fatal(err)
	}
	boom := errors.New("disk full")
	for _, path := range []string{old, filepath.Join(dir, "new.json")} {
		err := Write(path, 0o644, func(w io.Writer) error {
			if _, err := w.Write([]byte("half of the new con")); err != nil {
				return err
			}
			return boom
		})
		if !errors.Is(err, boom) || !bytes.Contains([]byte(err.Error()), []byte(path)) {
			t.Fatalf("Write(%s) = %v, want the write's error naming the path", path, err)
		}
	}
	if got, _ := os.ReadFile(old); string(got) != "old content" {
		t.Fatalf("old file after a failed write: %q", got)
	}
	if got := names(t, dir); !slices.Equal(got, []string{"old.json"}) {
		t.Fatalf("directory after failed writes: %q, want only old.json", got)
	}
}

// TestWriteReplacesAndSyncsDir: a successful write replaces the file, and
// the directory is fsynced after the rename (the step writeFileAtomic and
// WriteSafetensors used to skip); a failing directory sync is reported.
func TestWriteReplacesAndSyncsDir(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "config.json")
	os.WriteFile(path, []byte("v1"), 0o644)
	var synced []string
	orig := syncDir
	defer func() { syncDir = orig }()
	syncDir = func(d string) error {
		got, _ := os.ReadFile(path)
		synced = append(synced, filepath.Clean(d)+" sees "+string(got))
		return orig(d)
	}
	if err := WriteFile(path, []byte("v2"), 0o644); err != nil {
		t.Fatal(err)
	}
	if want := []string{filepath.Clean(dir) + " sees v2"}; !slices.Equal(synced, want) {
		t.Fatalf("directory syncs %q, want %q (after the rename)", synced, want)
	}
	if got := names(t, dir); !slices.Equal(got, []string{"config.json"}) {
		t.Fatalf("directory after a write: %q", got)
	}
	boom := errors.New("EIO")
	syncDir = func(string) error { return boom }
	if err := WriteFile(path, []byte("v3"), 0o644); !errors.Is(err, boom) {
		t.Fatalf("a failing directory sync: %v, want it reported", err)
	}
}

// TestWriteFileModeRespectsUmask: a new file gets perm minus the umask (not
// the 0600 of os.CreateTemp), so other users can read what we write.
func TestWriteFileModeRespectsUmask(t *testing.T) {
	old := syscall.Umask(0o022)
	defer syscall.Umask(old)
	path := filepath.Join(t.TempDir(), "model.safetensors")
	if err := WriteFile(path, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if fi.Mode().Perm() != 0o644 {
		t.Fatalf("mode %v, want -rw-r--r--", fi.Mode().Perm())
	}
}

// TestCreateErrorNamesDirectory: a file that cannot be created names the
// directory it was to be made in, not the temporary file ("open
// DIR/c.png.1a2b3c.tmp: no such file or directory").
func TestCreateErrorNamesDirectory(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "missing")
	err := Write(filepath.Join(dir, "f"), 0o644, func(io.Writer) error { return nil })
	if want := "writing " + filepath.Join(dir, "f") + ": cannot create a file in " + dir + ": no such file or directory"; err == nil || err.Error() != want {
		t.Errorf("%v, want %q", err, want)
	}
}

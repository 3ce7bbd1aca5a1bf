package model

import (
	"errors"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"
)

func names(t *testing.T, dir string) string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	sort.Strings(out)
	return strings.Join(out, " ")
}

// TestWriteDir: a new or empty directory is written; a non-empty one is
// refused without force and replaced whole with it (no old file left); a
// failed write leaves the old directory as it was; no temporary sibling
// is left behind.
func TestWriteDir(t *testing.T) {
	parent := t.TempDir()
	dir := filepath.Join(parent, "out")
	put := func(files ...string) func(string) error {
		return func(tmp string) error {
			for _, f := range files {
				if err := os.WriteFile(filepath.Join(tmp, f), []byte(f), 0o644); err != nil {
					return err
				}
			}
			return nil
		}
	}
	if err := WriteDir(dir, false, put("a", "b")); err != nil {
		t.Fatal(err)
	}
	if got := names(t, dir); got != "a b" {
		t.Fatalf("new dir holds %q", got)
	}
	err := WriteDir(dir, false, put("c"))
	if !errors.Is(err, ErrNotEmpty) || !strings.Contains(err.Error(), "a, b") || !strings.Contains(err.Error(), "--force") {
		t.Fatalf("non-empty dir without force: %v", err)
	}
	if err := WriteDir(dir, true, func(tmp string) error {
		put("c")(tmp)
		return errors.New("disk full")
	}); err == nil || !strings.Contains(err.Error(), "disk full") {
		t.Fatalf("failed write: %v", err)
	}
	if got := names(t, dir); got != "a b" {
		t.Fatalf("a failed write changed the old dir: %q", got)
	}
	if err := WriteDir(dir, true, put("c")); err != nil {
		t.Fatal(err)
	}
	if got := names(t, dir); got != "c" {
		t.Fatalf("forced replace holds %q, want only the new file", got)
	}
	if got := names(t, parent); got != "out" {
		t.Fatalf("leftovers beside the output: %q", got)
	}
	empty := filepath.Join(parent, "empty")
	os.Mkdir(empty, 0o755)
	if err := WriteDir(empty, false, put("x")); err != nil {
		t.Fatalf("an empty existing dir: %v", err)
	}
	file := filepath.Join(parent, "file")
	os.WriteFile(file, nil, 0o644)
	if err := WriteDir(file, true, put("x")); err == nil || !strings.Contains(err.Error(), "not a directory") {
		t.Fatalf("a file as the output: %v", err)
	}
}

package model

import (
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"distill/internal/testdirs"
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

// TestWriteDirUnwritable: an output WriteDir cannot write is refused
// before write runs, naming the output and the directory or file at
// fault, not the temporary directory beside it ("mkdir
// /ro/.tmp-out-123: read-only file system") or only "stat
// file/out: not a directory".
func TestWriteDirUnwritable(t *testing.T) {
	ro := testdirs.Unwritable(t)
	file := filepath.Join(t.TempDir(), "file")
	os.WriteFile(file, nil, 0o644)
	for _, c := range []struct{ dir, want string }{
		{filepath.Join(ro, "out"), "model: cannot write " + filepath.Join(ro, "out") + ": cannot create files in " + ro + " ("},
		{filepath.Join(ro, "a", "b", "out"), "cannot create files in " + ro + " ("},
		{filepath.Join(file, "out"), "model: cannot write " + filepath.Join(file, "out") + ": " + file + " is a file, not a directory"},
		{filepath.Join(file, "a", "out"), ": " + file + " is a file, not a directory"},
	} {
		ran := false
		err := WriteDir(c.dir, false, func(string) error { ran = true; return nil })
		if err == nil || !strings.Contains(err.Error(), c.want) || strings.Contains(err.Error(), ".tmp-") || ran {
			t.Errorf("%s: %v (write ran: %v), want %q", c.dir, err, ran, c.want)
		}
	}
}

// TestCheckpointTorchDType: config.json's torch_dtype is the weights'
// dtype; an F32 checkpoint (student export --format f32) said bfloat16,
// so that transformers' torch_dtype="auto" rounded the exact weights.
func TestCheckpointTorchDType(t *testing.T) {
	cfg, err := Preset(ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	w := Init(cfg, InitOptions{Seed: 1})
	for dtype, want := range map[string]string{"BF16": "bfloat16", "F32": "float32"} {
		dir := filepath.Join(t.TempDir(), dtype)
		if err := WriteCheckpoint(dir, cfg, w, dtype); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(filepath.Join(dir, "config.json"))
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(b, &m); err != nil {
			t.Fatal(err)
		}
		if m["torch_dtype"] != want {
			t.Errorf("%s checkpoint: torch_dtype %v, want %s", dtype, m["torch_dtype"], want)
		}
		if _, err := LoadConfig(dir); err != nil {
			t.Errorf("%s checkpoint's config.json does not load: %v", dtype, err)
		}
	}
}

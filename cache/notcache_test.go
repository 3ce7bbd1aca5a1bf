package cache

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestNotCacheMessages: every entry point that needs an existing cache
// (OpenReader, Check, Open, Repair, Reset) says alike what a path that
// is no cache is: missing, a file, or a directory with no index. Repair
// and Reset printed the bare stat error ("stat DIR/index: no such file or
// directory"), and all of them "stat FILE/index: not a directory" for a
// file.
func TestNotCacheMessages(t *testing.T) {
	dir := t.TempDir()
	file := filepath.Join(dir, "x.txt")
	os.WriteFile(file, []byte("hi"), 0o644)
	empty := filepath.Join(dir, "empty")
	os.Mkdir(empty, 0o755)
	missing := filepath.Join(dir, "nope")
	open := map[string]func(string) error{
		"OpenReader": func(d string) error { _, err := OpenReader(d); return err },
		"Check":      func(d string) error { _, err := Check(d, nil); return err },
		"Open":       func(d string) error { _, err := Open(d, nil); return err },
		"Repair":     func(d string) error { _, err := Repair(d, nil); return err },
		"Reset":      func(d string) error { _, err := Reset(d, true, nil); return err },
	}
	for name, f := range open {
		for path, want := range map[string]string{
			missing: missing + " does not exist",
			file:    file + " is a file, not a cache directory",
			empty:   empty + " has no index/",
		} {
			err := f(path)
			if !errors.Is(err, ErrNotCache) || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "stat ") {
				t.Errorf("%s(%s): %v; want ErrNotCache saying %q", name, path, err, want)
			}
		}
	}
	if _, err := os.Stat(filepath.Join(empty, "index")); !os.IsNotExist(err) {
		t.Errorf("a refused open made %s/index", empty)
	}
}

// TestGetOutsideOrMissing: Get of an index no fill can ever commit says
// the cache's range; of one not filled yet, that it is not filled yet.
// Both said "sample not in cache: sample 120 (committed: 120 of 120
// samples; run cachectl status)", and then "cache: sample not in cache:
// sample 20 is outside ...", sample and cache twice each.
func TestGetOutsideOrMissing(t *testing.T) {
	dir := t.TempDir()
	c, err := Create(dir, testManifest(20, EncodingCompact), nil)
	if err != nil {
		t.Fatal(err)
	}
	fillRange(t, c, 0, 10)
	c.Close()
	r, err := OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	for i, want := range map[int64]string{
		20: "cache: not found: sample 20 is outside [0, 20): the cache's dataset has 20 samples",
		-1: "cache: not found: sample -1 is outside [0, 20)",
		15: "cache: not found: sample 15 is not filled yet (committed: 10 of 20 samples; cachectl status lists the missing ranges)",
	} {
		if _, err := r.Get(i); !errors.Is(err, ErrNotFound) || !strings.HasPrefix(err.Error(), want) || strings.Count(err.Error(), "sample ") != 1 {
			t.Errorf("Get(%d): %v; want ErrNotFound saying %q", i, err, want)
		}
	}
}

// TestOpenReaderMismatchSaysWhatToDo: directories of two fills that
// disagree name the field and what to do about it.
func TestOpenReaderMismatchSaysWhatToDo(t *testing.T) {
	a, b := t.TempDir(), t.TempDir()
	ma, mb := testManifest(10, EncodingCompact), testManifest(10, EncodingCompact)
	mb.K = 4
	for _, d := range []struct {
		dir string
		m   Manifest
	}{{a, ma}, {b, mb}} {
		c, err := Create(d.dir, d.m, nil)
		if err != nil {
			t.Fatal(err)
		}
		c.Close()
	}
	_, err := OpenReader(a, b)
	if !errors.Is(err, ErrManifestMismatch) || !strings.Contains(err.Error(), "field k differs: 8 in "+a+", 4 in "+b) ||
		!strings.Contains(err.Error(), "read them one at a time") {
		t.Fatalf("OpenReader of two fills that disagree on k: %v", err)
	}
}

// TestDamagedIndexTable: a truncated or overwritten index table (a copy
// cut short, a full disk) is ErrCorrupt naming the file and what to do,
// from every entry point. Badger read its footer in a goroutine of its
// own and panicked ("slice bounds out of range"), so every cachectl
// command died with a stack trace and exit status 2.
func TestDamagedIndexTable(t *testing.T) {
	for _, damage := range []string{"truncated", "zeroed footer"} {
		dir := t.TempDir()
		c, err := Create(dir, testManifest(20, EncodingCompact), nil)
		if err != nil {
			t.Fatal(err)
		}
		fillRange(t, c, 0, 10)
		c.Close()
		ssts, _ := filepath.Glob(filepath.Join(dir, "index", "*.sst"))
		if len(ssts) == 0 {
			t.Fatal("the index has no table to damage")
		}
		victim := ssts[len(ssts)-1]
		b, _ := os.ReadFile(victim)
		if damage == "truncated" {
			b = b[:len(b)/2]
		} else {
			clear(b[len(b)-8:])
		}
		os.WriteFile(victim, b, 0o644)
		open := map[string]func(string) error{
			"OpenReader": func(d string) error { _, err := OpenReader(d); return err },
			"Check":      func(d string) error { _, err := Check(d, nil); return err },
			"Open": func(d string) error {
				c, err := Open(d, nil)
				if err == nil {
					c.Close()
				}
				return err
			},
			"Repair": func(d string) error { _, err := Repair(d, nil); return err },
		}
		for name, f := range open {
			err := f(dir)
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), victim) || !strings.Contains(err.Error(), "run the fill again") {
				t.Errorf("%s: %s: %v; want ErrCorrupt naming %s", damage, name, err, victim)
			}
		}
	}
}

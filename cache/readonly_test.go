package cache

import (
	"fmt"
	"io"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

// readOnlySamples is the size of the cache the read-only test reads.
const readOnlySamples = 12

// readOnlyChecks is what a reader without write permission must be able
// to do: OpenReader, Get, Iter and Check (status, verify, inspect, export,
// train and eval use nothing else). It runs in the helper process of
// TestReadOnlyCache, as another user when the tests run as root.
func readOnlyChecks(dir string) error {
	r, err := OpenReader(dir)
	if err != nil {
		return fmt.Errorf("OpenReader: %w", err)
	}
	if r.Samples() != readOnlySamples {
		return fmt.Errorf("OpenReader: %d samples, want %d", r.Samples(), readOnlySamples)
	}
	for i := int64(0); i < readOnlySamples; i++ {
		s, err := r.Get(i)
		if err != nil {
			return fmt.Errorf("Get(%d): %w", i, err)
		}
		if want := testSample(i); fmt.Sprint(s.Tokens, s.TopKIDs, s.TopKLogProbs) != fmt.Sprint(want.Tokens, want.TopKIDs, want.TopKLogProbs) {
			return fmt.Errorf("Get(%d): content differs from what was written", i)
		}
	}
	it, err := r.Iter(IterOptions{Seed: 3})
	if err != nil {
		return err
	}
	n := 0
	for it.Next() {
		n++
	}
	it.Close()
	if it.Err() != nil || n != readOnlySamples {
		return fmt.Errorf("Iter: %d samples, %v", n, it.Err())
	}
	rep, err := Check(dir, nil)
	if err != nil {
		return fmt.Errorf("Check: %w", err)
	}
	if !rep.OK() {
		return fmt.Errorf("Check: %s", strings.Join(rep.Problems, "; "))
	}
	return nil
}

// chmodTree removes (or restores) the write bits of everything under dir.
func chmodTree(t *testing.T, dir string, writable bool) {
	t.Helper()
	err := filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		fi, err := d.Info()
		if err != nil {
			return err
		}
		m := fi.Mode().Perm() &^ 0o222
		if writable {
			m |= 0o200
		}
		return os.Chmod(p, m)
	})
	if err != nil {
		t.Fatal(err)
	}
}

// TestReadOnlyCache: a filled cache made read-only (chmod -R a-w) and owned
// by another user can be read, listed and verified with read permission
// only: before the fix, readers opened LOCK for writing, and Badger made
// index/ 0700 and MANIFEST 0600. As root (who ignores permissions), the
// reads run in a helper process as uid/gid 65534 (nobody); otherwise in
// this process. It is checked twice: with LOCK present (shared flock on a
// read-only descriptor) and with LOCK absent and impossible to create
// (lock-free read).
func TestReadOnlyCache(t *testing.T) {
	defer syscall.Umask(syscall.Umask(0o022))
	base := t.TempDir()
	// t.TempDir makes 0700 directories; another user must reach the cache.
	for _, d := range []string{filepath.Dir(base), base} {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	dir := filepath.Join(base, "cache")
	c, err := Create(dir, testManifest(readOnlySamples, EncodingLossless), nil)
	if err != nil {
		t.Fatal(err)
	}
	for a := int64(0); a < readOnlySamples; a += 4 {
		fillRange(t, c, a, a+4)
	}
	c.Close()
	var private []string
	filepath.WalkDir(dir, func(p string, d fs.DirEntry, err error) error {
		if fi, err := d.Info(); err == nil && fi.Mode().Perm()&0o044 != 0o044 {
			private = append(private, fmt.Sprintf("%s %v", strings.TrimPrefix(p, dir), fi.Mode().Perm()))
		}
		return nil
	})
	if len(private) > 0 {
		t.Errorf("with umask 022 the writer left files others cannot read: %q", private)
	}
	chmodTree(t, dir, false)
	t.Cleanup(func() { chmodTree(t, dir, true) })

	read := func(what string) {
		t.Helper()
		if os.Geteuid() != 0 {
			if err := readOnlyChecks(dir); err != nil {
				t.Fatalf("%s: %v", what, err)
			}
			return
		}
		bin := filepath.Join(base, "cache.test")
		if _, err := os.Stat(bin); err != nil {
			src, err := os.Open(os.Args[0])
			if err != nil {
				t.Fatal(err)
			}
			dst, err := os.OpenFile(bin, os.O_WRONLY|os.O_CREATE, 0o755)
			if err != nil {
				t.Fatal(err)
			}
			_, err = io.Copy(dst, src)
			src.Close()
			if cerr := dst.Close(); err == nil {
				err = cerr
			}
			if err != nil {
				t.Fatal(err)
			}
		}
		cmd := exec.Command(bin, "-test.run=^$")
		cmd.Env = append(os.Environ(), "CACHE_TEST_READONLY="+dir)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 65534, Gid: 65534}}
		out, err := cmd.CombinedOutput()
		if err != nil {
			t.Fatalf("%s, as uid 65534: %v\n%s", what, err, out)
		}
	}
	read("read-only cache with LOCK")
	if err := os.Remove(filepath.Join(dir, lockName)); err != nil {
		t.Fatal(err)
	}
	read("read-only cache without LOCK")
}

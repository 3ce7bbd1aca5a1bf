// Package testdirs gives tests the directories they need from the
// machine: it is imported by _test files only.
package testdirs

import (
	"os"
	"testing"
)

// Unwritable returns a directory this process cannot create files in: a
// 0555 temporary directory, or, for root (whom permissions do not bind),
// /sys. The test is skipped when the machine has neither.
func Unwritable(t testing.TB) string {
	t.Helper()
	d := t.TempDir()
	if err := os.Chmod(d, 0o555); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.Chmod(d, 0o755) }) // so that TempDir's cleanup can remove it
	if writable(d) {
		d = "/sys"
		if writable(d) {
			t.Skip("no directory this process cannot write")
		}
	}
	return d
}

// writable reports whether a file can be created in d.
func writable(d string) bool {
	f, err := os.CreateTemp(d, "probe-")
	if err != nil {
		return false
	}
	f.Close()
	os.Remove(f.Name())
	return true
}

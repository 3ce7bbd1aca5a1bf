package main

import (
	"bytes"
	"context"
	"path/filepath"
	"regexp"
	"strings"
	"testing"

	"distill/serve"
)

// TestFillTwoDirectoriesSaysHowToRead: a fill through two daemons with a
// cache directory each ends saying how to read them as one cache, and the
// cachectl command it prints runs (exit 0). It printed `cachectl verify
// DIR DIR`, which exits 2 (unexpected arguments: a directory is given
// with --cache).
func TestFillTwoDirectoriesSaysHowToRead(t *testing.T) {
	dir := t.TempDir()
	mdir := fillModel(t, 64)
	dpath := filepath.Join(dir, "ids.jsonl")
	writeIDs(t, dpath, idSamples(8, 64))
	var addrs []string
	for _, name := range []string{"cache-a", "cache-b"} {
		d, err := serve.Start(serve.Config{Model: mdir, Cache: filepath.Join(dir, name), DataRoots: []string{dir}, Listen: "127.0.0.1:0", Metrics: "off", Device: "cpu"}, nil)
		if err != nil {
			t.Fatal(err)
		}
		defer d.Shutdown(context.Background())
		addrs = append(addrs, d.Addr())
	}
	var stderr bytes.Buffer
	if err := fillMain(context.Background(), []string{"--teacher", strings.Join(addrs, ","), "--data", dpath, "--pretokenized", "--chunk", "2", "--k", "4"}, &stderr, &stderr); err != nil {
		t.Fatalf("fill: %v\n%s", err, stderr.String())
	}
	m := regexp.MustCompile(`(?m)^fill: read the directories together as one cache.*\b(cachectl verify [^;)]*)`).FindStringSubmatch(stderr.String())
	if m == nil {
		t.Fatalf("the fill does not say how to read its two directories:\n%s", stderr.String())
	}
	line := m[1]
	for _, d := range []string{"cache-a", "cache-b"} {
		if !strings.Contains(line, filepath.Join(dir, d)) {
			t.Errorf("%q does not name %s", line, d)
		}
	}
	var out bytes.Buffer
	if code := commands.Run(strings.Fields(line)[1:], &out, &out); code != 0 {
		t.Fatalf("%s, as the fill printed it: exit %d\n%s", line, code, out.String())
	}
	// The same flags to status: both directories, as one cache.
	if st, err := run(t, wrap(statusMain), strings.Fields(line)[2:]...); err != nil || !strings.Contains(st, "8 of 8 done") {
		t.Errorf("cachectl status with %s's flags: %v\n%s", line, err, st)
	}
}

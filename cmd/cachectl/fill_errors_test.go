package main

import (
	"context"
	"path/filepath"
	"strings"
	"testing"

	"distill/serve"
)

// TestFillErrorsNameTheFix: a fill through a daemon whose cache holds
// another fill says to start a daemon with another --cache (fill's own
// --cache is refused with --teacher); in-process, to give another --cache.
// A --k the teacher cannot give names --k and its valid range, not the
// daemon's k settings.
func TestFillErrorsNameTheFix(t *testing.T) {
	dir := t.TempDir()
	mdir := fillModel(t, 64)
	dpath := filepath.Join(dir, "ids.jsonl")
	writeIDs(t, dpath, idSamples(6, 64))
	cdir := filepath.Join(dir, "cache")
	d, err := serve.Start(serve.Config{Model: mdir, Cache: cdir, DataRoots: []string{dir}, Listen: "127.0.0.1:0", Metrics: "off", Device: "cpu"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Shutdown(context.Background())
	fill := []string{"--teacher", d.Addr(), "--data", dpath, "--pretokenized", "--chunk", "3", "--retry-for", "0s"}
	if out, err := runFill(t, append(fill, "--k", "4")...); err != nil {
		t.Fatalf("fill: %v\n%s", err, out)
	}
	out, err := runFill(t, append(fill, "--k", "3")...)
	if err == nil || !strings.Contains(out+err.Error(), "start a teacherd with another --cache directory") || strings.Contains(out+err.Error(), "use another --cache") {
		t.Errorf("fill --k 3 into the daemon's k-4 cache: %v\n%s", err, out)
	}
	local := []string{"--model", mdir, "--cache", cdir, "--data", dpath, "--pretokenized", "--chunk", "3"}
	out, err = runFill(t, append(local, "--k", "3")...)
	if err == nil || !strings.Contains(err.Error(), "give another --cache directory") || strings.Contains(err.Error(), "teacherd") {
		t.Errorf("fill --model --k 3 into a k-4 cache: %v\n%s", err, out)
	}
	for _, k := range []string{"100", "-3"} {
		_, err := runFill(t, append(local, "--k", k)...)
		if want := "--k " + k + ": want 1 <= k <= 64 (the teacher's vocab size), or 0 for the default 64"; err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "k max") {
			t.Errorf("fill --k %s on a vocab-64 model: %v\nwant %q", k, err, want)
		}
	}
}

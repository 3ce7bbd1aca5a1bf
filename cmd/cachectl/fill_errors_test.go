package main

import (
	"bytes"
	"context"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/internal/cli"
	"distill/serve"
)

// TestFillErrorsNameTheFix: a fill through a daemon whose cache holds
// another fill says to start a daemon with another --cache (fill's own
// --cache is refused with --teacher); in-process, to give another --cache;
// both name the directory and the field that differs once.
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
	// The mismatch names the directory once, and cache once: it said
	// "cache DIR: cache: manifest mismatch: ... 4 in DIR (DIR holds 2
	// committed chunks, ...)".
	mismatch := "cache: manifest mismatch: field k differs: 3 in the requested manifest, 4 in " + cdir + ", whose 2 committed chunks (6 samples) were made under it; the cache directory holds another fill: "
	out, err := runFill(t, append(fill, "--k", "3")...)
	if err == nil || !strings.Contains(out+err.Error(), "start a teacherd with another --cache directory") || strings.Contains(out+err.Error(), "use another --cache") ||
		!strings.HasPrefix(err.Error(), "teacher "+d.Addr()+": FailedPrecondition: "+mismatch) || strings.Count(err.Error(), cdir) != 1 {
		t.Errorf("fill --k 3 into the daemon's k-4 cache: %v\n%s", err, out)
	}
	local := []string{"--model", mdir, "--cache", cdir, "--data", dpath, "--pretokenized", "--chunk", "3"}
	out, err = runFill(t, append(local, "--k", "3")...)
	if err == nil || !strings.Contains(err.Error(), "give another --cache directory") || strings.Contains(err.Error(), "teacherd") ||
		!strings.HasPrefix(err.Error(), mismatch) || strings.Count(err.Error(), cdir) != 1 {
		t.Errorf("fill --model --k 3 into a k-4 cache: %v\n%s", err, out)
	}
	for _, k := range []string{"100", "-3"} {
		_, err := runFill(t, append(local, "--k", k)...)
		if want := "--k " + k + ": want 1 <= k <= 64 (the teacher's vocab size), or 0 for the default 64"; err == nil || !strings.Contains(err.Error(), want) || strings.Contains(err.Error(), "k max") {
			t.Errorf("fill --k %s on a vocab-64 model: %v\nwant %q", k, err, want)
		}
	}
}

// TestFillErrorsSayFillOnce: a failed fill's message names the command
// once ("cachectl fill: range ...", not "cachectl fill: fill: range
// ..."), and a bad record still gets the --skip-bad hint (its
// data.ErrBadRecord is seen through the fill's error).
func TestFillErrorsSayFillOnce(t *testing.T) {
	dir := t.TempDir()
	mdir := fillModel(t, 64)
	dpath := filepath.Join(dir, "ids.jsonl")
	writeIDs(t, dpath, idSamples(6, 64))
	bad := filepath.Join(dir, "bad.jsonl")
	os.WriteFile(bad, []byte("{\"input_ids\": [1, 2, 3]}\n{nope\n"), 0o644)
	r := cli.New("cachectl")
	r.Register(&cli.Command{Name: "fill", Run: func(args []string) error {
		return fillMain(context.Background(), args, io.Discard, io.Discard)
	}})
	local := []string{"fill", "--model", mdir, "--pretokenized", "--chunk", "3", "--device", "cpu"}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{append(local, "--cache", filepath.Join(dir, "c1"), "--data", dpath, "--end", "100"),
			"cachectl fill: range [0, 100) goes beyond the dataset's 6 samples: lower --end\n"},
		// A --start at or past the end named the range and end instead:
		// "range [6, 6): want 0 <= start < end", "... lower --end".
		{append(local, "--cache", filepath.Join(dir, "c3"), "--data", dpath, "--start", "6"),
			"cachectl fill: --start 6: the dataset has 6 samples (0 to 5); give a --start below 6\n"},
		{append(local, "--cache", filepath.Join(dir, "c4"), "--data", dpath, "--start", "8", "--end", "10"),
			"cachectl fill: --start 8: the dataset has 6 samples (0 to 5); give a --start below 6\n"},
		{append(local, "--cache", filepath.Join(dir, "c2"), "--data", bad),
			"add --skip-bad to store bad records as empty samples"},
	} {
		var stderr bytes.Buffer
		code := r.Run(tc.args, io.Discard, &stderr)
		if got := stderr.String(); code != 1 || !strings.Contains(got, tc.want) || strings.Count(got, "fill: ") != 1 {
			t.Errorf("cachectl %s: exit %d, stderr %q: want 1, %q and fill named once", strings.Join(tc.args, " "), code, got, tc.want)
		}
	}
}

// TestFillTeacherRelativeData: a fill through a daemon with a relative
// --data is a usage error that gives the absolute path the relative one
// is on this machine, before any daemon is asked: the daemon refused it
// ("is relative: give the absolute path as the daemon sees it") and the
// user had to work the path out. The path it gives is the one a daemon
// on this machine reads.
func TestFillTeacherRelativeData(t *testing.T) {
	dir := t.TempDir()
	mdir := fillModel(t, 64)
	dpath := filepath.Join(dir, "ids.jsonl")
	writeIDs(t, dpath, idSamples(6, 64))
	wd, err := os.Getwd()
	if err != nil {
		t.Fatal(err)
	}
	rel, err := filepath.Rel(wd, dpath)
	if err != nil || filepath.IsAbs(rel) {
		t.Fatalf("no relative path to %s from %s: %q %v", dpath, wd, rel, err)
	}
	d, err := serve.Start(serve.Config{Model: mdir, Cache: filepath.Join(dir, "cache"), DataRoots: []string{dir}, Listen: "127.0.0.1:0", Metrics: "off", Device: "cpu"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Shutdown(context.Background())
	fill := []string{"--teacher", d.Addr(), "--pretokenized", "--chunk", "3", "--retry-for", "0s"}
	out, err := runFill(t, append(fill, "--data", rel)...)
	want := "--data " + rel + " is a relative path: a daemon (--teacher) opens --data on its own machine"
	if cli.ExitStatus(err) != 2 || !strings.Contains(err.Error(), want) || !strings.Contains(err.Error(), "e.g. --data "+dpath+" (this machine's path") {
		t.Fatalf("fill --teacher --data %s: %v (exit %d)\n%s\nwant exit 2 with %q and --data %s", rel, err, cli.ExitStatus(err), out, want, dpath)
	}
	if out, err := runFill(t, append(fill, "--data", dpath)...); err != nil {
		t.Fatalf("fill --teacher --data %s, the path the error gave: %v\n%s", dpath, err, out)
	}
}

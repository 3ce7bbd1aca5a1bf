package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"distill/serve"
)

// TestClientsTokenFile: fill and score reach a daemon that wants a bearer
// token with --token-file (the secret stays off the command line), are
// refused without it, and refuse --token beside --token-file; score
// through the daemon gives what it gives in-process.
func TestClientsTokenFile(t *testing.T) {
	t.Setenv("DISTILL_TOKEN", "")
	dir := t.TempDir()
	mdir := fillModel(t, 64)
	tf := filepath.Join(dir, "token")
	os.WriteFile(tf, []byte("s3cret\n"), 0o600)
	d, err := serve.Start(serve.Config{Model: mdir, Cache: filepath.Join(dir, "cache"), DataRoots: []string{dir}, TokenFile: tf,
		Listen: "127.0.0.1:0", Metrics: "off", Device: "cpu"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Shutdown(context.Background())
	dpath := filepath.Join(dir, "ids.jsonl")
	writeIDs(t, dpath, idSamples(6, 64))

	fill := []string{"--teacher", d.Addr(), "--data", dpath, "--pretokenized", "--chunk", "3", "--k", "4", "--retry-for", "0s"}
	// A wrong token says what to give, as score does, not "is it
	// running?" (the daemon answered).
	bad := filepath.Join(dir, "bad-token")
	os.WriteFile(bad, []byte("wrong\n"), 0o600)
	for _, extra := range [][]string{nil, {"--token-file", bad}} {
		out, err := runFill(t, append(fill, extra...)...)
		if err == nil {
			t.Errorf("fill %v without the token succeeded:\n%s", extra, out)
		} else if !strings.Contains(err.Error(), "missing or wrong bearer token") || !strings.Contains(err.Error(), "give the daemon's bearer token with --token-file") ||
			strings.Contains(err.Error(), "is it running") {
			t.Errorf("fill %v without the token: %v", extra, err)
		}
	}
	if _, err := runFill(t, append(fill, "--token-file", tf, "--token", "s3cret")...); err == nil || !strings.Contains(err.Error(), "only one of --token and --token-file") {
		t.Errorf("fill --token and --token-file: %v", err)
	}
	// A missing token or CA file names the flag, the file, and what it
	// wants (it said "teacherdial: invalid option: token file: open
	// ...", and for --tls-ca "serve: invalid request: teacherdial:
	// invalid option: TLS CA file: ...").
	none := filepath.Join(dir, "none")
	for _, c := range []struct{ flag, want string }{
		{"--token-file", "--token-file " + none + ": no such file or directory: give the file that holds the bearer token"},
		{"--tls-ca", "--tls-ca " + none + ": no such file or directory: give the PEM file of the CA that signed the daemon's TLS certificate"},
	} {
		_, err := runFill(t, append(fill, c.flag, none)...)
		if err == nil || !strings.HasPrefix(err.Error(), c.want) {
			t.Errorf("fill %s missing: %v, want %q", c.flag, err, c.want)
		}
		if err := runScore([]string{"--ids", "1", "--teacher", d.Addr(), c.flag, none}); err == nil || !strings.HasPrefix(err.Error(), c.want) {
			t.Errorf("score %s missing: %v, want %q", c.flag, err, c.want)
		}
	}
	if out, err := runFill(t, append(fill, "--token-file", tf)...); err != nil {
		t.Fatalf("fill --token-file: %v\n%s", err, out)
	}

	score := []string{"--ids", "1,2,3;4,5", "--k", "3"}
	// The daemon's message and what to give, not the bare gRPC status
	// nor "is it running?".
	if err := runScore(append(score, "--teacher", d.Addr())); err == nil || !strings.Contains(err.Error(), "missing or wrong bearer token") ||
		!strings.Contains(err.Error(), "give the daemon's bearer token with --token-file") || strings.Contains(err.Error(), "is it running") ||
		strings.Contains(err.Error(), "cachectl fill --token") {
		t.Errorf("score without the token: %v", err)
	}
	if err := runScore(append(score, "--teacher", d.Addr(), "--model", mdir)); err == nil || !strings.Contains(err.Error(), "one of --model") {
		t.Errorf("score --teacher and --model: %v", err)
	}
	remote := captureStdout(t, func() error { return runScore(append(score, "--teacher", d.Addr(), "--token-file", tf)) })
	local := captureStdout(t, func() error { return runScore(append(score, "--model", mdir, "--device", "cpu")) })
	_, rt, _ := strings.Cut(remote, "\n")
	_, lt, _ := strings.Cut(local, "\n")
	if rt == "" || rt != lt {
		t.Errorf("score through the daemon:\n%s\nin-process:\n%s", remote, local)
	}
}

// captureStdout runs f with os.Stdout going to a file and returns what f
// printed; f's error fails the test.
func captureStdout(t *testing.T, f func() error) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "stdout")
	o, err := os.Create(p)
	if err != nil {
		t.Fatal(err)
	}
	saved := os.Stdout
	os.Stdout = o
	err = f()
	os.Stdout = saved
	o.Close()
	if err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(p)
	return string(b)
}

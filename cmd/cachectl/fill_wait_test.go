package main

import (
	"context"
	"net"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"distill/serve"
)

// watchWriter is a command's stderr that a test reads as it is written.
type watchWriter struct {
	mu    sync.Mutex
	b     strings.Builder
	wrote chan struct{}
}

func (w *watchWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	n, err := w.b.Write(p)
	w.mu.Unlock()
	select {
	case w.wrote <- struct{}{}:
	default:
	}
	return n, err
}

func (w *watchWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// TestFillWaitsForTheDaemon: a fill started before its daemon (a Slurm
// job that starts both) waits for it, saying so, and fills once the
// daemon answers; it failed at once ("is it running?"). The daemon is
// started on the fill's address only after the fill has said it waits.
func TestFillWaitsForTheDaemon(t *testing.T) {
	dir := t.TempDir()
	mdir := fillModel(t, 64)
	dpath := filepath.Join(dir, "ids.jsonl")
	writeIDs(t, dpath, idSamples(6, 64))
	lis, err := net.Listen("tcp", "127.0.0.1:0") // a free port, for the daemon to come
	if err != nil {
		t.Fatal(err)
	}
	addr := lis.Addr().String()
	lis.Close()
	stderr := &watchWriter{wrote: make(chan struct{}, 1)}
	done := make(chan error, 1)
	go func() {
		done <- fillMain(context.Background(), []string{"--teacher", addr, "--data", dpath, "--pretokenized", "--chunk", "3", "--k", "4"}, stderr, stderr)
	}()
	waiting := "fill: waiting for the teachers to answer (for up to 2m0s, --retry-for): " + addr + ": Info: cannot connect: dial tcp " + addr + ": connect: connection refused\n"
	for !strings.Contains(stderr.String(), waiting) {
		select {
		case <-stderr.wrote:
		case err := <-done:
			t.Fatalf("the fill ended (%v) before it said that it waits:\n%s", err, stderr.String())
		}
	}
	d, err := serve.Start(serve.Config{Model: mdir, Cache: filepath.Join(dir, "cache"), DataRoots: []string{dir}, Listen: addr, Metrics: "off", Device: "cpu"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Shutdown(context.Background())
	if err := <-done; err != nil {
		t.Fatalf("fill: %v\n%s", err, stderr.String())
	}
	if out := stderr.String(); !strings.Contains(out, "fill: teacher "+addr+" answers (after ") || !strings.Contains(out, "fill: 6 samples") {
		t.Errorf("output:\n%s", out)
	}
}

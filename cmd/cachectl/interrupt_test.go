package main

import (
	"bytes"
	"errors"
	"io"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"distill/internal/cli"
)

// TestFillInterruptedConvention: a fill stopped by Ctrl-C is a
// cli.Interrupted (the convention of every resumable job: exit
// 128+signal, 130 here, and a message saying how to resume), and the
// rerun of the same command completes it.
func TestFillInterruptedConvention(t *testing.T) {
	dir := t.TempDir()
	mdir := fillModel(t, 64)
	dpath := filepath.Join(dir, "ids.jsonl")
	writeIDs(t, dpath, idSamples(12, 64))
	args := []string{"--model", mdir, "--cache", filepath.Join(dir, "cache"), "--data", dpath, "--pretokenized", "--chunk", "3", "--k", "4", "--device", "cpu"}

	ctx, stop := signalContext()
	syscall.Kill(os.Getpid(), syscall.SIGINT)
	<-ctx.Done()
	err := interrupted(ctx, fillMain(ctx, args, io.Discard, io.Discard))
	stop()
	var in *cli.Interrupted
	if !errors.As(err, &in) || in.Signal != syscall.SIGINT || !strings.Contains(err.Error(), "re-run the same command to resume") || !strings.Contains(err.Error(), "SIGINT") {
		t.Fatalf("fill stopped by SIGINT: %v", err)
	}
	r := cli.New("cachectl")
	r.Register(&cli.Command{Name: "fill", Run: func([]string) error { return err }})
	var stderr bytes.Buffer
	if rc := r.Run([]string{"fill"}, io.Discard, &stderr); rc != 130 || !strings.Contains(stderr.String(), "cachectl fill: ") {
		t.Errorf("exit status %d, want 130; stderr %q", rc, stderr.String())
	}
	if out, err := runFill(t, args...); err != nil {
		t.Fatalf("the rerun: %v\n%s", err, out)
	}
}

package main

import (
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"distill/cache"
	"distill/compute/cuda/cudaemu"
	"distill/internal/cli"
	"distill/model"
)

// TestFillDevices: cachectl fill --model --devices 0,1 on two emulated
// GPUs fills the cache a one-GPU fill does, bit for bit (--micro-batches
// 1), and cut into micro-batches too; a pipelined fill stopped by SIGTERM
// (the convention: exit 143, how to resume) completes on the re-run;
// --devices with the CPU, with daemons, or naming a GPU that is not
// there is an error saying so.
func TestFillDevices(t *testing.T) {
	cudaemu.UseDevices(t, 2, "two GPUs: emulated only")
	mdir := t.TempDir()
	cfg, err := model.Preset(model.ArchQwen3)
	if err != nil {
		t.Fatal(err)
	}
	cfg.VocabSize, cfg.Hidden, cfg.Layers, cfg.Intermediate, cfg.MaxPositions = 300, 32, 3, 64, 512
	if err := model.WriteCheckpoint(mdir, cfg, model.Init(cfg, model.InitOptions{Seed: 3, Std: 0.5, Perturb: true}), "BF16"); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	dpath := filepath.Join(dir, "ids.jsonl")
	writeIDs(t, dpath, idSamples(20, 300))
	args := func(cacheDir string, extra ...string) []string {
		return append([]string{"--model", mdir, "--cache", filepath.Join(dir, cacheDir), "--data", dpath, "--pretokenized", "--chunk", "6",
			"--k", "4", "--device", "cuda", "--encoding", "lossless"}, extra...)
	}
	for _, a := range [][]string{args("one"), args("two", "--devices", "0,1", "--micro-batches", "1"), args("cut", "--devices", "0,1", "--micro-batches", "3")} {
		if out, err := runFill(t, a...); err != nil {
			t.Fatalf("%v: %v\n%s", a, err, out)
		}
	}
	sameCache(t, filepath.Join(dir, "one"), filepath.Join(dir, "two"))
	if got := cacheRows(t, filepath.Join(dir, "cut")); len(got) != 20 {
		t.Errorf("the micro-batched fill holds %d samples, want 20", len(got))
	}

	ctx, stop := signalContext()
	syscall.Kill(os.Getpid(), syscall.SIGTERM)
	<-ctx.Done()
	err = interrupted(ctx, fillMain(ctx, args("stopped", "--devices", "0,1"), io.Discard, io.Discard))
	stop()
	var in *cli.Interrupted
	if !errors.As(err, &in) || in.Signal != syscall.SIGTERM || !strings.Contains(err.Error(), "re-run the same command to resume") {
		t.Fatalf("a pipelined fill stopped by SIGTERM: %v", err)
	}
	if out, err := runFill(t, args("stopped", "--devices", "0,1")...); err != nil {
		t.Fatalf("the re-run: %v\n%s", err, out)
	}
	sameCache(t, filepath.Join(dir, "one"), filepath.Join(dir, "stopped"))

	for _, c := range []struct {
		args []string
		want string
	}{
		{args("x", "--devices", "0,1", "--device", "cpu"), "use --device cuda (or auto) with it"},
		{args("x", "--devices", "0,7"), "GPU 7"},
		{args("x", "--devices", "zero"), `--devices "zero"`},
		{args("x", "--devices", "0,1", "--micro-batches", "-1"), "--micro-batches -1"},
		{[]string{"--teacher", "127.0.0.1:1", "--data", dpath, "--pretokenized", "--devices", "0,1"}, "--devices is for --model"},
	} {
		if _, err := runFill(t, c.args...); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v: %v, want an error naming %q", c.args, err, c.want)
		}
	}
	// Flags that exclude each other: a usage error, before the teacher
	// loads (it was refused once loading had begun, exit 1).
	out, err := runFill(t, args("x", "--devices", "0,1", "--device", "cpu")...)
	if cli.ExitStatus(err) != 2 || strings.Contains(out, "loading teacher") {
		t.Errorf("--device cpu --devices 0,1: exit %d, %v\n%s", cli.ExitStatus(err), err, out)
	}
}

// cacheRows reads every sample of a cache: its top-k ids and log-probs.
func cacheRows(t *testing.T, dir string) map[int64][2][]uint32 {
	t.Helper()
	r, err := cache.OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	out := map[int64][2][]uint32{}
	for _, ch := range r.Chunks() {
		for i := ch.Start; i < ch.End; i++ {
			s, err := r.Get(i)
			if err != nil {
				t.Fatal(err)
			}
			var ids, lps []uint32
			for j := range s.TopKIDs {
				ids, lps = append(ids, uint32(s.TopKIDs[j])), append(lps, math.Float32bits(s.TopKLogProbs[j]))
			}
			out[i] = [2][]uint32{ids, lps}
		}
	}
	return out
}

// sameCache fails unless two caches hold the same samples, bit for bit.
func sameCache(t *testing.T, a, b string) {
	t.Helper()
	ra, rb := cacheRows(t, a), cacheRows(t, b)
	if len(ra) == 0 || len(ra) != len(rb) {
		t.Fatalf("%s holds %d samples, %s %d", a, len(ra), b, len(rb))
	}
	for i, x := range ra {
		y := rb[i]
		if !slices.Equal(x[0], y[0]) || !slices.Equal(x[1], y[1]) {
			t.Fatalf("sample %d: %s and %s differ", i, a, b)
		}
	}
}

package main

import (
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"distill/compute/cuda/cudaemu"
	"distill/train/testcache"
)

// TestEvalDevice: `student eval --device` runs the student's forward on
// the backend it names, as student train's --device does, through the
// command on the emulated GPU: a run trained on the CPU scores the same
// on cuda as on the CPU (within what BF16 activations move), and auto
// takes the GPU; --device cuda without a driver is an error naming what
// is missing and the CPU's flag (exit 1), and a bad name a usage error.
// Eval had no --device and ran on the CPU only.
func TestEvalDevice(t *testing.T) {
	cudaemu.Use(t)
	t.Setenv("DISTILL_KERNEL_CACHE", t.TempDir())
	dir := t.TempDir()
	b, err := testcache.Build(testcache.Options{Dir: filepath.Join(dir, "cache"), Vocab: 97, K: 8, Samples: 24, Chunk: 8, MinLen: 6, MaxLen: 30, Seed: 2})
	if err != nil {
		t.Fatal(err)
	}
	cfg := filepath.Join(dir, "run.yaml")
	conf := strings.Replace(sigConfig, "max_steps: 1000000000, threads: 2}", "max_steps: 4, threads: 2, device: cpu}", 1)
	if err := os.WriteFile(cfg, []byte(conf), 0o644); err != nil {
		t.Fatal(err)
	}
	run := filepath.Join(dir, "run")
	if err := runTrain([]string{"--config", cfg, "--run-dir", run, "--cache", b.CacheDir}); err != nil {
		t.Fatal(err)
	}
	eval := func(env []string, args ...string) (map[string]float64, string, int) {
		t.Helper()
		c := exec.Command(os.Args[0], append([]string{"eval", "--checkpoint", run, "--cache", b.CacheDir, "--range", "0:8", "--json"}, args...)...)
		c.Env = append(append(os.Environ(), "STUDENT_TEST_MAIN=1"), env...)
		var stderr strings.Builder
		c.Stderr = &stderr
		out, err := c.Output()
		if _, ok := err.(*exec.ExitError); err != nil && !ok {
			t.Fatal(err)
		}
		if c.ProcessState.ExitCode() != 0 {
			return nil, stderr.String(), c.ProcessState.ExitCode()
		}
		var m map[string]any
		if err := json.Unmarshal(out, &m); err != nil {
			t.Fatalf("eval %v printed %q: %v", args, out, err)
		}
		f := map[string]float64{}
		for _, k := range []string{"loss", "kd", "ce", "token_accuracy", "top1_agreement", "tokens"} {
			v, ok := m[k].(float64)
			if !ok {
				t.Fatalf("eval %v: no %s in %s", args, k, out)
			}
			f[k] = v
		}
		return f, stderr.String(), 0
	}
	cpu, _, _ := eval(nil, "--device", "cpu")
	gpu, stderr, code := eval(nil, "--device", "cuda")
	if code != 0 || !strings.Contains(stderr, "cuda: distill CPU emulator") {
		t.Fatalf("--device cuda: exit %d, did it open the emulated GPU?\n%s", code, stderr)
	}
	// The losses within 0.1%; the accuracies count argmaxes, which an
	// untrained student's near-ties flip: within 2 of the positions.
	for _, k := range []string{"loss", "kd", "ce"} {
		if got, want := gpu[k], cpu[k]; !(want > 0) || math.Abs(got-want) > 1e-3*want {
			t.Errorf("%s: %v on cuda, %v on the CPU: want them within 0.1%%", k, got, want)
		}
	}
	for _, k := range []string{"token_accuracy", "top1_agreement"} {
		if got, want := gpu[k], cpu[k]; gpu["tokens"] != cpu["tokens"] || math.Abs(got-want) > 2/cpu["tokens"]+1e-9 {
			t.Errorf("%s: %v on cuda, %v on the CPU: want them within 2 positions", k, got, want)
		}
	}
	t.Logf("cpu %v\ncuda %v", cpu, gpu)
	auto, stderr, _ := eval(nil)
	if !strings.Contains(stderr, "eval: device auto: using distill CPU emulator (cuda)") || auto["ce"] != gpu["ce"] || auto["kd"] != gpu["kd"] {
		t.Errorf("--device auto with a GPU: %v, want cuda's %v\n%s", auto, gpu, stderr)
	}
	missing := filepath.Join(t.TempDir(), "libcuda.so.1")
	_, stderr, code = eval([]string{"DISTILL_LIBCUDA=" + missing}, "--device", "cuda")
	last := strings.TrimSpace(stderr)
	if i := strings.LastIndex(last, "\n"); i >= 0 {
		last = last[i+1:]
	}
	if code != 1 || !strings.HasPrefix(last, "student eval: --device cuda: cannot load the CUDA driver: tried "+missing) || !strings.HasSuffix(last, "; without a GPU, use --device cpu") {
		t.Errorf("--device cuda without a driver: exit %d, last line\n%s", code, last)
	}
	if _, stderr, code = eval(nil, "--device", "tpu"); code != 2 || !strings.Contains(stderr, `student eval: --device "tpu": want auto, cpu or cuda`) {
		t.Errorf("--device tpu: exit %d\n%s", code, stderr)
	}
}

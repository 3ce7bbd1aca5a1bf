package infer

import (
	"bufio"
	"fmt"
	"math/rand/v2"
	"os"
	"strconv"
	"strings"
	"testing"

	"distill/compute/device"
	"distill/model"
)

// BenchConfig is the ~48M-parameter Qwen3-shaped teacher of the CPU
// benchmark: Qwen3's vocabulary (151936) with a small tied body, so the
// streaming LM head carries most of the FLOPs, as it does for small teachers.
func BenchConfig() *model.Config {
	c, _ := model.Preset(model.ArchQwen3)
	c.VocabSize, c.Hidden, c.Layers, c.Heads, c.KVHeads, c.HeadDim, c.Intermediate = 151936, 256, 12, 4, 2, 64, 768
	c.TieEmbeddings = true
	c.MaxPositions = 4096
	return c
}

// benchCheckpoint returns $DISTILL_BENCH_CKPT, or writes BenchConfig there
// (or to a temp dir).
func benchCheckpoint(b *testing.B) string {
	dir := os.Getenv("DISTILL_BENCH_CKPT")
	if dir == "" {
		dir = b.TempDir()
	} else if _, err := os.Stat(dir + "/config.json"); err == nil {
		return dir
	}
	c := BenchConfig()
	if err := model.WriteCheckpoint(dir, c, model.Init(c, model.InitOptions{Seed: 1}), "BF16"); err != nil {
		b.Fatal(err)
	}
	return dir
}

// peakRSSMB reads VmHWM, the process's peak resident set.
func peakRSSMB() float64 {
	f, err := os.Open("/proc/self/status")
	if err != nil {
		return 0
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		if v, ok := strings.CutPrefix(s.Text(), "VmHWM:"); ok {
			kb, _ := strconv.Atoi(strings.TrimSpace(strings.TrimSuffix(strings.TrimSpace(v), "kB")))
			return float64(kb) / 1024
		}
	}
	return 0
}

// BenchmarkTeacherForward: tokens/s of the CPU teacher (forward + streaming
// top-64 over the full vocabulary) on a 4096-token packed batch of 8 samples
// of 512, and the process's peak RSS. scripts/bench-teacher-cpu.sh runs it
// beside PyTorch on the same checkpoint and prints the ratio.
func BenchmarkTeacherForward(b *testing.B) {
	m, err := Load(benchCheckpoint(b), device.CPU(0))
	if err != nil {
		b.Fatal(err)
	}
	B, T, K := 8, 512, 64
	if v, err := strconv.Atoi(os.Getenv("DISTILL_BENCH_SAMPLES")); err == nil {
		B = v
	}
	if v, err := strconv.Atoi(os.Getenv("DISTILL_BENCH_LEN")); err == nil {
		T = v
	}
	r := rand.New(rand.NewPCG(0, 0))
	samples := make([][]int32, B)
	for i := range samples {
		samples[i] = make([]int32, T)
		for j := range samples[i] {
			samples[i][j] = int32(r.IntN(m.Cfg.VocabSize))
		}
	}
	opt := Options{K: K, TokenBudget: B * T}
	if _, err := m.TopK(samples, opt); err != nil { // warm up
		b.Fatal(err)
	}
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		m.TopK(samples, opt)
	}
	b.StopTimer()
	tps := float64(B*T*b.N) / b.Elapsed().Seconds()
	flops := 2 * float64(m.Cfg.Params()) // + attention, small at T=512
	b.ReportMetric(tps, "tokens/s")
	b.ReportMetric(tps*flops/1e9, "GFLOP/s")
	b.ReportMetric(peakRSSMB(), "peakRSS_MB")
	// The documented bound: fp32 weights + ActivationBytes (the mmap'd BF16
	// file is also resident while loading).
	b.ReportMetric(float64(4*m.Cfg.Params()+m.ActivationBytes(B*T, T, K))/(1<<20), "boundRSS_MB")
	b.ReportMetric(float64(m.Cfg.Params())/1e6, "Mparams")
	fmt.Fprintf(os.Stderr, "teacher: %d samples x %d tokens, k=%d, %.1fM params\n", B, T, K, float64(m.Cfg.Params())/1e6)
}

package infer

import (
	"syscall"
	"testing"
	"time"

	"distill/cache"
	"distill/compute/device"
)

// BenchmarkFillTargets is the teacher's fill cost per target kind on the
// CPU: BenchConfig (Qwen3's 151936 vocabulary, a small body, so the LM
// head is most of the forward: the worst case for sampling), 1024 tokens
// per forward. Each iteration runs topk (k 16), sampled (N 50) and
// head+sampled (k 8, N 50) one after the other, so that all three see
// the same machine; it prints each kind's tokens/s by wall time and by
// the process's CPU time (getrusage: steadier on a shared machine), and
// the sampled kinds' cost over topk by CPU time:
//
//	go test ./infer -run '^$' -bench FillTargets -benchtime 3x
func BenchmarkFillTargets(b *testing.B) {
	m, err := Load(benchCheckpoint(b), device.CPU(0))
	if err != nil {
		b.Fatal(err)
	}
	samples := make([][]int32, 4)
	for i := range samples {
		samples[i] = make([]int32, 256)
		for j := range samples[i] {
			samples[i][j] = int32((i*7919 + j*104729) % m.Cfg.VocabSize)
		}
	}
	key := cache.DrawKey("bench")
	U := func(s, t, d int) float64 { return cache.DrawUniform(key, int64(s), t, d) }
	kinds := []struct {
		name string
		k    int
		d    *Draws
	}{
		{"topk-k16", 16, nil},
		{"sampled-N50", 0, &Draws{N: 50, U: U}},
		{"head+sampled-k8-N50", 8, &Draws{N: 50, Head: true, U: U}},
	}
	var wall, cpu [3]float64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j, c := range kinds {
			w0, c0 := time.Now(), cpuSeconds()
			if c.d == nil {
				m.Forward(samples, c.k, 1)
			} else {
				m.ForwardDraws(samples, c.k, 1, *c.d)
			}
			wall[j] += time.Since(w0).Seconds()
			cpu[j] += cpuSeconds() - c0
		}
	}
	for j, c := range kinds {
		n := float64(b.N * 1024)
		b.ReportMetric(n/wall[j], c.name+"-tokens/s")
		b.Logf("%s: %.0f tokens/s wall, %.0f tokens per CPU-second (%+.1f%% CPU time against topk)", c.name, n/wall[j], n/cpu[j], 100*(cpu[j]/cpu[0]-1))
	}
}

// cpuSeconds is the process's user and system CPU time so far.
func cpuSeconds() float64 {
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		panic(err)
	}
	return float64(ru.Utime.Nano()+ru.Stime.Nano()) / 1e9
}

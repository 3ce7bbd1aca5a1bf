package infer

import (
	"testing"
	"time"

	"distill/cache"
	"distill/compute/device"
)

// BenchmarkFillTargets is the teacher's fill cost per target kind on the
// CPU: BenchConfig (Qwen3's 151936 vocabulary, a small body, so the LM
// head is most of the forward: the worst case for sampling, which adds
// two LM-head GEMMs and 2 x vocab exps per position), 1024 tokens per
// forward. It prints tokens/s of topk (k 16), sampled (N 50) and
// head+sampled (k 8, N 50):
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
	for _, c := range []struct {
		name string
		k    int
		d    *Draws
	}{
		{"topk-k16", 16, nil},
		{"sampled-N50", 0, &Draws{N: 50, U: U}},
		{"head+sampled-k8-N50", 8, &Draws{N: 50, Head: true, U: U}},
	} {
		b.Run(c.name, func(b *testing.B) {
			start := time.Now()
			for i := 0; i < b.N; i++ {
				if c.d == nil {
					m.Forward(samples, c.k, 1)
				} else {
					m.ForwardDraws(samples, c.k, 1, *c.d)
				}
			}
			tps := float64(b.N*1024) / time.Since(start).Seconds()
			b.ReportMetric(tps, "tokens/s")
			b.Logf("%s: %.0f tokens/s", c.name, tps)
		})
	}
}

package infer

import (
	"path/filepath"
	"runtime"
	"testing"

	"distill/compute/device"
)

// TestActivationBound: the bytes one Forward allocates (runtime.MemStats
// TotalAlloc, counting everything, even what the GC frees during the call)
// stay within ActivationBytes, and the bound is not loose by more than 2x.
func TestActivationBound(t *testing.T) {
	for _, arch := range []string{"qwen3", "qwen2", "qwen3_moe"} {
		m, err := Load(filepath.Join("testdata/golden", arch), device.CPU(0))
		if err != nil {
			t.Fatal(err)
		}
		samples := make([][]int32, 7)
		for i := range samples {
			samples[i] = make([]int32, 100+90*i)
			for j := range samples[i] {
				samples[i][j] = int32((i*31 + j*7) % m.Cfg.VocabSize)
			}
		}
		n, maxLen := 0, 0
		for _, s := range samples {
			n += len(s)
			maxLen = max(maxLen, len(s))
		}
		const k = 32
		m.Forward(samples, k, 0.5) // warm up: lazily-made package state
		var a, b runtime.MemStats
		runtime.GC()
		runtime.ReadMemStats(&a)
		m.Forward(samples, k, 0.5)
		runtime.ReadMemStats(&b)
		got, bound := int64(b.TotalAlloc-a.TotalAlloc), m.ActivationBytes(n, maxLen, k)
		t.Logf("%s: %d tokens: allocated %d bytes, bound %d", arch, n, got, bound)
		if got > bound {
			t.Errorf("%s: Forward allocated %d bytes > documented bound %d", arch, got, bound)
		}
		if got < bound/2 {
			t.Errorf("%s: bound %d is more than 2x the %d bytes allocated: tighten it", arch, bound, got)
		}
	}
}

package cpu

import (
	"fmt"
	"math"
	"testing"

	"distill/compute/computetest"
)

// TestConformance runs the contract's conformance suite on the CPU backend
// with one worker, three (uneven splits of every parallel loop) and 16 (a
// many-core machine, emulated: the suite's shapes cross every parallel
// threshold, see package computetest).
func TestConformance(t *testing.T) {
	for _, threads := range []int{1, 3, 16} {
		t.Run(fmt.Sprintf("threads=%d", threads), func(t *testing.T) {
			computetest.Run(t, New(threads), computetest.FP32)
		})
	}
}

func TestFastExp(t *testing.T) {
	xs := []float32{-87, -50, -10.5, -1, -0.3465, 0, 1e-8, 0.3466, 1, 7.25, 20, 50, 88}
	for i := 0; i < 2000; i++ {
		xs = append(xs, float32(-80+160*float64(i)/2000))
	}
	out := make([]float32, len(xs))
	expInto(out, xs)
	for i, x := range xs {
		want := math.Exp(float64(x))
		if d := math.Abs(float64(out[i])-want) / want; d > 3e-7 {
			t.Fatalf("exp(%v) = %v, want %v (rel %g)", x, out[i], want, d)
		}
	}
}

// TestScratchKeepsLargeBuffers: a small scratch request does not take a
// much larger free buffer (the loss head's 64 MiB tile); the next request
// of the large size gets that buffer back instead of allocating another.
// Before, the smallest buffer that fit went to any request, and a training
// step came to hold several 64 MiB tiles (+70 MB peak RSS at 8192 tokens).
func TestScratchKeepsLargeBuffers(t *testing.T) {
	be := New(1)
	big := be.scratch(1 << 20)
	be.release(big)
	small := be.scratch(1000)
	if cap(small) > 2000 {
		t.Fatalf("a 1000-float request took a buffer of %d floats", cap(small))
	}
	again := be.scratch(1 << 20)
	if &again[0] != &big[0] {
		t.Fatal("the large request allocated a new buffer while the old one was free")
	}
	be.release(small, again)
	// A buffer up to twice the request is reused.
	half := be.scratch(600 << 10)
	if &half[0] != &big[0] {
		t.Fatal("a request of 60% of a free buffer allocated a new one")
	}
}

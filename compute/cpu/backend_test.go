package cpu

import (
	"fmt"
	"math"
	"testing"

	"distill/compute/computetest"
)

// TestConformance runs the contract's conformance suite on the CPU backend
// with one worker and with three (uneven splits of every parallel loop).
func TestConformance(t *testing.T) {
	for _, threads := range []int{1, 3} {
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

package fmath

import (
	"math"
	"math/rand"
	"testing"
)

// TestExpULP compares Exp against float64 math.Exp rounded to float32 over
// the whole useful range, plus the edges; 2 ulp is the budget.
func TestExpULP(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	check := func(x float32) {
		got := Exp(x)
		want := float32(math.Exp(float64(x)))
		if want == 0 || math.IsInf(float64(want), 0) {
			if got != want {
				t.Fatalf("Exp(%g) = %g, want %g", x, got, want)
			}
			return
		}
		ulp := math.Abs(float64(math.Float32bits(got)) - float64(math.Float32bits(want)))
		if ulp > 2 {
			t.Fatalf("Exp(%g) = %g, want %g (%v ulp)", x, got, want, ulp)
		}
	}
	for i := 0; i < 1000000; i++ {
		check(float32(rng.Float64()*200 - 100))
	}
	for _, x := range []float32{0, -0, 1, -1, 87, -87, 88, 88.7, 89, -87.5, -104, -200, 1e-8, -1e-8, float32(math.Inf(-1)), float32(math.Inf(1))} {
		check(x)
	}
	if v := Exp(float32(math.NaN())); v == v {
		t.Fatalf("Exp(NaN) = %g, want NaN", v)
	}
}

func BenchmarkExp(b *testing.B) {
	xs := make([]float32, 4096)
	for i := range xs {
		xs[i] = float32(i)/100 - 20
	}
	var s float32
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for _, x := range xs {
			s += Exp(x)
		}
	}
	b.ReportMetric(float64(b.N*len(xs))/b.Elapsed().Seconds()/1e6, "Mexp/s")
	_ = s
}

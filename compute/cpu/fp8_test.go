package cpu

import (
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
)

// TestMatMulFP8 holds MatMul with an FP8 weight to compute's definition,
// evaluated in float64: w quantized per output channel, x per row, the
// dequantized values multiplied and summed (the tolerance is fp32
// accumulation's, relative to Σ|terms|), plus the bias. It also checks
// that the quantization ran: the result differs from the unquantized
// product by far more than that tolerance.
func TestMatMulFP8(t *testing.T) {
	be := New(2)
	const m, n, k = 7, 24, 48
	r := rand.New(rand.NewPCG(3, 29))
	x, w, bias := make([]float32, m*k), make([]float32, n*k), make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64() * math.Pow(2, float64(i%7-3)))
	}
	for i := range w {
		w[i] = float32(r.NormFloat64() * 0.05)
	}
	for i := range bias {
		bias[i] = float32(r.NormFloat64())
	}
	copy(x[2*k:3*k], make([]float32, k)) // an all-zero row
	q, err := compute.QuantizeFP8(w, n, k)
	if err != nil {
		t.Fatal(err)
	}
	wt, err := be.WeightFP8(q)
	if err != nil {
		t.Fatal(err)
	}
	if wt.DType() != compute.F8E4M3 || wt.Len() != n*k {
		t.Fatalf("WeightFP8: %v of %d", wt.DType(), wt.Len())
	}
	out := be.New(compute.F32, m*n)
	be.MatMul(out, be.FromF32(x), wt, be.FromF32(bias), m, n, k)
	got := F32(out)
	var moved float64
	for i := 0; i < m; i++ {
		var amax float64
		for _, v := range x[i*k : (i+1)*k] {
			amax = max(amax, math.Abs(float64(v)))
		}
		ts := compute.FP8Scale(float32(amax))
		for j := 0; j < n; j++ {
			var want, abs, exact float64
			for c := 0; c < k; c++ {
				xd := float64(compute.E4M3(x[i*k+c]/ts)) * float64(ts)
				wd := float64(compute.E4M3Value(q.Codes[j*k+c])) * float64(q.Scales[j])
				want += xd * wd
				abs += math.Abs(xd * wd)
				exact += float64(x[i*k+c]) * float64(w[j*k+c])
			}
			want += float64(bias[j])
			g := float64(got[i*n+j])
			if d := math.Abs(g - want); d > 1e-6*(abs+math.Abs(float64(bias[j]))) {
				t.Fatalf("out[%d,%d] = %v, definition %v (|Δ| %.3g)", i, j, g, want, d)
			}
			moved = max(moved, math.Abs(g-exact-float64(bias[j]))/(abs+1e-30))
		}
	}
	if moved < 1e-4 {
		t.Fatalf("FP8 MatMul is within %.3g of the unquantized product: the quantization did not run", moved)
	}
}

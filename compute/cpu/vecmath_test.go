package cpu

import (
	"math"
	"math/rand/v2"
	"testing"
)

func TestVecMathAgainstFloat64(t *testing.T) {
	r := rand.New(rand.NewPCG(21, 22))
	for _, n := range []int{0, 1, 15, 16, 17, 1000, 4099} {
		x := randSlice(r, n)
		for i := range x {
			x[i] *= 4
		}
		var want float64
		for _, v := range x {
			want += math.Exp(float64(v)*0.7 - 1.5)
		}
		if got := sumExp(x, 0.7, 1.5); math.Abs(got-want) > 1e-6*want+1e-12 {
			t.Fatalf("n=%d SumExp = %v, want %v", n, got, want)
		}
		out := make([]float32, n)
		scaledExp(out, x, 0.7, 1.5, 3)
		for i, v := range x {
			// The float32 argument carries |arg|·2^-24 of rounding, which
			// exp turns into that much relative error, beside its own.
			arg := float64(v)*0.7 - 1.5
			w := 3 * math.Exp(arg)
			if math.Abs(float64(out[i])-w) > (3e-7+1.2e-7*math.Abs(arg))*w {
				t.Fatalf("n=%d ScaledExp[%d] = %v, want %v", n, i, out[i], w)
			}
		}
		expMix(out, x, 0.5, 2, 0.25, 1, -2)
		for i, v := range x {
			w := 0.25*math.Exp(float64(v)*0.5-2) - 2*math.Exp(float64(v)-1)
			tol := (3e-7 + 1.2e-7*math.Abs(float64(v)*0.5-2)) * 0.25 * math.Exp(float64(v)*0.5-2)
			tol += (3e-7 + 1.2e-7*math.Abs(float64(v)-1)) * 2 * math.Exp(float64(v)-1)
			if math.Abs(float64(out[i])-w) > tol {
				t.Fatalf("n=%d ExpMix[%d] = %v, want %v", n, i, out[i], w)
			}
		}
	}
}

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
		if got := SumExp(x, 0.7, 1.5); math.Abs(got-want) > 1e-6*want+1e-12 {
			t.Fatalf("n=%d SumExp = %v, want %v", n, got, want)
		}
		out := make([]float32, n)
		ScaledExp(out, x, 0.7, 1.5, 3)
		for i, v := range x {
			// The float32 argument carries |arg|·2^-24 of rounding, which
			// exp turns into that much relative error, beside its own.
			arg := float64(v)*0.7 - 1.5
			w := 3 * math.Exp(arg)
			if math.Abs(float64(out[i])-w) > (3e-7+1.2e-7*math.Abs(arg))*w {
				t.Fatalf("n=%d ScaledExp[%d] = %v, want %v", n, i, out[i], w)
			}
		}
		ExpMix(out, x, 0.5, 2, 0.25, 1, -2)
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

func TestSwiGLUSlicesAgainstFloat64(t *testing.T) {
	r := rand.New(rand.NewPCG(23, 24))
	n := 1037
	g, u, dout := randSlice(r, n), randSlice(r, n), randSlice(r, n)
	g[0], g[1] = -95, 95 // saturated exp arguments
	out := make([]float32, n)
	SwiGLUSlice(out, g, u)
	dg, du := make([]float32, n), make([]float32, n)
	for i := range dg {
		dg[i], du[i] = 1, -1 // += semantics
	}
	SwiGLUBackwardSlice(dg, du, dout, g, u)
	for i := 0; i < n; i++ {
		gv, uv, d := float64(g[i]), float64(u[i]), float64(dout[i])
		sg := 1 / (1 + math.Exp(-gv))
		want := gv * sg * uv
		if math.Abs(float64(out[i])-want) > 1e-6*(1+math.Abs(want)) {
			t.Fatalf("out[%d] = %v, want %v", i, out[i], want)
		}
		wdu := -1 + d*gv*sg
		wdg := 1 + d*uv*sg*(1+gv*(1-sg))
		if math.Abs(float64(du[i])-wdu) > 1e-5*(1+math.Abs(wdu)) || math.Abs(float64(dg[i])-wdg) > 1e-5*(1+math.Abs(wdg)) {
			t.Fatalf("grad[%d] = (%v, %v), want (%v, %v)", i, dg[i], du[i], wdg, wdu)
		}
	}
}

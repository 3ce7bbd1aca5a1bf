package compute

import (
	"math"
	"math/rand/v2"
	"runtime"
	"testing"

	"golang.org/x/sys/cpu"
)

// detMathInputs are arguments for Exp and Log: the ranges the loss math
// uses (log-probs, differences of logits) and the edges of each function
// (overflow, the subnormal results, zeros, infinities, NaN).
func detMathInputs() []float64 {
	r := rand.New(rand.NewPCG(7, 8))
	xs := []float64{0, math.Copysign(0, -1), 1, -1, 0.5, -0.5, 709.78, 709.782712893384, 709.79, 710, -708.39, -708.4, -720, -744.4, -745.13,
		-745.2, -1e10, -1e300, -math.MaxFloat64, math.MaxFloat64, 1e-300, 5e-324, math.SmallestNonzeroFloat64 * 3, math.Inf(1), math.Inf(-1), math.NaN(),
		7.07106781186547524401e-01, 2 * 7.07106781186547524401e-01, 1e-30, 1 - 1e-16, 1 + 2.2e-16, math.Nextafter(1, 0), math.Nextafter(1, 2)}
	for i := 0; i < 200000; i++ {
		switch i % 4 {
		case 0:
			xs = append(xs, (r.Float64()*2-1)*30) // log-probs and their differences
		case 1:
			xs = append(xs, -r.Float64()*760) // down to the subnormal results and 0
		case 2:
			xs = append(xs, r.Float64()*1e-3)
		default:
			xs = append(xs, math.Exp((r.Float64()*2-1)*700)) // Log's positive normal range
		}
	}
	return xs
}

func ulps(a, b float64) uint64 {
	ia, ib := int64(math.Float64bits(a)), int64(math.Float64bits(b))
	if ia < ib {
		return uint64(ib - ia)
	}
	return uint64(ia - ib)
}

// TestDetMathAccuracy: Exp and Log are exp and log, within 1 ulp of
// math.Exp and math.Log (an independent implementation except on amd64)
// everywhere, NaN and the infinities included, on any machine.
func TestDetMathAccuracy(t *testing.T) {
	for _, x := range detMathInputs() {
		if got, want := Exp(x), math.Exp(x); !(got == want || math.IsNaN(got) && math.IsNaN(want) || ulps(got, want) <= 1 && !math.IsInf(want, 0)) {
			// Go's amd64 Exp returns +Inf a little early (exponent 1024
			// from x/ln 2 rounding up at 709.78); so does Exp.
			if !(runtime.GOARCH != "amd64" && x > 709.78 && math.IsInf(got, 1)) {
				t.Fatalf("Exp(%v) = %v, math.Exp %v", x, got, want)
			}
		}
		if x <= 0 || x < 0x1p-1022 {
			if x < 0 && !math.IsNaN(Log(x)) || x == 0 && !math.IsInf(Log(x), -1) {
				t.Fatalf("Log(%v) = %v", x, Log(x))
			}
			continue
		}
		if got, want := Log(x), math.Log(x); !(got == want || math.IsNaN(got) && math.IsNaN(want) || ulps(got, want) <= 1) {
			t.Fatalf("Log(%v) = %v, math.Log %v", x, got, want)
		}
	}
}

// TestDetMathIsGoAmd64: on amd64, Log is math.Log bit for bit and, on a
// CPU with FMA (where math.Exp takes its FMA path), Exp is math.Exp: the
// host loss math that switched from math's functions to these keeps its
// results there (train/loss's pinned digests, the trainer's pinned runs).
func TestDetMathIsGoAmd64(t *testing.T) {
	if runtime.GOARCH != "amd64" {
		t.Skipf("math.Exp and math.Log are amd64 assembly only on amd64; this is %s", runtime.GOARCH)
	}
	fma := cpu.X86.HasAVX && cpu.X86.HasFMA
	if !fma {
		t.Log("this CPU has no FMA: math.Exp takes its other path, only Log is compared")
	}
	for _, x := range detMathInputs() {
		if fma {
			if got, want := Exp(x), math.Exp(x); math.Float64bits(got) != math.Float64bits(want) && !(math.IsNaN(got) && math.IsNaN(want)) {
				t.Fatalf("Exp(%v) = %v (%#x), math.Exp %v (%#x)", x, got, math.Float64bits(got), want, math.Float64bits(want))
			}
		}
		if got, want := Log(x), math.Log(x); math.Float64bits(got) != math.Float64bits(want) && !(math.IsNaN(got) && math.IsNaN(want)) {
			t.Fatalf("Log(%v) = %v (%#x), math.Log %v (%#x)", x, got, math.Float64bits(got), want, math.Float64bits(want))
		}
	}
}

package computetest

import (
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
)

// dropout checks Dropout and DropoutBackward bit for bit against
// compute.DropoutMask.Keep, the mask every backend must draw: the kept
// elements are x·Scale (fp32, then rounded once to a BF16 output), the
// dropped ones 0, and the backward adds float32(dout·Scale) at the kept
// elements only. Columns 130 (not a multiple of 4: the last Philox call
// of a row serves two) and p 0 (keeps all) and 0.3.
func (s *suite) dropout(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(28, 2))
	rows, cols := 67, 130
	xt, x := s.actIn(randn(r, rows*cols, 1))
	for _, p := range []float64{0, 0.3} {
		d := compute.NewDropoutMask(0xfeed_face_0123_4567, 11, 5, p)
		out := s.actOut(rows * cols)
		be.Dropout(out, xt, &d, rows, cols)
		got := s.read(out, rows*cols)
		want := make([]float32, rows*cols)
		kept := 0
		for i := range want {
			if d.Keep(i/cols, i%cols) {
				want[i] = x[i] * d.Scale
				kept++
			}
		}
		if s.act != compute.F32 {
			want = bf16(want)
		}
		if p > 0 && (kept == 0 || kept == rows*cols) {
			t.Fatalf("p %g: the mask keeps %d of %d", p, kept, rows*cols)
		}
		sameBits(t, "Dropout out", got, want)
		if s.forwardOnly {
			continue
		}
		dout, dx0 := randn(r, rows*cols, 1), randn(r, rows*cols, 1)
		dxt := be.FromF32(dx0)
		be.DropoutBackward(dxt, be.FromF32(dout), &d, rows, cols)
		for i := range want {
			want[i] = dx0[i]
			if d.Keep(i/cols, i%cols) {
				want[i] += float32(dout[i] * d.Scale)
			}
		}
		sameBits(t, "DropoutBackward dx", s.read(dxt, rows*cols), want)
	}
}

// sameBits fails unless got and want are the same floats bit for bit.
func sameBits(t *testing.T, name string, got, want []float32) {
	t.Helper()
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("%s[%d] = %g (%08x), want %g (%08x)", name, i, got[i], math.Float32bits(got[i]), want[i], math.Float32bits(want[i]))
		}
	}
}

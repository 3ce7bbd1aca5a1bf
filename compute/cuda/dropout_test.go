package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
	"distill/compute/cpu"
)

// TestDropoutMatchesCPU: the CUDA backend (the emulator, or the GPU with
// DISTILL_CUDA_TEST=gpu) and compute/cpu draw the same dropout masks and
// compute the same bits, forward (F32 and BF16 outputs) and backward,
// on a shape whose rows exceed one Philox call's columns many times over
// (1027 columns: a partial last group) and several steps, rows and keys.
func TestDropoutMatchesCPU(t *testing.T) {
	be, c := testBackend(t), cpu.New(2)
	r := rand.New(rand.NewPCG(28, 3))
	rows, cols := 300, 1027
	x, dout, dx0 := randF32(r, rows*cols), randF32(r, rows*cols), randF32(r, rows*cols)
	for _, m := range []compute.DropoutMask{
		compute.NewDropoutMask(0x243f_6a88_85a3_08d3, 1, 0, 0.1),
		compute.NewDropoutMask(0x243f_6a88_85a3_08d3, 1, 1, 0.1),
		compute.NewDropoutMask(0x1319_8a2e_0370_7344, 900, 7, 0.5),
	} {
		want := make([]float32, rows*cols)
		co := c.New(compute.F32, rows*cols)
		c.Dropout(co, c.FromF32(x), &m, rows, cols)
		c.ReadF32(co, want)
		for _, dt := range []compute.DType{compute.F32, compute.BF16} {
			out := be.New(dt, rows*cols)
			be.Dropout(out, be.FromF32(x), &m, rows, cols)
			got := make([]float32, rows*cols)
			be.ReadF32(out, got)
			for i := range got {
				w := want[i]
				if dt == compute.BF16 {
					w = compute.BF16ToF32(compute.F32ToBF16(w))
				}
				if math.Float32bits(got[i]) != math.Float32bits(w) {
					t.Fatalf("mask %+v, %v out[%d] = %g, the CPU's %g", m, dt, i, got[i], w)
				}
			}
		}
		cg, gg := c.FromF32(dx0), be.FromF32(dx0)
		c.DropoutBackward(cg, c.FromF32(dout), &m, rows, cols)
		be.DropoutBackward(gg, be.FromF32(dout), &m, rows, cols)
		a, b := make([]float32, rows*cols), make([]float32, rows*cols)
		c.ReadF32(cg, a)
		be.ReadF32(gg, b)
		for i := range a {
			if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
				t.Fatalf("mask %+v: dx[%d] = %g, the CPU's %g", m, i, b[i], a[i])
			}
		}
	}
}

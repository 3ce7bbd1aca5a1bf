package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
)

// TestMatMulResidual holds the GEMM that adds a residual in its epilogue
// (MatMulResidual) to MatMul into an F32 out followed by Add, for BF16
// and F32 activations, BF16 and F32 weights, k = 0, and an out that is
// the residual itself: bit for bit on the emulator (one rounding of the
// fp32 product plus the residual either way), and within the GEMMs'
// summation-order bound on a GPU, where cuBLASLt may pick another
// algorithm for a GEMM with C. FP8 weights and Options.ResidualAdd
// "separate" decline, leaving out as it was.
func TestMatMulResidual(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(71, 72))
	for _, c := range []struct{ m, n, k int }{{37, 64, 48}, {5, 24, 0}, {128, 96, 200}} {
		for _, xbf := range []bool{true, false} {
			for _, wbf := range []bool{true, false} {
				what := fmt.Sprintf("%dx%dx%d, x %s, w bf16 %v", c.m, c.n, c.k, dtName(xbf), wbf)
				xv, wv, rv := randF32(r, c.m*c.k), randF32(r, c.n*c.k), randF32(r, c.m*c.n)
				x := placed(be, dtOf(xbf), xv, 0)
				var w compute.Tensor
				if wbf {
					_, wh := roundBF16(wv)
					var err error
					if w, err = be.Weight(wh); err != nil {
						t.Fatal(err)
					}
				} else {
					w = be.FromF32(wv)
				}
				want := be.New(compute.F32, c.m*c.n)
				be.MatMul(want, x, w, nil, c.m, c.n, c.k)
				res := be.FromF32(rv)
				be.Add(want, res, c.m*c.n)
				got := be.New(compute.F32, c.m*c.n)
				if !be.MatMulResidual(got, x, w, res, c.m, c.n, c.k) {
					t.Fatalf("%s: declined", what)
				}
				// out aliasing res: the residual stream updated in place.
				inplace := be.FromF32(rv)
				if !be.MatMulResidual(inplace, x, w, inplace, c.m, c.n, c.k) {
					t.Fatalf("%s, in place: declined", what)
				}
				wv2 := readF32(be, want, c.m*c.n)
				for name, o := range map[string]compute.Tensor{"": got, ", in place": inplace} {
					gv := readF32(be, o, c.m*c.n)
					for i := range gv {
						if !onGPU() && math.Float32bits(gv[i]) != math.Float32bits(wv2[i]) {
							t.Fatalf("%s%s: element %d is %v, MatMul then Add gives %v", what, name, i, gv[i], wv2[i])
						}
						if d := math.Abs(float64(gv[i] - wv2[i])); d > 1e-5*(1+math.Abs(float64(wv2[i]))) {
							t.Fatalf("%s%s: element %d is %v, MatMul then Add gives %v", what, name, i, gv[i], wv2[i])
						}
					}
				}
				for _, q := range []compute.Tensor{x, w, want, res, got, inplace} {
					be.Free(q)
				}
			}
		}
	}
	// Declines: FP8 weights, and the separate add asked for.
	q, err := compute.QuantizeFP8(randF32(r, 16*32), 16, 32)
	if err != nil {
		t.Fatal(err)
	}
	w8, err := be.WeightFP8(q)
	if err != nil {
		t.Fatal(err)
	}
	x, res := be.FromF32(randF32(r, 4*32)), be.FromF32(randF32(r, 4*16))
	out := be.FromF32(make([]float32, 4*16))
	if be.MatMulResidual(out, x, w8, res, 4, 16, 32) {
		t.Fatal("an FP8 weight: MatMulResidual took it")
	}
	sep := testBackendWith(t, Options{ResidualAdd: "separate"})
	wf := sep.FromF32(randF32(r, 16*32))
	if sep.MatMulResidual(sep.FromF32(make([]float32, 4*16)), sep.FromF32(randF32(r, 4*32)), wf, sep.FromF32(randF32(r, 4*16)), 4, 16, 32) {
		t.Fatal(`Options.ResidualAdd "separate": MatMulResidual took it`)
	}
	for _, v := range []string{"", "x"} {
		t.Setenv("DISTILL_CUDA_RESIDUAL_ADD", "sep"+v)
		if _, err := Open(Options{KernelCache: kernelCacheForTests(t)}); err == nil {
			t.Fatalf("DISTILL_CUDA_RESIDUAL_ADD=sep%s: opened", v)
		}
	}
	if readF32(be, out, 4*16)[0] != 0 {
		t.Fatal("a declined MatMulResidual wrote its out")
	}
}

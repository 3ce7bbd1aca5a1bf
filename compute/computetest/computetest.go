// Package computetest is the conformance suite of the compute contract:
// Run checks every kernel of a compute.Backend against float64 formulas
// (package compute/ref) and, for the backward kernels, against central
// finite differences of those formulas. Every backend runs it from its own
// tests with tolerances of its own: the CPU backend with FP32, a GPU
// backend with looser BF16 ones.
//
// Each check is |got-want| <= atol + rtol·|want|. Backward kernels start
// from non-zero gradients, so the suite also checks the += rule of the
// package doc; forward kernels start from garbage outputs, checking =.
// The shapes are large enough to cross the CPU backend's parallel
// thresholds (rows x cost >= 2^14 over at least 16 rows, GEMMs >= 2^18
// multiply-adds), so a backend run with several workers splits every loop;
// finite differences run on strided subsets to stay affordable.
//
// LoRALinear checks compute.LoRA (a LoRA adapter composed of the
// contract's kernels) on a frozen base Linear, forward and backward,
// without and with dropout on the adapter's input; Dropout holds
// Dropout and DropoutBackward to compute.DropoutMask bit for bit (every
// backend draws the same masks).
//
// MoEBackward checks MoEForward and MoEBackward (the Qwen3-MoE block's
// training pair) against float64 formulas and finite differences, router
// and load-balancing gradient included; a BF16 backend's gradients are
// held norm-wise (Tolerances.MoEBwdRel), and a backend that trains but has
// no MoE kernels yet can leave "MoEBackward" out through Tolerances.Skip.
//
// A backend whose activation dtype (ActDType) is not F32 runs the kernels
// that take activation operands a second time, as subtest "Act=bf16":
// those operands in its dtype (the inputs rounded to it, the references
// computed from the rounded values), the outputs widened for the checks
// with one more rounding's tolerance (2^-8 relative); the gradients that
// may be in it too (MatMulBackward's dout and dx, SwiGLUBackward's dgate
// and dup, RMSNormBackward's dx, AttentionBackward's dout and dv) as well,
// and a backend that implements compute.ActGrads has its
// RMSNormBackwardCopy held to RMSNormBackward's gradients and
// RoPEBackwardCopy to RoPEBackward's bits, and their copies to their exact
// rounding.
//
// A backend that implements only the teacher's forward (the CUDA backend,
// until its training kernels exist) runs RunForward: the memory methods
// and the forward kernels with the statistics they save, and nothing of
// the backward, optimizer, NVFP4 or loss-head kernels.
package computetest

import (
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
)

// Tolerances are one backend's error bounds.
type Tolerances struct {
	// Forward kernels against float64 formulas.
	FwdAtol, FwdRtol float64
	// Backward kernels against central finite differences (step FDStep)
	// of the float64 formulas.
	BwdAtol, BwdRtol float64
	FDStep           float64
	// LogProbAtol bounds the LM-head top-k log-probs.
	LogProbAtol float64
	// TieGap: top-k ids may differ from the float64 order only where two
	// logits are within TieGap of each other.
	TieGap float64
	// CDFTol: LMHeadSample's draws may differ from the float64 inverse
	// CDF only where the threshold lies within CDFTol·mass of the CDF's
	// step between the two ids; its tail mass is held to CDFTol relative.
	CDFTol float64
	// MoEAtol, MoERtol bound the MoE block's output, a sum of SwiGLU
	// experts with O(10) values.
	MoEAtol, MoERtol float64
	// MoEBwdRel, when set, bounds MoEBackward's gradients against finite
	// differences norm-wise, |got-want| <= MoEBwdRel·max|want| per
	// tensor, in place of BwdAtol, BwdRtol: a BF16GEMM backend rounds the
	// backward GEMMs' operands too (the experts' output gradients,
	// activations and their gradients), which a smooth reference cannot
	// reproduce.
	MoEBwdRel float64
	// BF16GEMM says that the backend rounds the operands of its GEMMs
	// (MatMul, the MoE experts' projections, the LM head) to BF16 and
	// accumulates in fp32, as a GPU backend does; the forward references
	// then round the same operands (x, w, and the experts' SwiGLU
	// activations; the MoE router stays fp32), so the tolerances cover the
	// accumulation order and the rounding of intermediates only.
	BF16GEMM bool
	// BF16Attention says that the backend's attention rounds q, k, v (and
	// dout and the forward's output, backward) to BF16, its probabilities
	// and their gradients to BF16 before the matmuls, and its output and
	// gradients to BF16, as cuDNN's fused attention does; the attention
	// references then take q, k, v and dout rounded the same way, and the
	// output and the gradients are held to AttnAtol, AttnRtol (the
	// log-sum-exp, whose inputs only are rounded, keeps the forward's).
	BF16Attention      bool
	AttnAtol, AttnRtol float64
	// Skip, if set, names the subtests (by their name in Run's list, e.g.
	// "MatMul") that this backend does not run, with the reason; Run logs
	// the reason as the subtest's skip message. A subtest Skip returns ""
	// for runs.
	Skip func(name string) (reason string)
}

// FP32 are the tolerances of an fp32 backend (the CPU reference). The
// shapes are small (values O(1), at most a few hundred terms per sum), so
// fp32 rounding stays near 1e-6.
var FP32 = Tolerances{
	FwdAtol: 2e-5, FwdRtol: 2e-4,
	BwdAtol: 5e-5, BwdRtol: 1e-3, FDStep: 1e-5,
	LogProbAtol: 1e-4, TieGap: 1e-5, CDFTol: 1e-5,
	MoEAtol: 1e-4, MoERtol: 1e-4,
}

// Run runs the whole suite on be, each kernel a subtest. A backend whose
// kernels are not all written yet (e.g. no MoE training kernels) leaves
// subtests out through tol.Skip, with the reason logged as the skip.
func Run(t *testing.T, be compute.Backend, tol Tolerances) {
	(&suite{be: be, tol: tol}).run(t)
}

// RunForward runs the part of the suite that a forward-only backend
// implements: the memory methods and the forward kernels, with the
// statistics RMSNorm and Attention save (rstd, lse). The backward checks
// of the kernels that have both halves are left out, and so are the
// training-only kernels (AdamW, SumSquares, Scale, AbsMax,
// FakeQuantNVFP4, the loss head).
func RunForward(t *testing.T, be compute.Backend, tol Tolerances) {
	(&suite{be: be, tol: tol, forwardOnly: true}).run(t)
}

func (s *suite) run(t *testing.T) {
	for _, c := range []struct {
		name  string
		fn    func(t *testing.T)
		train bool // a training-only kernel
	}{
		{"Memory", s.memory, false},
		{"MatMul", s.matMul, false},
		{"Embed", s.embed, false},
		{"RMSNorm", s.rmsNorm, false},
		{"RoPE", s.rope, false},
		{"RMSNormRoPE", s.rmsNormRoPE, false},
		{"Attention", s.attention, false},
		{"SwiGLU", s.swiGLU, false},
		{"Add", s.add, false},
		{"AddRMSNorm", s.addRMSNorm, false},
		{"MoE", s.moe, false},
		{"LMHeadTopK", s.lmHeadTopK, false},
		{"LMHeadTopKTies", s.lmHeadTopKTies, false},
		{"LMHeadSample", s.lmHeadSample, false},
		{"LMHeadSampleEdges", s.lmHeadSampleEdges, false},
		{"AdamW", s.adamW, true},
		{"SumSquaresScale", s.sumSquaresScale, true},
		{"AbsMax", s.absMax, true},
		{"FakeQuantNVFP4", s.fakeQuant, true},
		{"LossHeadForward", s.lossHeadForward, true},
		{"LossHeadBackward", s.lossHeadBackward, true},
		{"MoEBackward", s.moeBackward, true},
		{"MoERouting", s.moeRouting, true},
		{"Dropout", s.dropout, true},
		{"LoRALinear", s.loraLinear, true},
		{"MoELoRA", s.moeLoRA, true},
	} {
		if c.train && s.forwardOnly {
			continue
		}
		if s.tol.Skip != nil {
			if why := s.tol.Skip(c.name); why != "" {
				t.Run(c.name, func(t *testing.T) { t.Skipf("skipped for %s: %s", s.be.Name(), why) })
				continue
			}
		}
		t.Run(c.name, c.fn)
	}
	if act := s.be.ActDType(); act != compute.F32 && s.act == compute.F32 {
		a := *s
		a.act = act
		t.Run("Act="+act.String(), a.runAct)
	}
}

// runAct runs the kernels with activation operands (compute's "(act)"),
// those operands in s.act.
func (s *suite) runAct(t *testing.T) {
	for _, c := range []struct {
		name  string
		fn    func(t *testing.T)
		train bool
	}{
		{"MatMul", s.matMul, false},
		{"RMSNorm", s.rmsNorm, false},
		{"RoPE", s.rope, false},
		{"RMSNormRoPE", s.rmsNormRoPE, false},
		{"Attention", s.attention, false},
		{"SwiGLU", s.swiGLU, false},
		{"AddRMSNorm", s.addRMSNorm, false},
		{"LMHeadTopK", s.lmHeadTopK, false},
		{"LMHeadSample", s.lmHeadSample, false},
		{"AbsMax", s.absMax, true},
		{"FakeQuantNVFP4", s.fakeQuant, true},
		{"LossHeadForward", s.lossHeadForward, true},
		{"LossHeadBackward", s.lossHeadBackward, true},
		{"Dropout", s.dropout, true},
		{"LoRALinear", s.loraLinear, true},
		{"MoELoRA", s.moeLoRA, true},
	} {
		if c.train && s.forwardOnly {
			continue
		}
		if s.tol.Skip != nil && s.tol.Skip(c.name) != "" {
			continue
		}
		t.Run(c.name, c.fn)
	}
}

type suite struct {
	be          compute.Backend
	tol         Tolerances
	forwardOnly bool          // RunForward: skip every backward check
	act         compute.DType // the activation operands' dtype (runAct); F32 otherwise
}

// actIn uploads x as an activation operand, in the suite's activation
// dtype: it returns the tensor and the values it holds (x rounded to the
// dtype), from which the references are computed.
func (s *suite) actIn(x []float32) (compute.Tensor, []float32) {
	if s.act == compute.F32 {
		return s.be.FromF32(x), x
	}
	r := bf16(x)
	t := s.be.New(s.act, len(x))
	s.be.WriteF32(t, r)
	return t, r
}

// actOut returns an activation output of n elements filled with a value
// no kernel produces (see garbage).
func (s *suite) actOut(n int) compute.Tensor {
	if s.act == compute.F32 {
		return s.garbage(n)
	}
	t := s.be.New(s.act, n)
	x := make([]float32, n)
	for i := range x {
		x[i] = 1234.5
	}
	s.be.WriteF32(t, x)
	return t
}

// actFwd checks a forward output stored in the activation dtype: the
// forward tolerances, plus BF16's rounding of the output (2^-9 relative,
// held to 2^-8) when the dtype is BF16.
func (s *suite) actFwd(t *testing.T, name string, got []float32, want []float64) {
	t.Helper()
	rtol := s.tol.FwdRtol
	if s.act == compute.BF16 {
		rtol += 1.0 / 256
	}
	closeTo(t, name, got, want, s.tol.FwdAtol, rtol)
}

// actBwd checks a gradient stored in the activation dtype (a "+="
// output, accumulated in fp32 and rounded once): the backward
// tolerances, plus BF16's rounding when the dtype is BF16.
func (s *suite) actBwd(t *testing.T, name string, got []float32, want []float64) {
	t.Helper()
	rtol := s.tol.BwdRtol
	if s.act == compute.BF16 {
		rtol += 1.0 / 256
	}
	closeTo(t, name, got, want, s.tol.BwdAtol, rtol)
}

// gemmIn is a GEMM operand as the backend multiplies it: rounded to BF16
// under Tolerances.BF16GEMM, else x itself.
func (s *suite) gemmIn(x []float32) []float32 {
	if !s.tol.BF16GEMM {
		return x
	}
	return bf16(x)
}

// bf16 returns x rounded to BF16 (as float32).
func bf16(x []float32) []float32 {
	h := make([]uint16, len(x))
	compute.NarrowBF16(h, x)
	out := make([]float32, len(x))
	compute.WidenBF16(out, h)
	return out
}

func randn(r *rand.Rand, n int, sd float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(r.NormFloat64() * sd)
	}
	return x
}

// read downloads an F32 tensor of n elements.
func (s *suite) read(t compute.Tensor, n int) []float32 {
	out := make([]float32, n)
	s.be.ReadF32(t, out)
	return out
}

// garbage returns an F32 tensor of n elements filled with a value no
// kernel produces, to check that forward outputs are overwritten.
func (s *suite) garbage(n int) compute.Tensor {
	x := make([]float32, n)
	for i := range x {
		x[i] = 1234.5
	}
	return s.be.FromF32(x)
}

func closeTo(t *testing.T, name string, got []float32, want []float64, atol, rtol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", name, len(got), len(want))
	}
	for i := range got {
		if d := math.Abs(float64(got[i]) - want[i]); !(d <= atol+rtol*math.Abs(want[i])) {
			t.Fatalf("%s[%d] = %.8g, want %.8g (|diff| %.3g > %.3g + %.3g·|want|)", name, i, got[i], want[i], d, atol, rtol)
		}
	}
}

func (s *suite) fwd(t *testing.T, name string, got []float32, want []float64) {
	t.Helper()
	closeTo(t, name, got, want, s.tol.FwdAtol, s.tol.FwdRtol)
}

func (s *suite) bwd(t *testing.T, name string, got []float32, want []float64) {
	t.Helper()
	closeTo(t, name, got, want, s.tol.BwdAtol, s.tol.BwdRtol)
}

// bwdStrided checks a gradient that started at init against the finite
// differences of f w.r.t. every stride-th element of x (a strided subset
// keeps O(n²) references affordable while touching every row and column
// class when the stride is prime to the shapes).
func (s *suite) bwdStrided(t *testing.T, name string, got, init []float32, f func() float64, x []float64, stride int) {
	t.Helper()
	var idx []int
	for i := 0; i < len(x); i += stride {
		idx = append(idx, i)
	}
	g := gradFDAt(f, x, idx, s.tol.FDStep)
	sub, want := make([]float32, len(idx)), make([]float64, len(idx))
	for n, i := range idx {
		sub[n], want[n] = got[i], g[n]+float64(init[i])
	}
	s.bwd(t, name, sub, want)
}

// plus returns want + init elementwise: what a += kernel must leave in a
// gradient that started at init.
func plus(want []float64, init []float32) []float64 {
	out := make([]float64, len(want))
	for i := range want {
		out[i] = want[i] + float64(init[i])
	}
	return out
}

func f64(x []float32) []float64 {
	y := make([]float64, len(x))
	for i, v := range x {
		y[i] = float64(v)
	}
	return y
}

func (s *suite) memory(t *testing.T) {
	be := s.be
	z := be.New(compute.F32, 5)
	if z.Len() != 5 || z.DType() != compute.F32 {
		t.Fatalf("New: len %d dtype %v", z.Len(), z.DType())
	}
	for i, v := range s.read(z, 5) {
		if v != 0 {
			t.Fatalf("New: element %d = %g, want 0", i, v)
		}
	}
	arena := be.FromF32([]float32{0, 1, 2, 3, 4, 5, 6, 7})
	v := be.View(arena, 2, 4)
	if v.Len() != 4 {
		t.Fatalf("View len %d, want 4", v.Len())
	}
	if got := s.read(v, 4); got[0] != 2 || got[3] != 5 {
		t.Fatalf("View reads %v, want [2 3 4 5]", got)
	}
	be.WriteF32(v, []float32{-1, -2})
	be.Zero(be.View(arena, 5, 2))
	be.Copy(be.View(arena, 0, 2), be.FromF32([]float32{9, 8}))
	want := []float32{9, 8, -1, -2, 4, 0, 0, 7}
	got := s.read(arena, 8)
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("arena after view writes = %v, want %v", got, want)
		}
	}
	be.Zero(arena)
	for i, x := range s.read(arena, 8) {
		if x != 0 {
			t.Fatalf("Zero: element %d = %g", i, x)
		}
	}
	ids := be.FromI32([]int32{3, -1, 7})
	iv := be.View(ids, 1, 2)
	gi := make([]int32, 2)
	be.ReadI32(iv, gi)
	if gi[0] != -1 || gi[1] != 7 || iv.DType() != compute.I32 {
		t.Fatalf("I32 view %v %v", gi, iv.DType())
	}
	w, err := be.Weight([]uint16{0x3f80, 0xc000}) // bf16 1, -2
	if err != nil {
		t.Fatal(err)
	}
	if got := s.read(w, 2); got[0] != 1 || got[1] != -2 {
		t.Fatalf("Weight(bf16) reads %v, want [1 -2]", got)
	}
	if _, err := be.Weight([]int8{1}); err == nil {
		t.Fatal("Weight([]int8): want an error")
	}
}

func (s *suite) matMul(t *testing.T) {
	be := s.be
	for _, bias := range []bool{false, true} {
		r := rand.New(rand.NewPCG(3, 4))
		m, n, k := 256, 65, 32
		x, w, R := randn(r, m*k, 1), randn(r, n*k, 0.3), randn(r, m*n, 1)
		var b []float32
		var bd []float64
		var bt compute.Tensor
		if bias {
			b = randn(r, n, 1)
			bd, bt = f64(b), be.FromF32(b)
		}
		xt, x := s.actIn(x)
		wt := be.FromF32(w)
		out := s.actOut(m * n)
		be.MatMul(out, xt, wt, bt, m, n, k)
		want := linear(f64(s.gemmIn(x)), f64(s.gemmIn(w)), bd, k, n)
		s.actFwd(t, "out", s.read(out, m*n), want)
		if s.act != compute.F32 {
			// An activation x into an F32 out (the residual stream's o and
			// down projections).
			out32 := s.garbage(m * n)
			be.MatMul(out32, xt, wt, bt, m, n, k)
			s.fwd(t, "out (f32)", s.read(out32, m*n), want)
		}
		if s.forwardOnly {
			continue
		}
		// dout in the activation dtype (a gradient only GEMMs read), but
		// with a bias to train: its column sums read the F32 gradient.
		Rt := be.FromF32(R)
		if !bias {
			Rt, R = s.actIn(R)
		} else if s.act != compute.F32 {
			func() {
				defer func() {
					if recover() == nil {
						t.Errorf("MatMulBackward with a %v dout and a dbias did not panic", s.act)
					}
				}()
				bt, _ := s.actIn(R)
				be.MatMulBackward(be.New(compute.F32, m*k), nil, be.New(compute.F32, n), bt, xt, wt, m, n, k)
			}()
		}
		xd, wd, Rd := f64(x), f64(w), f64(R)
		f := func() float64 { return dot(linear(xd, wd, bd, k, n), Rd) }
		dx0, dw0, db0 := randn(r, m*k, 1), randn(r, n*k, 1), randn(r, n, 1)
		// dx in the activation dtype (attention's dout, o_proj's dx): its
		// starting values rounded, the sum once more (tolerance below).
		dx, dx0 := s.actIn(dx0)
		dw := be.FromF32(dw0)
		var db compute.Tensor
		if bias {
			db = be.FromF32(db0)
		}
		be.MatMulBackward(dx, dw, db, Rt, xt, wt, m, n, k)
		if s.tol.BF16GEMM {
			// The backend multiplies BF16 roundings of dout, w and x: the
			// reference is the float64 product of the same roundings (the
			// finite differences of the unrounded f would measure BF16's
			// rounding, not the kernel).
			Rr, wr, xr := f64(s.gemmIn(R)), f64(s.gemmIn(w)), f64(s.gemmIn(x))
			wantDX, wantDW := make([]float64, m*k), make([]float64, n*k)
			for i := 0; i < m; i++ {
				for j := 0; j < n; j++ {
					g := Rr[i*n+j]
					for p := 0; p < k; p++ {
						wantDX[i*k+p] += g * wr[j*k+p]
						wantDW[j*k+p] += g * xr[i*k+p]
					}
				}
			}
			bx := *s
			bx.tol.BwdRtol = s.tol.BwdRtol + map[bool]float64{true: 1.0 / 256}[s.act == compute.BF16]
			bx.bwd(t, "dx (bf16 operands)", s.read(dx, m*k), plus(wantDX, dx0))
			s.bwd(t, "dw (bf16 operands)", s.read(dw, n*k), plus(wantDW, dw0))
		} else {
			bx := *s
			bx.tol.BwdRtol = s.tol.BwdRtol + map[bool]float64{true: 1.0 / 256}[s.act == compute.BF16]
			bx.bwdStrided(t, "dx", s.read(dx, m*k), dx0, f, xd, 61)
			s.bwdStrided(t, "dw", s.read(dw, n*k), dw0, f, wd, 17)
		}
		if bias {
			s.bwd(t, "dbias", s.read(db, n), plus(gradFD(f, bd, s.tol.FDStep), db0))
		}
		// dx and dbias are optional.
		dw2 := be.FromF32(dw0)
		be.MatMulBackward(nil, dw2, nil, Rt, xt, wt, m, n, k)
		if s.tol.BF16GEMM {
			s.bwd(t, "dw (no dx)", s.read(dw2, n*k), f64(s.read(dw, n*k))) // the same GEMM as above
		} else {
			s.bwdStrided(t, "dw (no dx)", s.read(dw2, n*k), dw0, f, wd, 37)
		}
	}
}

func (s *suite) embed(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(5, 6))
	V, C, N := 40, 64, 300
	ids := make([]int32, N) // repeated ids: their rows' gradients add up
	for i := range ids {
		ids[i] = int32(r.IntN(V))
	}
	wte, R := randn(r, V*C, 1), randn(r, N*C, 1)
	idt := be.FromI32(ids)
	out := s.garbage(N * C)
	be.Embed(out, be.FromF32(wte), idt, N, C)
	wd, Rd := f64(wte), f64(R)
	closeTo(t, "out", s.read(out, N*C), embedding(wd, ids, C), 0, 0)
	if s.forwardOnly {
		return
	}
	f := func() float64 { return dot(embedding(wd, ids, C), Rd) }
	d0 := randn(r, V*C, 1)
	dw := be.FromF32(d0)
	be.EmbedBackward(dw, be.FromF32(R), idt, N, C)
	s.bwd(t, "dtable", s.read(dw, V*C), plus(gradFD(f, wd, s.tol.FDStep), d0))
}

func (s *suite) rmsNorm(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(7, 8))
	N, C := 150, 129
	x, w, R := randn(r, N*C, 1), randn(r, C, 1), randn(r, N*C, 1)
	const eps = 1e-5
	xt, x := s.actIn(x)
	wt := be.FromF32(w)
	out, rstd := s.actOut(N*C), s.garbage(N)
	be.RMSNorm(out, rstd, xt, wt, N, C, eps)
	xd, wd, Rd := f64(x), f64(w), f64(R)
	s.actFwd(t, "out", s.read(out, N*C), rmsNorm(xd, wd, C, eps))
	wantR := rstdOf(xd, C, eps)
	s.fwd(t, "rstd", s.read(rstd, N), wantR)
	// In place (out = x) and without statistics.
	y, _ := s.actIn(x)
	be.RMSNorm(y, nil, y, wt, N, C, eps)
	s.actFwd(t, "out in place", s.read(y, N*C), rmsNorm(xd, wd, C, eps))
	if s.forwardOnly {
		return
	}

	f := func() float64 { return dot(rmsNorm(xd, wd, C, eps), Rd) }
	dx0, dw0 := randn(r, N*C, 1), randn(r, C, 1)
	// dx in the activation dtype (the q/k norms' input gradient, which
	// only GEMMs read): its starting values rounded, the sum once more.
	dx, dx0 := s.actIn(dx0)
	dw := be.FromF32(dw0)
	be.RMSNormBackward(dx, dw, be.FromF32(R), xt, wt, rstd, N, C)
	bs := *s
	bs.tol.BwdRtol = s.tol.BwdRtol + map[bool]float64{true: 1.0 / 256}[s.act == compute.BF16]
	bs.bwdStrided(t, "dx", s.read(dx, N*C), dx0, f, xd, 29)
	s.bwd(t, "dw", s.read(dw, C), plus(gradFD(f, wd, s.tol.FDStep), dw0))
	if g, ok := be.(compute.ActGrads); ok && s.act != compute.F32 {
		// The residual stream's gradient: F32 dx and its rounding beside
		// it, the rounding of each element of the new dx exactly.
		dx, dxc, dw := be.FromF32(dx0), be.New(s.act, N*C), be.FromF32(dw0)
		g.RMSNormBackwardCopy(dx, dxc, dw, be.FromF32(R), xt, wt, rstd, N, C)
		got := s.read(dx, N*C)
		s.bwdStrided(t, "dx (copy)", got, dx0, f, xd, 29)
		s.bwd(t, "dw (copy)", s.read(dw, C), plus(gradFD(f, wd, s.tol.FDStep), dw0))
		closeTo(t, "dxc = bf16(dx)", s.read(dxc, N*C), f64(bf16(got)), 0, 0)
	}
}

// rstdOf is RMSNorm's statistics of each dim-wide row of x:
// 1/sqrt(mean(x²) + eps).
func rstdOf(x []float64, dim int, eps float64) []float64 {
	r := make([]float64, len(x)/dim)
	for i := range r {
		var ss float64
		for _, v := range x[i*dim : (i+1)*dim] {
			ss += v * v
		}
		r[i] = 1 / math.Sqrt(ss/float64(dim)+eps)
	}
	return r
}

// ropeTable is the (tokens, hd/2) cos/sin table of the angles
// float32(pos·invFreq[i]), as the decoder builds it.
func ropeTable(pos []int32, inv []float32) (cos, sin []float32) {
	for _, p := range pos {
		for _, f := range inv {
			a := float64(float32(p) * f)
			cos = append(cos, float32(math.Cos(a)))
			sin = append(sin, float32(math.Sin(a)))
		}
	}
	return cos, sin
}

// ropeCase is n positions (the first few small, repeated and large, the
// rest random below 8192) and the inverse frequencies of head dim hd at
// base theta.
func ropeCase(r *rand.Rand, n, hd int, theta float64) ([]int32, []float32) {
	pos := []int32{0, 1, 2, 3, 0, 1, 500, 1000, 4095, 7, 2}
	for len(pos) < n {
		pos = append(pos, int32(r.IntN(8192)))
	}
	inv := make([]float32, hd/2)
	for i := range inv {
		inv[i] = float32(1 / math.Pow(theta, float64(2*i)/float64(hd)))
	}
	return pos, inv
}

func (s *suite) rope(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(9, 10))
	H, D := 4, 48
	pos, inv := ropeCase(r, 100, D, 10000)
	N := len(pos)
	cos, sin := ropeTable(pos, inv)
	ct, st := be.FromF32(cos), be.FromF32(sin)
	x, R := randn(r, N*H*D, 1), randn(r, N*H*D, 1)
	y, x := s.actIn(x)
	be.RoPE(y, ct, st, N, H, D)
	xd, Rd := f64(x), f64(R)
	s.actFwd(t, "out", s.read(y, N*H*D), rope(xd, pos, inv, H, D))
	if s.forwardOnly {
		return
	}
	f := func() float64 { return dot(rope(xd, pos, inv, H, D), Rd) }
	d := be.FromF32(R)
	be.RoPEBackward(d, ct, st, N, H, D)
	got := s.read(d, N*H*D)
	s.bwdStrided(t, "dx (in place)", got, make([]float32, N*H*D), f, xd, 13)
	if g, ok := be.(compute.ActGrads); ok && s.act != compute.F32 {
		// Llama's q/k projections' douts: the rotated F32 dx and its
		// rounding beside it, exactly, the F32 one as RoPEBackward's.
		d, dc := be.FromF32(R), be.New(s.act, N*H*D)
		g.RoPEBackwardCopy(d, dc, ct, st, N, H, D)
		got2 := s.read(d, N*H*D)
		closeTo(t, "dx (copy) = RoPEBackward's", got2, f64(got), 0, 0)
		closeTo(t, "dxc = bf16(dx)", s.read(dc, N*H*D), f64(bf16(got2)), 0, 0)
	}
}

// rmsNormRoPE: the per-head norm then the rotation, against the float64
// formulas of both, with and without statistics, and in place (Qwen3's
// q/k norm; head dims 64 and 256, hd/2 beyond a warp's 32 lanes).
func (s *suite) rmsNormRoPE(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(33, 34))
	const eps = 1e-6
	for _, sh := range [][2]int{{4, 64}, {2, 256}} {
		H, D := sh[0], sh[1]
		pos, inv := ropeCase(r, 40, D, 1e6)
		N := len(pos)
		cos, sin := ropeTable(pos, inv)
		ct, st := be.FromF32(cos), be.FromF32(sin)
		x, w := randn(r, N*H*D, 1), randn(r, D, 1)
		xt, x := s.actIn(x)
		wt := be.FromF32(w)
		want := rope(rmsNorm(f64(x), f64(w), D, eps), pos, inv, H, D)
		out, rstd := s.actOut(N*H*D), s.garbage(N*H)
		be.RMSNormRoPE(out, rstd, xt, wt, ct, st, N, H, D, eps)
		s.actFwd(t, "out", s.read(out, N*H*D), want)
		xd := f64(x)
		wantR := rstdOf(xd, D, eps)
		s.fwd(t, "rstd", s.read(rstd, N*H), wantR)
		y, _ := s.actIn(x)
		be.RMSNormRoPE(y, nil, y, wt, ct, st, N, H, D, eps)
		s.actFwd(t, "out in place", s.read(y, N*H*D), want)
	}
}

// attention covers GQA (4 query heads on 2 kv heads), samples of lengths
// that straddle the query blocks of the CPU kernels (64 and 128), and a
// one-token sample.
func (s *suite) attention(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(11, 12))
	lens := []int{1, 70, 4, 129, 2}
	starts := []int32{0}
	maxLen := 0
	for _, l := range lens {
		starts = append(starts, starts[len(starts)-1]+int32(l))
		maxLen = max(maxLen, l)
	}
	N := int(starts[len(starts)-1])
	H, KV, D := 4, 2, 8
	q, k, v := randn(r, N*H*D, 1), randn(r, N*KV*D, 1), randn(r, N*KV*D, 1)
	R := randn(r, N*H*D, 1)
	scale := 1 / math.Sqrt(float64(D))
	qt, q := s.actIn(q)
	kt, k := s.actIn(k)
	vt, v := s.actIn(v)
	stt := be.FromI32(starts)
	out, lse := s.actOut(N*H*D), s.garbage(N*H)
	be.Attention(out, lse, qt, kt, vt, stt, len(lens), maxLen, N, H, KV, D, float32(scale))
	qd, kd, vd, Rd := f64(q), f64(k), f64(v), f64(R)
	fwdOut := s.actFwd
	if s.tol.BF16Attention {
		qd, kd, vd, Rd = f64(bf16(q)), f64(bf16(k)), f64(bf16(v)), f64(bf16(R))
		fwdOut = func(t *testing.T, name string, got []float32, want []float64) {
			t.Helper()
			closeTo(t, name, got, want, s.tol.AttnAtol, s.tol.AttnRtol)
		}
	}
	fwdOut(t, "out", s.read(out, N*H*D), attention(qd, kd, vd, starts, H, KV, D, scale))
	s.fwd(t, "lse", s.read(lse, N*H), attentionLSE(qd, kd, starts, H, KV, D, scale))
	out2 := s.actOut(N * H * D)
	be.Attention(out2, nil, qt, kt, vt, stt, len(lens), maxLen, N, H, KV, D, float32(scale))
	fwdOut(t, "out (no lse)", s.read(out2, N*H*D), attention(qd, kd, vd, starts, H, KV, D, scale))
	if s.forwardOnly {
		return
	}

	dq0, dk0, dv0 := randn(r, N*H*D, 1), randn(r, N*KV*D, 1), randn(r, N*KV*D, 1)
	dq, dk := be.FromF32(dq0), be.FromF32(dk0)
	dv, dv0 := s.actIn(dv0) // dv in the activation dtype (only v_proj's backward reads it)
	// dout too (o_proj's dx): the references from the values it holds.
	Rt, Rin := s.actIn(R)
	if !s.tol.BF16Attention {
		Rd = f64(Rin)
	}
	be.AttentionBackward(dq, dk, dv, Rt, qt, kt, vt, out, lse, stt, len(lens), maxLen, N, H, KV, D, float32(scale))
	f := func() float64 { return dot(attention(qd, kd, vd, starts, H, KV, D, scale), Rd) }
	bs := s
	if s.tol.BF16Attention {
		c := *s
		c.tol.BwdAtol, c.tol.BwdRtol = s.tol.AttnAtol, s.tol.AttnRtol
		bs = &c
	}
	bs.bwdStrided(t, "dq", s.read(dq, N*H*D), dq0, f, qd, 29)
	bs.bwdStrided(t, "dk", s.read(dk, N*KV*D), dk0, f, kd, 23)
	if s.act == compute.BF16 {
		c := *bs
		c.tol.BwdRtol += 1.0 / 256
		bs = &c
	}
	bs.bwdStrided(t, "dv", s.read(dv, N*KV*D), dv0, f, vd, 23)
}

func (s *suite) swiGLU(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(13, 14))
	n := 10007
	g, u, R := randn(r, n, 2), randn(r, n, 1), randn(r, n, 1)
	for i := 0; i < 20; i++ {
		g[i] = float32(-90 + 9*i) // saturating inputs
	}
	gt, g := s.actIn(g)
	ut, u := s.actIn(u)
	out := s.actOut(n)
	be.SwiGLU(out, gt, ut, n)
	gd, ud, Rd := f64(g), f64(u), f64(R)
	s.actFwd(t, "out", s.read(out, n), swiGLU(gd, ud))
	in, _ := s.actIn(g)
	be.SwiGLU(in, in, ut, n)
	s.actFwd(t, "out in place", s.read(in, n), swiGLU(gd, ud))
	if s.forwardOnly {
		return
	}
	// The finite differences run on a prefix (each costs a pass over n).
	m := 60
	f := func() float64 { return dot(swiGLU(gd[:m], ud[:m]), Rd[:m]) }
	// dgate and dup in the activation dtype (only GEMMs read them).
	dg, dg0 := s.actIn(randn(r, n, 1))
	du, du0 := s.actIn(randn(r, n, 1))
	be.SwiGLUBackward(dg, du, be.FromF32(R), gt, ut, n)
	s.actBwd(t, "dgate", s.read(dg, n)[:m], plus(gradFD(f, gd[:m], s.tol.FDStep), dg0[:m]))
	s.actBwd(t, "dup", s.read(du, n)[:m], plus(gradFD(f, ud[:m], s.tol.FDStep), du0[:m]))
}

func (s *suite) add(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(15, 16))
	n := 10007
	a, b := randn(r, n, 1), randn(r, n, 1)
	at := be.FromF32(a)
	be.Add(at, be.FromF32(b), n)
	want := make([]float64, n)
	for i := range want {
		want[i] = float64(a[i] + b[i])
	}
	closeTo(t, "a+b", s.read(at, n), want, 0, 0)
}

// addRMSNorm: the sum exactly as Add leaves it (fp32, written back into
// a), the norm of the sum as RMSNorm's formula (shapes on both sides of
// the CUDA backend's warp/block split).
func (s *suite) addRMSNorm(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(31, 32))
	for _, sh := range [][2]int{{150, 129}, {9, 2056}} {
		N, C := sh[0], sh[1]
		a, b, w := randn(r, N*C, 1), randn(r, N*C, 1), randn(r, C, 1)
		const eps = 1e-6
		at, bt, wt := be.FromF32(a), be.FromF32(b), be.FromF32(w)
		out, rstd := s.actOut(N*C), s.garbage(N)
		be.AddRMSNorm(out, rstd, at, bt, wt, N, C, eps)
		sum := make([]float64, N*C)
		for i := range sum {
			sum[i] = float64(a[i] + b[i])
		}
		closeTo(t, "a+b", s.read(at, N*C), sum, 0, 0)
		s.actFwd(t, "out", s.read(out, N*C), rmsNorm(sum, f64(w), C, eps))
		wantR := rstdOf(sum, C, eps)
		s.fwd(t, "rstd", s.read(rstd, N), wantR)
		// Without statistics.
		at2 := be.FromF32(a)
		out2 := s.actOut(N * C)
		be.AddRMSNorm(out2, nil, at2, bt, wt, N, C, eps)
		s.actFwd(t, "out (no rstd)", s.read(out2, N*C), rmsNorm(sum, f64(w), C, eps))
	}
}

func (s *suite) adamW(t *testing.T) {
	be := s.be
	const b1, b2, eps, wd = 0.9, 0.95, 1e-8, 0.1
	p0 := []float32{1, -2, 0.5, 0.25}
	grads := [][]float32{{0.1, -0.3, 0.0, 2}, {-0.2, 0.1, 1e-3, -1}, {0.05, 0.05, -0.5, 0.5}, {1, -1, 0.2, 0}}
	lrs := []float64{1e-2, 2e-2, 5e-3, 1e-2}
	pt, gt, mt, vt := be.FromF32(p0), be.New(compute.F32, 4), be.New(compute.F32, 4), be.New(compute.F32, 4)
	want, m, v := f64(p0), make([]float64, 4), make([]float64, 4)
	for st, g := range grads {
		be.WriteF32(gt, g)
		lr, tt := lrs[st], float64(st+1)
		be.AdamW(pt, gt, mt, vt, 4, compute.AdamWStep{Beta1: b1, Beta2: b2, Eps: eps,
			StepSize: float32(lr / (1 - math.Pow(b1, tt))), BC2Sqrt: float32(math.Sqrt(1 - math.Pow(b2, tt))), Decay: float32(1 - lr*wd)})
		for i := range want {
			gi := float64(g[i])
			want[i] *= 1 - lr*wd
			m[i] = b1*m[i] + (1-b1)*gi
			v[i] = b2*v[i] + (1-b2)*gi*gi
			mh, vh := m[i]/(1-math.Pow(b1, tt)), v[i]/(1-math.Pow(b2, tt))
			want[i] -= lr * mh / (math.Sqrt(vh) + eps)
		}
		closeTo(t, "p", s.read(pt, 4), want, 1e-7, 1e-6)
		closeTo(t, "m", s.read(mt, 4), m, 1e-7, 1e-6)
		closeTo(t, "v", s.read(vt, 4), v, 1e-9, 1e-6)
	}
	// One step over many elements (the parallel path), from random state.
	r := rand.New(rand.NewPCG(31, 32))
	n := 10007
	p, g, m0, v0 := randn(r, n, 1), randn(r, n, 1), randn(r, n, 0.1), randn(r, n, 0.1)
	for i := range v0 {
		v0[i] *= v0[i]
	}
	pt, gt, mt, vt = be.FromF32(p), be.FromF32(g), be.FromF32(m0), be.FromF32(v0)
	st := compute.AdamWStep{Beta1: b1, Beta2: b2, Eps: eps, StepSize: 0.01, BC2Sqrt: 0.5, Decay: 0.999}
	be.AdamW(pt, gt, mt, vt, n, st)
	wp, wm, wv := make([]float64, n), make([]float64, n), make([]float64, n)
	for i := range wp {
		gi := float64(g[i])
		wm[i] = b1*float64(m0[i]) + (1-b1)*gi
		wv[i] = b2*float64(v0[i]) + (1-b2)*gi*gi
		wp[i] = float64(p[i])*float64(st.Decay) - float64(st.StepSize)*wm[i]/(math.Sqrt(wv[i])/float64(st.BC2Sqrt)+eps)
	}
	closeTo(t, "p (n=10007)", s.read(pt, n), wp, 1e-6, 1e-5)
	closeTo(t, "m (n=10007)", s.read(mt, n), wm, 1e-7, 1e-6)
	closeTo(t, "v (n=10007)", s.read(vt, n), wv, 1e-9, 1e-6)
}

func (s *suite) sumSquaresScale(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(17, 18))
	n := 100003
	x := randn(r, n, 1)
	xt := be.FromF32(x)
	var want float64
	for _, v := range x {
		want += float64(v) * float64(v)
	}
	if got := be.SumSquares(xt, n); math.Abs(got-want) > 1e-9*want {
		t.Fatalf("SumSquares = %.12g, want %.12g", got, want)
	}
	if got := be.SumSquares(be.View(xt, 0, 1), 1); got != float64(x[0])*float64(x[0]) {
		t.Fatalf("SumSquares of one = %g", got)
	}
	be.Scale(xt, n, 0.5)
	got := s.read(xt, n)
	for i := range x {
		if got[i] != x[i]*0.5 {
			t.Fatalf("Scale[%d] = %g, want %g", i, got[i], x[i]*0.5)
		}
	}
	x[n/2] = float32(math.NaN())
	if got := be.SumSquares(be.FromF32(x), n); !math.IsNaN(got) {
		t.Fatalf("SumSquares with a NaN = %g, want NaN", got)
	}
	x[n/2] = float32(math.Inf(-1))
	if got := be.SumSquares(be.FromF32(x), n); !math.IsInf(got, 1) {
		t.Fatalf("SumSquares with -Inf = %g, want +Inf", got)
	}
}

func (s *suite) absMax(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(19, 20))
	n := 50001
	x := randn(r, n, 1)
	x[777] = -9.5
	if xt, _ := s.actIn(x); be.AbsMax(xt, n) != 9.5 {
		t.Fatalf("AbsMax = %g, want 9.5", be.AbsMax(xt, n))
	}
	if got := be.AbsMax(be.New(s.act, 7), 7); got != 0 {
		t.Fatalf("AbsMax of zeros = %g", got)
	}
	x[n-1] = float32(math.NaN())
	if xt, _ := s.actIn(x); !math.IsNaN(float64(be.AbsMax(xt, n))) {
		got := be.AbsMax(xt, n)
		t.Fatalf("AbsMax with a NaN = %g, want NaN (calibration must fail loudly)", got)
	}
}

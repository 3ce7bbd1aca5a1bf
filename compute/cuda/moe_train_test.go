package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
)

// moeTrainCase is a Qwen3-MoE block for MoEForward/MoEBackward: x and the
// weights are BF16 values (so the device's BF16 GEMM operands are exact
// and only its intermediate roundings and summation orders differ from
// the CPU), held as F32 tensors as the student holds its parameters.
type moeTrainCase struct {
	T, H, I, E, K  int
	norm, dprob    bool
	frozen         bool // MoEBackward with no gradients (dm nil): dx alone
	inAmax, hAmax  float32
	starve         int // an expert no token picks (-1: none)
	x, router      []float32
	gate, up, down [][]float32
	dout, dp       []float32
	dx0, dr0       []float32
	dg0, du0, dd0  [][]float32
}

func newMoETrainCase(r *rand.Rand, T, H, I, E, K int, norm, dprob bool, starve int) *moeTrainCase {
	c := &moeTrainCase{T: T, H: H, I: I, E: E, K: K, norm: norm, dprob: dprob, starve: starve}
	c.x, _ = roundBF16(randF32(r, T*H))
	c.router = randF32(r, E*H)
	if starve >= 0 {
		// x[:,0] = 1 and a router weight of -40 there: expert starve's logit
		// is 40 below the others' (|x·w| <= H), so it is never picked.
		for t := 0; t < T; t++ {
			c.x[t*H] = 1
		}
		c.router[starve*H] = -40
	}
	for e := 0; e < E; e++ {
		g, _ := roundBF16(randF32(r, I*H))
		u, _ := roundBF16(randF32(r, I*H))
		d, _ := roundBF16(randF32(r, H*I))
		c.gate, c.up, c.down = append(c.gate, g), append(c.up, u), append(c.down, d)
		c.dg0, c.du0, c.dd0 = append(c.dg0, randF32(r, I*H)), append(c.du0, randF32(r, I*H)), append(c.dd0, randF32(r, H*I))
	}
	c.dout, c.dp = randF32(r, T*H), randF32(r, E)
	c.dx0, c.dr0 = randF32(r, T*H), randF32(r, E*H)
	return c
}

// moeTrainResult is everything MoEForward and MoEBackward produce.
type moeTrainResult struct {
	out, probs, wts, gate, up, y []float32
	sel, order, offsets          []int32
	dx, drouter                  []float32
	dgate, dup, ddown            [][]float32
}

// run runs MoEForward then MoEBackward on be, from the case's non-zero
// gradients (the += rule), with dprob when withDprob.
func (c *moeTrainCase) run(be compute.Backend, withDprob bool) *moeTrainResult {
	T, H, I, E, K := c.T, c.H, c.I, c.E, c.K
	mw := &compute.MoEWeights{Router: be.FromF32(c.router), NumExperts: E, TopK: K, Hidden: H, Inter: I, NormTopK: c.norm,
		InAmax: c.inAmax, HAmax: c.hAmax}
	dm := &compute.MoEWeights{Router: be.FromF32(c.dr0), NumExperts: E, TopK: K, Hidden: H, Inter: I}
	for e := 0; e < E; e++ {
		mw.Gate, mw.Up, mw.Down = append(mw.Gate, be.FromF32(c.gate[e])), append(mw.Up, be.FromF32(c.up[e])), append(mw.Down, be.FromF32(c.down[e]))
		dm.Gate, dm.Up, dm.Down = append(dm.Gate, be.FromF32(c.dg0[e])), append(dm.Up, be.FromF32(c.du0[e])), append(dm.Down, be.FromF32(c.dd0[e]))
	}
	nf, ni := compute.MoESavedSizes(T, E, K, H, I)
	s := compute.NewMoESaved(be, be.New(compute.F32, nf), be.New(compute.I32, ni), T, E, K, H, I)
	x := be.FromF32(c.x)
	out := be.FromF32(make([]float32, T*H))
	be.MoEForward(out, x, mw, s, T)
	res := &moeTrainResult{out: readF32(be, out, T*H), probs: readF32(be, s.Probs, T*E), wts: readF32(be, s.Wts, T*K),
		gate: readF32(be, s.Gate, T*K*I), up: readF32(be, s.Up, T*K*I), y: readF32(be, s.Y, T*K*H),
		sel: make([]int32, T*K), order: make([]int32, T*K), offsets: make([]int32, E+1)}
	be.ReadI32(s.Sel, res.sel)
	be.ReadI32(s.Order, res.order)
	be.ReadI32(s.Offsets, res.offsets)
	var dp compute.Tensor
	if withDprob {
		dp = be.FromF32(c.dp)
	}
	dx := be.FromF32(c.dx0)
	if c.frozen {
		be.MoEBackward(dx, nil, be.FromF32(c.dout), x, mw, s, dp, T)
		res.dx = readF32(be, dx, T*H)
		return res
	}
	be.MoEBackward(dx, dm, be.FromF32(c.dout), x, mw, s, dp, T)
	res.dx, res.drouter = readF32(be, dx, T*H), readF32(be, dm.Router, E*H)
	for e := 0; e < E; e++ {
		res.dgate = append(res.dgate, readF32(be, dm.Gate[e], I*H))
		res.dup = append(res.dup, readF32(be, dm.Up[e], I*H))
		res.ddown = append(res.ddown, readF32(be, dm.Down[e], H*I))
	}
	return res
}

// gradClose checks a gradient that started at init against the CPU's,
// elementwise: |got-want| <= rel·max|want-init| + rtol·|want|. The BF16
// roundings of the backward's GEMM operands err in proportion to the
// gradient's scale (the largest entry of what the kernel added), not to
// each entry: a small entry is a cancellation of large terms.
func gradClose(t *testing.T, what string, got, want, init []float32, rel, rtol float64) {
	t.Helper()
	scale := 0.0
	for i := range want {
		scale = max(scale, math.Abs(float64(want[i])-float64(init[i])))
	}
	closeTo(t, what, got, want, rel*scale, rtol)
}

// diff is a - b elementwise.
func diff(a, b []float32) []float32 {
	d := make([]float32, len(a))
	for i := range a {
		d[i] = a[i] - b[i]
	}
	return d
}

// TestMoETrainConformance: MoEForward and MoEBackward against compute/cpu
// on the same BF16-valued x and weights: with and without NormTopK and
// dprob, NVFP4 QAD on, an expert that no token picks (its GEMMs skipped,
// its gradients untouched), token counts that are multiples of nothing,
// top-8 of 128 experts.
//
// Exact: Sel, Order (the stable grouping), Offsets. fp32 against fp32
// (the router): Probs and Wts at 1e-6 + 1e-5 relative. Gate and Up: BF16
// GEMMs of exact operands, only the accumulation order differs: 1e-4.
// Y and the output: the device rounds the SwiGLU activations to BF16
// (2⁻⁹ relative, an I-term sum): bf16DotTol(I) + 1e-2 relative. The
// gradients: the device also rounds dY, the activations and their
// gradients for its GEMMs, errors proportional to each gradient's scale:
// 2% of its largest entry (measured worst below 0.5%), 1e-2 relative.
// The dprob term is checked on its own and tightly: the difference of
// the runs with and without dprob goes through the fp32 router only
// (1e-5 plus 4 fp32 ulps of the largest gradient entry, rtol 1e-3).
// Under QAD the amaxes are 2688·2⁻¹⁰, so the NVFP4 scales are powers of
// two and the quantized values BF16-exact: the device's quantization is
// held to the CPU's at the GEMM tolerances.
func TestMoETrainConformance(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(61, 62))
	type cfg struct {
		T, H, I, E, K int
		norm, dprob   bool
		qad           bool
		starve        int
	}
	cfgs := []cfg{
		{53, 16, 24, 6, 2, false, true, false, -1},
		{53, 16, 24, 6, 2, true, false, false, -1},
		{37, 32, 20, 8, 3, true, true, false, 5},
		{29, 48, 40, 5, 2, false, true, true, 1},
		{37, 64, 40, 128, 8, true, true, false, -1},
		{1, 16, 8, 4, 4, false, true, false, -1},
	}
	for _, cf := range cfgs {
		name := fmt.Sprintf("T%d_H%d_I%d_E%d_K%d_norm%v_dprob%v_qad%v_starve%d", cf.T, cf.H, cf.I, cf.E, cf.K, cf.norm, cf.dprob, cf.qad, cf.starve)
		t.Run(name, func(t *testing.T) {
			c := newMoETrainCase(r, cf.T, cf.H, cf.I, cf.E, cf.K, cf.norm, cf.dprob, cf.starve)
			if cf.qad {
				c.inAmax, c.hAmax = 2688.0/1024, 2688.0/1024
			}
			got, want := c.run(be, cf.dprob), c.run(oracle, cf.dprob)
			if !equalI32(got.sel, want.sel) {
				t.Fatalf("Sel %v, cpu %v", got.sel, want.sel)
			}
			if !equalI32(got.offsets, want.offsets) {
				t.Fatalf("Offsets %v, cpu %v", got.offsets, want.offsets)
			}
			if !equalI32(got.order, want.order) {
				t.Fatalf("Order %v, cpu %v (want each expert's pairs in token order)", got.order, want.order)
			}
			if cf.starve >= 0 && got.offsets[cf.starve] != got.offsets[cf.starve+1] {
				t.Fatalf("expert %d got rows %d..%d: the case must starve it", cf.starve, got.offsets[cf.starve], got.offsets[cf.starve+1])
			}
			closeTo(t, "Probs", got.probs, want.probs, 1e-6, 1e-5)
			closeTo(t, "Wts", got.wts, want.wts, 1e-6, 1e-5)
			closeTo(t, "Gate", got.gate, want.gate, 1e-4, 1e-4)
			closeTo(t, "Up", got.up, want.up, 1e-4, 1e-4)
			if cf.qad { // the quantized activations are BF16-exact
				closeTo(t, "Y", got.y, want.y, 1e-4, 1e-4)
				closeTo(t, "out", got.out, want.out, 1e-4, 1e-4)
			} else {
				gradClose(t, "Y", got.y, want.y, make([]float32, len(want.y)), 1e-2, 1e-2)
				gradClose(t, "out", got.out, want.out, make([]float32, len(want.out)), 1e-2, 1e-2)
			}

			gradClose(t, "dx", got.dx, want.dx, c.dx0, 2e-2, 1e-2)
			gradClose(t, "dRouter", got.drouter, want.drouter, c.dr0, 2e-2, 1e-2)
			for e := 0; e < cf.E; e++ {
				gradClose(t, fmtf("dGate[%d]", e), got.dgate[e], want.dgate[e], c.dg0[e], 2e-2, 1e-2)
				gradClose(t, fmtf("dUp[%d]", e), got.dup[e], want.dup[e], c.du0[e], 2e-2, 1e-2)
				gradClose(t, fmtf("dDown[%d]", e), got.ddown[e], want.ddown[e], c.dd0[e], 2e-2, 1e-2)
			}
			if cf.starve >= 0 { // no rows: its gradients stay as they were
				same(t, "dGate of the starved expert", got.dgate[cf.starve], c.dg0[cf.starve])
				same(t, "dUp of the starved expert", got.dup[cf.starve], c.du0[cf.starve])
				same(t, "dDown of the starved expert", got.ddown[cf.starve], c.dd0[cf.starve])
			}

			// Deterministic: the same bits again.
			again := c.run(be, cf.dprob)
			same(t, "MoEForward out", got.out, again.out)
			same(t, "MoEBackward dx", got.dx, again.dx)
			same(t, "MoEBackward dRouter", got.drouter, again.drouter)
			for e := 0; e < cf.E; e++ {
				same(t, "MoEBackward dGate", got.dgate[e], again.dgate[e])
				same(t, "MoEBackward dDown", got.ddown[e], again.ddown[e])
			}

			if cf.dprob {
				// dprob's part alone: p·(dprob - p·dprob) through the router's
				// fp32 GEMMs; the expert terms cancel (the same bits twice).
				// Each run rounds values up to max|want| in fp32: allow 4 ulps
				// of that beside 1e-5.
				gn, wn := c.run(be, false), c.run(oracle, false)
				ulps := func(v []float32) float64 {
					m := 0.0
					for _, x := range v {
						m = max(m, math.Abs(float64(x)))
					}
					return 1e-5 + 4*math.Ldexp(m, -23)
				}
				closeTo(t, "dx's dprob term", diff(got.dx, gn.dx), diff(want.dx, wn.dx), ulps(want.dx), 1e-3)
				closeTo(t, "dRouter's dprob term", diff(got.drouter, gn.drouter), diff(want.drouter, wn.drouter), ulps(want.drouter), 1e-3)
			}
		})
	}
}

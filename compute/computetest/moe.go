package computetest

import (
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
	"distill/compute/ref"
)

// moeCase is a random Qwen3-MoE block on the backend with its float64
// copies.
type moeCase struct {
	T, H, I, E, K int
	norm          bool
	x, router     []float32
	gs, us, ds    [][]float32
	mw            *compute.MoEWeights
	xt            compute.Tensor
	xd, rd        []float64
	gd, ud, dd    [][]float64
	saved         *compute.MoESaved
	// xoff is the experts' input rounding (BF16GEMM; else 0): the experts
	// read x + xoff, the router x, and a perturbation of x reaches both.
	xoff           []float64
	farena, iarena compute.Tensor
}

func (s *suite) newMoECase(r *rand.Rand, T, H, I, E, K int, norm bool) *moeCase {
	be := s.be
	c := &moeCase{T: T, H: H, I: I, E: E, K: K, norm: norm, x: randn(r, T*H, 1), router: randn(r, E*H, 1)}
	c.mw = &compute.MoEWeights{Router: be.FromF32(c.router), NumExperts: E, TopK: K, Hidden: H, Inter: I, NormTopK: norm}
	for e := 0; e < E; e++ {
		g, u, d := randn(r, I*H, 0.5), randn(r, I*H, 0.5), randn(r, H*I, 0.5)
		c.gs, c.us, c.ds = append(c.gs, g), append(c.us, u), append(c.ds, d)
		// The float64 copies are the weights as the backend multiplies
		// them (BF16-rounded under BF16GEMM): the references below and
		// the finite differences use these.
		c.gd, c.ud, c.dd = append(c.gd, f64(s.gemmIn(g))), append(c.ud, f64(s.gemmIn(u))), append(c.dd, f64(s.gemmIn(d)))
		c.mw.Gate = append(c.mw.Gate, be.FromF32(g))
		c.mw.Up = append(c.mw.Up, be.FromF32(u))
		c.mw.Down = append(c.mw.Down, be.FromF32(d))
	}
	c.xt, c.xd, c.rd = be.FromF32(c.x), f64(c.x), f64(c.router)
	c.xoff = make([]float64, T*H)
	for i, v := range s.gemmIn(c.x) {
		c.xoff[i] = float64(v) - c.xd[i]
	}
	nf, ni := compute.MoESavedSizes(T, E, K, H, I)
	c.farena, c.iarena = s.garbage(nf), be.New(compute.I32, ni)
	c.saved = compute.NewMoESaved(be, c.farena, c.iarena, T, E, K, H, I)
	return c
}

// xe is the experts' input as the backend multiplies it: x plus its
// rounding, so that finite differences of x move it with x (the
// straight-through view of the rounding).
func (c *moeCase) xe() []float64 {
	xe := make([]float64, len(c.xd))
	for i, v := range c.xd {
		xe[i] = v + c.xoff[i]
	}
	return xe
}

// moeOut is the block's output as a backend computes it (ref.MoE, with
// the experts' SwiGLU activations rounded to BF16 under BF16GEMM, as the
// backend rounds the down projection's input): x feeds the router, xe the
// experts.
func (s *suite) moeOut(c *moeCase, x, xe []float64) []float64 {
	var round func([]float64)
	if s.tol.BF16GEMM {
		round = func(act []float64) {
			for i, v := range act {
				act[i] = float64(compute.BF16ToF32(compute.F32ToBF16(float32(v))))
			}
		}
	}
	return ref.MoERounded(x, xe, c.rd, c.gd, c.ud, c.dd, c.E, c.K, c.H, c.I, c.norm, round)
}

// moeBwd checks a MoE gradient against finite differences: elementwise
// with the backward tolerances, or, for a backend that sets MoEBwdRel
// (BF16: its backward rounds the GEMMs' operands too, the experts' output
// gradients, activations and their gradients, which the smooth reference
// cannot), norm-wise: every |got-want| <= MoEBwdRel·max|want|. The
// rounding errors of the large routing-weight gradients (dout·Y) reach
// every router gradient, large or small, so an elementwise relative bound
// would measure the smallest elements' cancellation, not the kernel.
func (s *suite) moeBwd(t *testing.T, name string, got, init []float32, f func() float64, x []float64, stride int) {
	t.Helper()
	if s.tol.MoEBwdRel == 0 {
		s.bwdStrided(t, name, got, init, f, x, stride)
		return
	}
	var idx []int
	for i := 0; i < len(x); i += stride {
		idx = append(idx, i)
	}
	g := gradFDAt(f, x, idx, s.tol.FDStep)
	sub, want := make([]float32, len(idx)), make([]float64, len(idx))
	scale := 0.0
	for n, i := range idx {
		// The gradient proper, without the += rule's init: its scale is
		// what the rounding errors scale with.
		scale = max(scale, math.Abs(g[n]))
		sub[n], want[n] = got[i], g[n]+float64(init[i])
	}
	closeTo(t, name, sub, want, s.tol.MoEBwdRel*scale, 0)
}

// moeBackward checks MoEForward (the output and what it saves) against the
// float64 block and MoEBackward against central finite differences of
// L = Σ R·moe(x) + Σ_{t,e} dprob_e·p[t,e], router included, with and
// without norm_topk_prob, from non-zero gradients (the += rule); then the
// straight-through backward under NVFP4 fake quantization of the experts'
// input. A frozen backward (dm nil) must give the same dx bit for bit.
// Backends that cannot train MoE yet skip this subtest by name.
func (s *suite) moeBackward(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(41, 42))
	for _, norm := range []bool{false, true} {
		T, H, I, E, K := 40, 16, 24, 6, 2
		c := s.newMoECase(r, T, H, I, E, K, norm)
		out := s.garbage(T * H)
		be.MoEForward(out, c.xt, c.mw, c.saved, T)
		closeTo(t, "moe out", s.read(out, T*H), s.moeOut(c, c.xd, c.xe()), s.tol.MoEAtol, s.tol.MoERtol)
		probs := ref.MoEProbs(c.xd, c.rd, E, H)
		s.fwd(t, "probs", s.read(c.saved.Probs, T*E), probs)
		sel := make([]int32, T*K)
		be.ReadI32(c.saved.Sel, sel)
		off := make([]int32, E+1)
		be.ReadI32(c.saved.Offsets, off)
		order := make([]int32, T*K)
		be.ReadI32(c.saved.Order, order)
		for ti := 0; ti < T; ti++ {
			for j, e := range ref.TopK(probs[ti*E:(ti+1)*E], K) {
				if int(sel[ti*K+j]) != e {
					t.Fatalf("token %d slot %d: expert %d, want %d", ti, j, sel[ti*K+j], e)
				}
			}
		}
		for e := 0; e < E; e++ {
			for i := off[e]; i < off[e+1]; i++ {
				if sel[order[i]] != int32(e) || (i > off[e] && order[i] <= order[i-1]) {
					t.Fatalf("grouped row %d (expert %d's rows [%d,%d)) holds pair %d of expert %d: want expert %d's pairs in token order", i, e, off[e], off[e+1], order[i], sel[order[i]], e)
				}
			}
		}
		if off[0] != 0 || off[E] != int32(T*K) {
			t.Fatalf("offsets %v: want 0 .. %d", off, T*K)
		}

		R, dprob := randn(r, T*H, 1), randn(r, E, 1)
		Rd, dpd := f64(R), f64(dprob)
		f := func() float64 {
			l := dot(ref.MoE(c.xd, c.xe(), c.rd, c.gd, c.ud, c.dd, E, K, H, I, norm), Rd)
			p := ref.MoEProbs(c.xd, c.rd, E, H)
			for i, v := range p {
				l += dpd[i%E] * v
			}
			return l
		}
		dx0, dr0 := randn(r, T*H, 1), randn(r, E*H, 1)
		dm := &compute.MoEWeights{Router: be.FromF32(dr0)}
		var dg0, du0, dd0 [][]float32
		for e := 0; e < E; e++ {
			g, u, d := randn(r, I*H, 1), randn(r, I*H, 1), randn(r, H*I, 1)
			dg0, du0, dd0 = append(dg0, g), append(du0, u), append(dd0, d)
			dm.Gate = append(dm.Gate, be.FromF32(g))
			dm.Up = append(dm.Up, be.FromF32(u))
			dm.Down = append(dm.Down, be.FromF32(d))
		}
		dx := be.FromF32(dx0)
		be.MoEBackward(dx, dm, be.FromF32(R), c.xt, c.mw, c.saved, be.FromF32(dprob), T)
		s.moeBwd(t, "dx", s.read(dx, T*H), dx0, f, c.xd, 7)
		s.moeBwd(t, "drouter", s.read(dm.Router, E*H), dr0, f, c.rd, 5)
		for e := 0; e < E; e++ {
			s.moeBwd(t, "dgate", s.read(dm.Gate[e], I*H), dg0[e], f, c.gd[e], 11)
			s.moeBwd(t, "dup", s.read(dm.Up[e], I*H), du0[e], f, c.ud[e], 11)
			s.moeBwd(t, "ddown", s.read(dm.Down[e], H*I), dd0[e], f, c.dd[e], 11)
		}
		// Frozen (dm nil, a LoRA student's base): the same dx bit for bit.
		dxf := be.FromF32(dx0)
		be.MoEBackward(dxf, nil, be.FromF32(R), c.xt, c.mw, c.saved, be.FromF32(dprob), T)
		want, got := s.read(dx, T*H), s.read(dxf, T*H)
		for i := range want {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Fatalf("frozen MoEBackward (dm nil): dx[%d] = %g, want %g, the dx of the backward with weight gradients", i, got[i], want[i])
			}
		}
	}

	// NVFP4 QAD of the experts' input: the forward multiplies the
	// quantized rows; the weight gradients use them (straight-through),
	// the router reads x as it is.
	T, H, I, E, K := 24, 32, 16, 4, 2
	c := s.newMoECase(r, T, H, I, E, K, true)
	c.mw.InAmax = 2.5
	xq := append([]float32(nil), c.x...)
	g := compute.NVFP4GlobalScale(c.mw.InAmax)
	for i := 0; i < len(xq); i += compute.NVFP4BlockSize {
		compute.NVFP4FakeQuantBlock(xq[i:i+compute.NVFP4BlockSize], xq[i:i+compute.NVFP4BlockSize], g)
	}
	xqd := f64(s.gemmIn(xq))
	out := s.garbage(T * H)
	be.MoEForward(out, c.xt, c.mw, c.saved, T)
	closeTo(t, "moe out (QAD input)", s.read(out, T*H), s.moeOut(c, c.xd, xqd), s.tol.MoEAtol, s.tol.MoERtol)
	R := randn(r, T*H, 1)
	Rd := f64(R)
	f := func() float64 { return dot(ref.MoE(c.xd, xqd, c.rd, c.gd, c.ud, c.dd, E, K, H, I, true), Rd) }
	dm := &compute.MoEWeights{Router: be.New(compute.F32, E*H)}
	for e := 0; e < E; e++ {
		dm.Gate = append(dm.Gate, be.New(compute.F32, I*H))
		dm.Up = append(dm.Up, be.New(compute.F32, I*H))
		dm.Down = append(dm.Down, be.New(compute.F32, H*I))
	}
	be.MoEBackward(be.New(compute.F32, T*H), dm, be.FromF32(R), c.xt, c.mw, c.saved, nil, T)
	zero := make([]float32, I*H)
	s.moeBwd(t, "drouter (QAD input)", s.read(dm.Router, E*H), zero[:E*H], f, c.rd, 3)
	for e := 0; e < E; e++ {
		s.moeBwd(t, "dgate (QAD input)", s.read(dm.Gate[e], I*H), zero, f, c.gd[e], 7)
		s.moeBwd(t, "ddown (QAD input)", s.read(dm.Down[e], H*I), zero, f, c.dd[e], 7)
	}
}

// moeRouting checks MoERouting: the per-expert counts and probability
// sums it records, against the float64 routing (ref.MoEProbs, ref.TopK)
// and bit for bit against the host's sum of the backend's own saved
// probabilities in token order (so every backend's load-balancing loss
// is the same bits); AuxGrad bit for bit against compute.MoEAuxGrad and
// within one fp32 rounding of the float64 formula; and that a snapshot
// (Later) keeps its values while Record overwrites the statistics and
// MoEForward the saved routing it recorded from (the decoder's layers
// share those buffers under full recompute).
func (s *suite) moeRouting(t *testing.T) {
	be := s.be
	r := rand.New(rand.NewPCG(43, 44))
	T, H, I, E, K, L := 37, 16, 8, 7, 2, 2
	// Two layers' routings, both run into layer 0's saved buffers. Their
	// routers are scaled up so that the probabilities span more binades
	// than a float64 holds (logits tens apart): the sums round, and their
	// order shows in their bits.
	cs := []*moeCase{s.newMoECase(r, T, H, I, E, K, true), s.newMoECase(r, T, H, I, E, K, false)}
	for _, c := range cs {
		for i := range c.router {
			c.router[i] *= 8
		}
		c.rd, c.mw.Router = f64(c.router), be.FromF32(c.router)
	}
	saved := cs[0].saved
	rt := be.NewMoERouting(L, E)
	defer rt.Free()
	wantCnt, wantSum := make([][]int, L), make([][]float64, L)
	hostSum := make([][]float64, L)
	for l, c := range cs {
		out := s.garbage(T * H)
		be.MoEForward(out, c.xt, c.mw, saved, T)
		rt.Record(l, saved, T)
		probs := ref.MoEProbs(c.xd, c.rd, E, H)
		wantCnt[l], wantSum[l] = make([]int, E), make([]float64, E)
		for ti := 0; ti < T; ti++ {
			for _, e := range ref.TopK(probs[ti*E:(ti+1)*E], K) {
				wantCnt[l][e]++
			}
			for e := 0; e < E; e++ {
				wantSum[l][e] += probs[ti*E+e]
			}
		}
		// The host's sum of what the backend saved, t ascending.
		p := s.read(saved.Probs, T*E)
		hostSum[l] = make([]float64, E)
		for ti := 0; ti < T; ti++ {
			for e := 0; e < E; e++ {
				hostSum[l][e] += float64(p[ti*E+e])
			}
		}
		rounded := false // (t descending: other bits, at least once)
		for e := 0; e < E; e++ {
			var d float64
			for ti := T - 1; ti >= 0; ti-- {
				d += float64(p[ti*E+e])
			}
			rounded = rounded || d != hostSum[l][e]
		}
		if !rounded {
			t.Fatalf("layer %d: every probability sum is exact in float64: the order of the sums is not tested", l)
		}
	}
	newStats := func() ([][]int, [][]float64) {
		c, sm := make([][]int, L), make([][]float64, L)
		for l := range c {
			c[l], sm[l] = make([]int, E), make([]float64, E)
		}
		return c, sm
	}
	check := func(what string, cnt [][]int, sum [][]float64) {
		t.Helper()
		for l := 0; l < L; l++ {
			for e := 0; e < E; e++ {
				if cnt[l][e] != wantCnt[l][e] {
					t.Fatalf("%s: layer %d expert %d: count %d, the float64 routing's %d", what, l, e, cnt[l][e], wantCnt[l][e])
				}
				if math.Float64bits(sum[l][e]) != math.Float64bits(hostSum[l][e]) {
					t.Fatalf("%s: layer %d expert %d: probability sum %.17g, the host's sum of the saved probabilities %.17g: want the same bits", what, l, e, sum[l][e], hostSum[l][e])
				}
				if d := math.Abs(sum[l][e] - wantSum[l][e]); d > s.tol.FwdAtol*float64(T)+s.tol.FwdRtol*math.Abs(wantSum[l][e]) {
					t.Fatalf("%s: layer %d expert %d: probability sum %g, float64 %g", what, l, e, sum[l][e], wantSum[l][e])
				}
			}
		}
	}
	snap := rt.Later()
	// The gradient, from the recorded counts (garbage first: it overwrites).
	const coef = 0.0123
	dprob := s.garbage(E)
	rt.AuxGrad(dprob, coef, T)
	tot := make([]int, E)
	for l := range wantCnt {
		for e, c := range wantCnt[l] {
			tot[e] += c
		}
	}
	got, host := s.read(dprob, E), compute.MoEAuxGrad(coef, tot, L, T)
	n := float64(L * T)
	for e := range got {
		if math.Float32bits(got[e]) != math.Float32bits(host[e]) {
			t.Fatalf("AuxGrad: expert %d: %g, compute.MoEAuxGrad %g: want the same bits", e, got[e], host[e])
		}
		want := coef * float64(E) * float64(tot[e]) / (n * n)
		if math.Abs(float64(got[e])-want) > 0x1p-24*math.Abs(want) {
			t.Fatalf("AuxGrad: expert %d: %g, float64 %g", e, got[e], want)
		}
	}
	// Overwrite layer 0 with layer 1's routing: the snapshot keeps the
	// values it was taken of; a new one has the new ones.
	rt.Record(0, saved, T)
	cnt, sum := newStats()
	snap.Read(cnt, sum)
	check("snapshot", cnt, sum)
	wantCnt[0], wantSum[0], hostSum[0] = wantCnt[1], wantSum[1], hostSum[1]
	cnt, sum = newStats()
	rt.Later().Read(cnt, sum)
	check("after Record over layer 0", cnt, sum)
}

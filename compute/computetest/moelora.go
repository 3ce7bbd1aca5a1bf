package computetest

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
	"distill/compute/ref"
)

// moeLoRA checks LoRA adapters on the experts (MoEWeights.Adapters)
// against an independent float64 block: per token, per chosen expert e,
//
//	gate = xe·Gateᵀ + s·(drop(xe)·A_gᵀ)·B_gᵀ   (up likewise)
//	y    = h·Downᵀ + s·(drop(h)·A_dᵀ)·B_dᵀ,  h = silu(gate)·up
//
// summed with the routing weights, the masks DropoutMask.Keep's at the
// token (MoEWeights.Drop); without dropout it is ref.MoE of the merged
// weights W + s·B·A. MoEForward's output, and MoEBackward's dx and every
// adapter's dA and dB (from non-zero gradients: the += rule) against
// central finite differences of it, with the base frozen (dm nil) and not
// (its gradients then as without adapters: checked by MoEBackward's
// subtest); an expert without some adapters, one without any.
func (s *suite) moeLoRA(t *testing.T) {
	for _, p := range []float64{0, 0.3} {
		t.Run(fmt.Sprintf("dropout=%g", p), func(t *testing.T) { s.moeLoRACase(t, p) })
	}
}

// moeAd is the case's adapters: per projection (gate, up, down) and
// expert, A (r, in) and B (out, r), nil where an expert has none.
type moeAd struct {
	a, b       [3][][]float32
	ad, bd     [3][][]float64
	da0, db0   [3][][]float32
	lora       [3][]*compute.LoRA
	rank       int
	scale      float64
	p          float64
	drop       compute.MoEDrop
	streamBase uint64
}

func (s *suite) moeLoRACase(t *testing.T, p float64) {
	be := s.be
	r := rand.New(rand.NewPCG(28, 2))
	T, H, I, E, K := 40, 16, 24, 6, 2
	c := s.newMoECase(r, T, H, I, E, K, true)
	ad := &moeAd{rank: 4, scale: 2, p: p, drop: compute.MoEDrop{Step: 7, Row: 3}, streamBase: 0x5eed}
	c.mw.Adapters = make([]compute.MoEAdapter, E)
	for j := 0; j < 3; j++ {
		in, out := H, I
		if j == 2 {
			in, out = I, H
		}
		for e := 0; e < E; e++ {
			if e == 4 || (e == 1 && j == 1) { // expert 4 has none, expert 1 no up_proj's
				ad.a[j], ad.b[j], ad.ad[j], ad.bd[j] = append(ad.a[j], nil), append(ad.b[j], nil), append(ad.ad[j], nil), append(ad.bd[j], nil)
				ad.da0[j], ad.db0[j], ad.lora[j] = append(ad.da0[j], nil), append(ad.db0[j], nil), append(ad.lora[j], nil)
				continue
			}
			a, b := randn(r, ad.rank*in, 0.3), randn(r, out*ad.rank, 0.3)
			da0, db0 := randn(r, ad.rank*in, 1), randn(r, out*ad.rank, 1)
			l := &compute.LoRA{A: be.FromF32(a), B: be.FromF32(b), DA: be.FromF32(da0), DB: be.FromF32(db0),
				Rank: ad.rank, In: in, Out: out, Scale: float32(ad.scale), Dropout: p, Stream: ad.streamBase + uint64(3*e+j)}
			ad.a[j], ad.b[j] = append(ad.a[j], a), append(ad.b[j], b)
			// The adapters are fp32 (compute.LoRA): a backend that rounds
			// them to BF16 for its GEMMs is within the BF16 tolerances.
			ad.ad[j], ad.bd[j] = append(ad.ad[j], f64(a)), append(ad.bd[j], f64(b))
			ad.da0[j], ad.db0[j], ad.lora[j] = append(ad.da0[j], da0), append(ad.db0[j], db0), append(ad.lora[j], l)
		}
	}
	for e := 0; e < E; e++ {
		c.mw.Adapters[e] = compute.MoEAdapter{Gate: ad.lora[0][e], Up: ad.lora[1][e], Down: ad.lora[2][e]}
	}
	if p > 0 {
		c.mw.Drop = &ad.drop
	}
	ref64 := func() []float64 { return s.moeLoRARef(c, ad, c.xd, c.xe(), s.tol.BF16GEMM) }
	if p == 0 { // the reference is the merged block's
		merged := func(j int, w [][]float64, in, out int) [][]float64 {
			var m [][]float64
			for e := range w {
				v := append([]float64(nil), w[e]...)
				if ad.ad[j][e] != nil {
					for o := 0; o < out; o++ {
						for i := 0; i < in; i++ {
							for k := 0; k < ad.rank; k++ {
								v[o*in+i] += ad.scale * ad.bd[j][e][o*ad.rank+k] * ad.ad[j][e][k*in+i]
							}
						}
					}
				}
				m = append(m, v)
			}
			return m
		}
		var round func([]float64)
		if s.tol.BF16GEMM {
			round = func(act []float64) {
				for i, v := range act {
					act[i] = float64(compute.BF16ToF32(compute.F32ToBF16(float32(v))))
				}
			}
		}
		want := ref.MoERounded(c.xd, c.xe(), c.rd, merged(0, c.gd, H, I), merged(1, c.ud, H, I), merged(2, c.dd, I, H), E, K, H, I, true, round)
		got := ref64()
		for i := range want {
			if math.Abs(got[i]-want[i]) > 1e-12*(1+math.Abs(want[i])) {
				t.Fatalf("the test's reference [%d] = %.15g, the merged block's %.15g", i, got[i], want[i])
			}
		}
	}
	out := s.garbage(T * H)
	be.MoEForward(out, c.xt, c.mw, c.saved, T)
	closeTo(t, "moe+lora out", s.read(out, T*H), ref64(), s.tol.MoEAtol, s.tol.MoERtol)

	R := randn(r, T*H, 1)
	Rd := f64(R)
	// The finite differences' function is smooth: no BF16 rounding of h.
	f := func() float64 { return dot(s.moeLoRARef(c, ad, c.xd, c.xe(), false), Rd) }
	for _, frozen := range []bool{true, false} {
		dx0 := randn(r, T*H, 1)
		var dm *compute.MoEWeights
		if !frozen {
			dm = &compute.MoEWeights{Router: be.New(compute.F32, E*H)}
			for e := 0; e < E; e++ {
				dm.Gate = append(dm.Gate, be.New(compute.F32, I*H))
				dm.Up = append(dm.Up, be.New(compute.F32, I*H))
				dm.Down = append(dm.Down, be.New(compute.F32, H*I))
			}
		}
		for j := range ad.lora {
			for e, l := range ad.lora[j] {
				if l != nil {
					be.WriteF32(l.DA, ad.da0[j][e])
					be.WriteF32(l.DB, ad.db0[j][e])
				}
			}
		}
		dx := be.FromF32(dx0)
		be.MoEBackward(dx, dm, be.FromF32(R), c.xt, c.mw, c.saved, nil, T)
		what := fmt.Sprintf(" (frozen %v)", frozen)
		s.moeBwd(t, "dx"+what, s.read(dx, T*H), dx0, f, c.xd, 7)
		for j, proj := range []string{"gate", "up", "down"} {
			for e, l := range ad.lora[j] {
				if l == nil {
					continue
				}
				s.moeBwd(t, fmt.Sprintf("expert %d %s dA%s", e, proj, what), s.read(l.DA, len(ad.da0[j][e])), ad.da0[j][e], f, ad.ad[j][e], 5)
				s.moeBwd(t, fmt.Sprintf("expert %d %s dB%s", e, proj, what), s.read(l.DB, len(ad.db0[j][e])), ad.db0[j][e], f, ad.bd[j][e], 5)
			}
		}
	}
}

// moeLoRARef is the float64 block with adapters (see moeLoRA): x feeds
// the router, xe the experts; round: h rounded to BF16, as a BF16
// backend's GEMMs read it.
func (s *suite) moeLoRARef(c *moeCase, ad *moeAd, x, xe []float64, round bool) []float64 {
	T, H, I, E, K := c.T, c.H, c.I, c.E, c.K
	probs := ref.MoEProbs(x, c.rd, E, H)
	out := make([]float64, T*H)
	term := func(j, e, t int, v []float64, in, outN int) []float64 {
		if ad.ad[j][e] == nil {
			return make([]float64, outN)
		}
		xa := append([]float64(nil), v...)
		if ad.p > 0 {
			d := compute.NewDropoutMask(ad.streamBase+uint64(3*e+j), ad.drop.Step, ad.drop.Row, ad.p)
			for i := range xa {
				if d.Keep(t, i) {
					xa[i] *= float64(d.Scale)
				} else {
					xa[i] = 0
				}
			}
		}
		tt := ref.Linear(xa, ad.ad[j][e], nil, in, ad.rank)
		for i := range tt {
			tt[i] *= ad.scale
		}
		return ref.Linear(tt, ad.bd[j][e], nil, ad.rank, outN)
	}
	add := func(a, b []float64) []float64 {
		for i := range a {
			a[i] += b[i]
		}
		return a
	}
	for t := 0; t < T; t++ {
		pt := probs[t*E : (t+1)*E]
		sel := ref.TopK(pt, K)
		var ks float64
		for _, e := range sel {
			ks += pt[e]
		}
		xt := xe[t*H : (t+1)*H]
		for _, e := range sel {
			w := pt[e]
			if c.norm {
				w /= ks
			}
			g := add(ref.Linear(xt, c.gd[e], nil, H, I), term(0, e, t, xt, H, I))
			u := add(ref.Linear(xt, c.ud[e], nil, H, I), term(1, e, t, xt, H, I))
			h := ref.SwiGLU(g, u)
			if round {
				for i, v := range h {
					h[i] = float64(compute.BF16ToF32(compute.F32ToBF16(float32(v))))
				}
			}
			y := add(ref.Linear(h, c.dd[e], nil, I, H), term(2, e, t, h, I, H))
			for i, v := range y {
				out[t*H+i] += w * v
			}
		}
	}
	return out
}

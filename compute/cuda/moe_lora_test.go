package cuda

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"distill/compute"
)

// moeLoRACase is a moeTrainCase with LoRA adapters on its experts:
// rank[e][j] (0: none) of projection j (gate, up, down) of expert e, A
// and B, their initial gradients, and the dropout.
type moeLoRACase struct {
	*moeTrainCase
	rank     [][3]int
	a, b     [][3][]float32
	da0, db0 [][3][]float32
	p        float64
	drop     compute.MoEDrop
	// bf16Base holds the experts' weights as BF16 weights (Backend.Weight),
	// as a LoRA student's frozen base; else F32 tensors.
	bf16Base bool
	// infer: run MoE too (the forward that saves nothing), into
	// moeLoRAResult.inferred.
	infer bool
	// between, when set, is called with "forward" just before MoEForward,
	// "backward" just before MoEBackward, and "forward done" and "backward
	// done" just after each returns.
	between func(step string)
}

func newMoELoRACase(r *rand.Rand, c *moeTrainCase, rank func(e, j int) int, p float64) *moeLoRACase {
	lc := &moeLoRACase{moeTrainCase: c, p: p, drop: compute.MoEDrop{Step: 11, Row: 2}}
	for e := 0; e < c.E; e++ {
		var rk [3]int
		var a, b, da, db [3][]float32
		for j := range rk {
			in, out := c.H, c.I
			if j == 2 {
				in, out = c.I, c.H
			}
			if rk[j] = rank(e, j); rk[j] == 0 {
				continue
			}
			a[j], b[j] = randF32(r, rk[j]*in), randF32(r, out*rk[j])
			for i := range a[j] {
				a[j][i] *= 0.3
			}
			for i := range b[j] {
				b[j][i] *= 0.3
			}
			da[j], db[j] = randF32(r, rk[j]*in), randF32(r, out*rk[j])
		}
		lc.rank, lc.a, lc.b, lc.da0, lc.db0 = append(lc.rank, rk), append(lc.a, a), append(lc.b, b), append(lc.da0, da), append(lc.db0, db)
	}
	return lc
}

// moeLoRAResult is what MoEForward and MoEBackward give with adapters:
// the output, the saved projections, dx, and each adapter's DA and DB.
type moeLoRAResult struct {
	out, gate, up, y, dx []float32
	inferred             []float32 // MoE's output (the forward that saves nothing, never drops)
	offsets              []int32
	da, db               [][3][]float32
}

// run runs MoEForward then MoEBackward (frozen: no base gradients, as a
// LoRA student's) on be with the case's adapters.
func (c *moeLoRACase) run(be compute.Backend, frozen bool) *moeLoRAResult {
	T, H, I, E, K := c.T, c.H, c.I, c.E, c.K
	mw := &compute.MoEWeights{Router: be.FromF32(c.router), NumExperts: E, TopK: K, Hidden: H, Inter: I, NormTopK: c.norm,
		Adapters: make([]compute.MoEAdapter, E)}
	if c.p > 0 {
		mw.Drop = &c.drop
	}
	var dm *compute.MoEWeights
	if !frozen {
		dm = &compute.MoEWeights{Router: be.FromF32(c.dr0), NumExperts: E, TopK: K, Hidden: H, Inter: I}
	}
	base := be.FromF32
	if c.bf16Base {
		base = func(s []float32) compute.Tensor {
			h := make([]uint16, len(s))
			compute.NarrowBF16(h, s)
			w, err := be.Weight(h)
			if err != nil {
				panic(err)
			}
			return w
		}
	}
	ls := make([][3]*compute.LoRA, E)
	for e := 0; e < E; e++ {
		mw.Gate, mw.Up, mw.Down = append(mw.Gate, base(c.gate[e])), append(mw.Up, base(c.up[e])), append(mw.Down, base(c.down[e]))
		if dm != nil {
			dm.Gate, dm.Up, dm.Down = append(dm.Gate, be.FromF32(c.dg0[e])), append(dm.Up, be.FromF32(c.du0[e])), append(dm.Down, be.FromF32(c.dd0[e]))
		}
		for j, rk := range c.rank[e] {
			if rk == 0 {
				continue
			}
			in, out := H, I
			if j == 2 {
				in, out = I, H
			}
			ls[e][j] = &compute.LoRA{A: be.FromF32(c.a[e][j]), B: be.FromF32(c.b[e][j]), DA: be.FromF32(c.da0[e][j]), DB: be.FromF32(c.db0[e][j]),
				Rank: rk, In: in, Out: out, Scale: 16 / float32(rk), Dropout: c.p, Stream: 0xada + uint64(3*e+j)}
		}
		mw.Adapters[e] = compute.MoEAdapter{Gate: ls[e][0], Up: ls[e][1], Down: ls[e][2]}
	}
	nf, ni := compute.MoESavedSizes(T, E, K, H, I)
	s := compute.NewMoESaved(be, be.New(compute.F32, nf), be.New(compute.I32, ni), T, E, K, H, I)
	x := be.FromF32(c.x)
	out := be.New(compute.F32, T*H)
	dx, dout := be.FromF32(c.dx0), be.FromF32(c.dout)
	mark := func(step string) {
		if c.between != nil {
			c.between(step)
		}
	}
	mark("forward")
	be.MoEForward(out, x, mw, s, T)
	mark("forward done")
	mark("backward")
	be.MoEBackward(dx, dm, dout, x, mw, s, nil, T)
	mark("backward done")
	res := &moeLoRAResult{out: readF32(be, out, T*H), gate: readF32(be, s.Gate, T*K*I), up: readF32(be, s.Up, T*K*I), y: readF32(be, s.Y, T*K*H),
		dx: readF32(be, dx, T*H), offsets: make([]int32, E+1)}
	be.ReadI32(s.Offsets, res.offsets)
	if c.infer {
		inf := be.New(compute.F32, T*H)
		be.MoE(inf, x, mw, T)
		res.inferred = readF32(be, inf, T*H)
	}
	for e := 0; e < E; e++ {
		var da, db [3][]float32
		for j, l := range ls[e] {
			if l != nil {
				da[j], db[j] = readF32(be, l.DA, l.Rank*l.In), readF32(be, l.DB, l.Out*l.Rank)
			}
		}
		res.da, res.db = append(res.da, da), append(res.db, db)
	}
	return res
}

// TestMoELoRAGrouped: the experts' adapters on the grouped kernels
// (moelora.cu) against compute/cpu (whose adapters the conformance suite
// holds to a float64 block and finite differences) on a shape that
// reaches every edge of the kernels, which the suite's small one does
// not: experts of two row tiles (64 rows) with a partial one, adapters'
// outputs of two and three column tiles (64) with a partial one, sums
// over k of several 32-wide steps with a partial last one, ranks that
// differ between the experts (one of two 16-wide tiles: 20), an expert
// with no adapter, one with some, and a starved expert with adapters
// (its gradients untouched); with dropout (the masks per token, each
// expert's adapter its own key) and without, on the device's grouping and
// on the host's (the adapters run on the device's kernels either way).
// MoE, the forward that saves nothing (and never drops), gives
// MoEForward's output bit for bit without dropout, and the CPU's with it.
//
// Tolerances as TestMoETrainConformance's: the device rounds the SwiGLU's
// activations and the gradients to BF16 for the base's GEMMs, errors in
// proportion to each quantity's scale.
func TestMoELoRAGrouped(t *testing.T) {
	be := testBackend(t)
	const T, H, I, E, K, starve = 200, 136, 72, 6, 2, 3
	rank := func(e, j int) int {
		switch {
		case e == 5, e == 2 && j == 0: // no adapter; no gate adapter
			return 0
		case e == 1:
			return 20
		case e == 4:
			return 7
		}
		return 4
	}
	for _, p := range []float64{0.25, 0} {
		for _, host := range []bool{false, true} {
			t.Run(fmt.Sprintf("dropout=%g/host=%v", p, host), func(t *testing.T) {
				r := rand.New(rand.NewPCG(28, 77))
				c := newMoELoRACase(r, newMoETrainCase(r, T, H, I, E, K, true, false, starve), rank, p)
				c.infer = true
				testMoEHostGrouping = host
				got := c.run(be, true)
				testMoEHostGrouping = false
				want := c.run(oracle, true)
				if !equalI32(got.offsets, want.offsets) {
					t.Fatalf("offsets %v, cpu %v", got.offsets, want.offsets)
				}
				if n := got.offsets[1] - got.offsets[0]; n <= 64 || n%64 == 0 {
					t.Fatalf("expert 0 has %d rows: the case wants more than one row tile and a partial one", n)
				}
				if got.offsets[starve] != got.offsets[starve+1] {
					t.Fatalf("expert %d has rows: the case must starve it", starve)
				}
				zero := func(n int) []float32 { return make([]float32, n) }
				gradClose(t, "Gate", got.gate, want.gate, zero(len(want.gate)), 1e-3, 1e-3)
				gradClose(t, "Up", got.up, want.up, zero(len(want.up)), 1e-3, 1e-3)
				gradClose(t, "Y", got.y, want.y, zero(len(want.y)), 1e-2, 1e-2)
				gradClose(t, "out", got.out, want.out, zero(len(want.out)), 1e-2, 1e-2)
				if p == 0 { // MoE (inference: no dropout) computes what MoEForward does
					same(t, "MoE's out against MoEForward's", got.inferred, got.out)
					same(t, "cpu: MoE's out against MoEForward's", want.inferred, want.out)
				} else {
					gradClose(t, "MoE's out (no dropout)", got.inferred, want.inferred, zero(len(want.out)), 1e-2, 1e-2)
				}
				gradClose(t, "dx", got.dx, want.dx, c.dx0, 2e-2, 1e-2)
				for e := 0; e < E; e++ {
					for j, proj := range []string{"gate", "up", "down"} {
						if c.rank[e][j] == 0 {
							continue
						}
						if e == starve {
							same(t, fmtf("starved expert's %s DA", proj), got.da[e][j], c.da0[e][j])
							same(t, fmtf("starved expert's %s DB", proj), got.db[e][j], c.db0[e][j])
							continue
						}
						gradClose(t, fmtf("expert %d %s DA", e, proj), got.da[e][j], want.da[e][j], c.da0[e][j], 2e-2, 1e-2)
						gradClose(t, fmtf("expert %d %s DB", e, proj), got.db[e][j], want.db[e][j], c.db0[e][j], 2e-2, 1e-2)
					}
				}
				// Deterministic: the same bits again.
				testMoEHostGrouping = host
				again := c.run(be, true)
				testMoEHostGrouping = false
				same(t, "out", got.out, again.out)
				same(t, "dx", got.dx, again.dx)
				for e := 0; e < E; e++ {
					for j := range c.rank[e] {
						same(t, "DA", got.da[e][j], again.da[e][j])
						same(t, "DB", got.db[e][j], again.db[e][j])
					}
				}
			})
		}
	}
}

// TestMoELoRALaunches: a LoRA student's MoE forward and backward (the
// base frozen in BF16, every expert adapted on every projection, dropout
// on) on the device's grouping launches the same kernels, as many times,
// at 6 experts as at 48: a handful a projection (the adapters'
// k_moelora_* kernels), no per-expert GEMM (cuBLASLt's are the router's
// alone: the forward's logits, the backward's dx), and no gathered copy
// of the tokens (k_moe_gather).
func TestMoELoRALaunches(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	counts := func(E int) map[string]int {
		r := rand.New(rand.NewPCG(5, uint64(E)))
		c := newMoELoRACase(r, newMoETrainCase(r, 64, 16, 24, E, 2, true, false, -1), func(e, j int) int { return 4 }, 0.1)
		c.bf16Base = true
		be.Profile() // reset
		c.run(be, true)
		return profileCalls(be)
	}
	few, many := counts(6), counts(48)
	adapters := 0
	for name, n := range many {
		if strings.HasPrefix(name, "cublasLt") || strings.HasPrefix(name, "k_moelora") {
			adapters += n
		}
		if few[name] != n {
			t.Errorf("%s: %d calls at 6 experts, %d at 48: want the same (profile at 48: %v)", name, few[name], n, many)
		}
	}
	for name, n := range few {
		if _, ok := many[name]; !ok {
			t.Errorf("%s: %d calls at 6 experts, none at 48", name, n)
		}
	}
	// Forward: the tiles, then t and out for each of the 3 projections;
	// backward: the tiles, then t, DB, dt, DA and dx for each.
	want := map[string]int{"k_moelora_tiles": 2, "k_moelora_rows_nt16": 6, "k_moelora_rows_nt64": 3, "k_moelora_wgrad_64x16": 3,
		"k_moelora_rows_nn16": 3, "k_moelora_wgrad_16x64": 3, "k_moelora_rows_nn64": 3,
		"cublasLt GEMM (MoEForward)": 1, "cublasLt GEMM (MoEBackward)": 1,
		// The adapters read the tokens in place, as the base's GEMMs do:
		// no gathered copy of x, forward or backward.
		"k_moe_gather": 0}
	total := 0
	for name, n := range want {
		total += n
		if many[name] != n {
			t.Errorf("%s: %d calls, want %d (profile: %v)", name, many[name], n, many)
		}
	}
	if adapters != total {
		t.Errorf("%d adapter kernels and cuBLASLt GEMMs, want %d (profile: %v)", adapters, total, many)
	}
}

// TestMoELoRANoHostWait: a LoRA student's MoE forward and backward on the
// device's grouping (every expert adapted, dropout on) makes the host wait
// for the device not once (CountHostWaits: no download, synchronization,
// pageable upload or event wait): the adapters run on the offsets in
// device memory, their tables uploaded through the pinned staging. The
// host's grouping (shapes the grouped GEMMs cannot take) reads its
// counts, and must show in the count: the check can fail.
func TestMoELoRANoHostWait(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(3, 4))
	c := newMoELoRACase(r, newMoETrainCase(r, 100, 16, 24, 8, 2, true, false, -1), func(e, j int) int { return 4 }, 0.1)
	c.bf16Base = true
	for _, host := range []bool{false, true} {
		testMoEHostGrouping = host
		var waits []HostWait
		c.between = func(step string) {
			switch step {
			case "forward":
				be.CountHostWaits(true)
			case "backward done":
				waits = be.HostWaits()
				be.CountHostWaits(false)
			}
		}
		c.run(be, true)
		c.between = nil
		testMoEHostGrouping = false
		n := 0
		for _, w := range waits {
			n += w.Count
		}
		if host && n == 0 {
			t.Fatalf("host grouping: no host wait counted in MoEForward + MoEBackward: the count cannot see the download of the counts")
		}
		if !host && n != 0 {
			t.Fatalf("device grouping: %d host waits in MoEForward + MoEBackward with adapters, want none: %v", n, waits)
		}
	}
}

package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
)

// The training kernels against compute/cpu (the oracle) on the same
// inputs, on shapes the contract's suite does not reach: ragged packed
// attention with the head dims of real models, odd NVFP4 row lengths,
// several row chunks of the column sums. Tolerances as in
// conformance_test.go: fp32 against fp32 at 1e-5 relative; GEMMs on BF16
// operands against the CPU given the same roundings at 1e-4.

// same checks that a kernel gives identical bits when run twice: every
// reduction has a fixed order (no atomics), which the resume test needs.
// On the emulator this holds by construction; on a GPU it is the check.
func same(t *testing.T, what string, a, b []float32) {
	t.Helper()
	for i := range a {
		if math.Float32bits(a[i]) != math.Float32bits(b[i]) {
			t.Fatalf("%s is not deterministic: element %d is %v, then %v", what, i, a[i], b[i])
		}
	}
}

func TestAdamWConformance(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(41, 42))
	n := 70001
	p, g, m, v := randF32(r, n), randF32(r, n), randF32(r, n), randF32(r, n)
	for i := range v {
		v[i] *= v[i]
	}
	st := compute.AdamWStep{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, StepSize: 3e-3, BC2Sqrt: 0.3, Decay: 0.999}
	run := func(be compute.Backend) (pp, mm, vv []float32) {
		pt, mt, vt := be.FromF32(p), be.FromF32(m), be.FromF32(v)
		be.AdamW(pt, be.FromF32(g), mt, vt, n, st)
		return readF32(be, pt, n), readF32(be, mt, n), readF32(be, vt, n)
	}
	gp, gm, gv := run(be)
	wp, wm, wv := run(oracle)
	closeTo(t, "adamw p", gp, wp, 1e-7, 1e-6)
	closeTo(t, "adamw m", gm, wm, 1e-7, 1e-6)
	closeTo(t, "adamw v", gv, wv, 1e-9, 1e-6)
}

// TestReductionsConformance: SumSquares and AbsMax over lengths around
// the reduction's block and grid sizes, against the CPU, twice each (the
// same bits), and with NaN and Inf.
func TestReductionsConformance(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(43, 44))
	for _, n := range []int{1, 255, 256, 257, 1 << 18, 1<<18 + 1, 300007} {
		x := randF32(r, n)
		xt, xo := be.FromF32(x), oracle.FromF32(x)
		got, want := be.SumSquares(xt, n), oracle.SumSquares(xo, n)
		if math.Abs(got-want) > 1e-12*want {
			t.Fatalf("SumSquares n=%d: %.17g, cpu %.17g", n, got, want)
		}
		if again := be.SumSquares(xt, n); math.Float64bits(again) != math.Float64bits(got) {
			t.Fatalf("SumSquares n=%d is not deterministic: %.17g then %.17g", n, got, again)
		}
		if got, want := be.AbsMax(xt, n), oracle.AbsMax(xo, n); got != want {
			t.Fatalf("AbsMax n=%d: %v, cpu %v", n, got, want)
		}
		// Scale is one rounding: bit-identical to the CPU.
		be.Scale(xt, n, 0.37)
		oracle.Scale(xo, n, 0.37)
		same(t, fmt.Sprintf("Scale n=%d vs cpu", n), readF32(be, xt, n), readF32(oracle, xo, n))
	}
	x := randF32(r, 5000)
	x[4321] = float32(math.NaN())
	if got := be.SumSquares(be.FromF32(x), len(x)); !math.IsNaN(got) {
		t.Fatalf("SumSquares with a NaN = %v", got)
	}
	if got := be.AbsMax(be.FromF32(x), len(x)); !math.IsNaN(float64(got)) {
		t.Fatalf("AbsMax with a NaN = %v", got)
	}
	x[4321] = float32(math.Inf(-1))
	if got := be.SumSquares(be.FromF32(x), len(x)); !math.IsInf(got, 1) {
		t.Fatalf("SumSquares with -Inf = %v", got)
	}
	if got := be.AbsMax(be.FromF32(x), len(x)); !math.IsInf(float64(got), 1) {
		t.Fatalf("AbsMax with -Inf = %v", got)
	}
	if got := be.SumSquares(be.New(compute.F32, 3), 0); got != 0 {
		t.Fatalf("SumSquares of nothing = %v", got)
	}
}

// TestFakeQuantNVFP4Exact: the device's NVFP4 fake quantization equals
// compute's scalar definitions (the CPU backend, the export packer) bit for
// bit: rows whose length is not a multiple of 16, all-zero blocks, values
// across E4M3's subnormal and saturating ranges, ties of E2M1, amax 0 and
// amaxes below and above the data's.
func TestFakeQuantNVFP4Exact(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(45, 46))
	for _, cols := range []int{16, 37, 1, 160} {
		rows := 23
		x := randF32(r, rows*cols)
		for i := range x {
			switch i % 11 {
			case 0:
				x[i] *= 1e-6 // tiny blocks: subnormal E4M3 scales
			case 1:
				x[i] = 0
			case 2:
				x[i] = float32(int(x[i]*8)) / 4 // E2M1 ties after scaling
			case 3:
				x[i] *= 300
			}
		}
		for i := 0; i < cols && i < 16; i++ { // one all-zero block
			x[5*cols+i] = 0
		}
		amaxes := []float32{0, 1e-3, 1, oracle.AbsMax(oracle.FromF32(x), len(x)), 1e4}
		for _, amax := range amaxes {
			got := be.FromF32(x)
			be.FakeQuantNVFP4(got, got, rows, cols, amax) // in place
			want := oracle.New(compute.F32, rows*cols)
			oracle.FakeQuantNVFP4(want, oracle.FromF32(x), rows, cols, amax)
			same(t, fmt.Sprintf("fake quant cols=%d amax=%g vs cpu", cols, amax), readF32(be, got, rows*cols), readF32(oracle, want, rows*cols))
		}
	}
}

// TestMatMulBackwardConformance: dx and dw through cuBLASLt's NN and NT
// GEMMs on BF16 operands, accumulating into non-zero gradients, and the
// bias's column sums over several row chunks, against the CPU given the
// same roundings.
func TestMatMulBackwardConformance(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(47, 48))
	for _, sh := range [][3]int{{33, 70, 48}, {1, 1, 1}, {200, 9, 520}, {130, 257, 96}} {
		m, n, k := sh[0], sh[1], sh[2]
		t.Run(fmt.Sprintf("m%d_n%d_k%d", m, n, k), func(t *testing.T) {
			x, w, dout := randF32(r, m*k), randF32(r, n*k), randF32(r, m*n)
			dx0, dw0, db0 := randF32(r, m*k), randF32(r, n*k), randF32(r, n)
			xr, _ := roundBF16(x)
			wr, _ := roundBF16(w)
			dr, _ := roundBF16(dout)
			dx, dw, db := be.FromF32(dx0), be.FromF32(dw0), be.FromF32(db0)
			be.MatMulBackward(dx, dw, db, be.FromF32(dout), be.FromF32(x), be.FromF32(w), m, n, k)
			wdx, wdw, wdb := oracle.FromF32(dx0), oracle.FromF32(dw0), oracle.FromF32(db0)
			oracle.MatMulBackward(wdx, wdw, nil, oracle.FromF32(dr), oracle.FromF32(xr), oracle.FromF32(wr), m, n, k)
			oracle.MatMulBackward(nil, oracle.New(compute.F32, n*k), wdb, oracle.FromF32(dout), oracle.FromF32(x), oracle.FromF32(w), m, n, k)
			closeTo(t, "dx", readF32(be, dx, m*k), readF32(oracle, wdx, m*k), 1e-4, 1e-4)
			closeTo(t, "dw", readF32(be, dw, n*k), readF32(oracle, wdw, n*k), 1e-4, 1e-4)
			closeTo(t, "dbias", readF32(be, db, n), readF32(oracle, wdb, n), 1e-5, 1e-5)
		})
	}
}

// TestLayerBackwardConformance: Embed (repeated ids: added in token
// order, as the CPU, so bit for bit), RMSNorm (the warp and the block
// kernel, dw over several row chunks, BF16 and F32 weights), RoPE and
// SwiGLU, against the CPU.
func TestLayerBackwardConformance(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(49, 50))
	t.Run("embed", func(t *testing.T) {
		vocab, dim, n := 50, 70, 400
		ids := make([]int32, n)
		for i := range ids {
			ids[i] = int32(r.IntN(vocab / 5)) // many repeats
		}
		dout, d0 := randF32(r, n*dim), randF32(r, vocab*dim)
		got, want := be.FromF32(d0), oracle.FromF32(d0)
		be.EmbedBackward(got, be.FromF32(dout), be.FromI32(ids), n, dim)
		oracle.EmbedBackward(want, oracle.FromF32(dout), oracle.FromI32(ids), n, dim)
		same(t, "embed backward vs cpu", readF32(be, got, vocab*dim), readF32(oracle, want, vocab*dim))
	})
	for _, sh := range [][2]int{{37, 129}, {1, 1}, {300, 1500}, {3 * 16, 128}, {20000, 8}} {
		rows, dim := sh[0], sh[1]
		t.Run(fmt.Sprintf("rmsnorm_%dx%d", rows, dim), func(t *testing.T) {
			x, dout := randF32(r, rows*dim), randF32(r, rows*dim)
			wr, wh := roundBF16(randF32(r, dim))
			dx0, dw0 := randF32(r, rows*dim), randF32(r, dim)
			rstd := oracle.New(compute.F32, rows)
			oracle.RMSNorm(oracle.New(compute.F32, rows*dim), rstd, oracle.FromF32(x), oracle.FromF32(wr), rows, dim, 1e-6)
			rs := readF32(oracle, rstd, rows)
			wdx, wdw := oracle.FromF32(dx0), oracle.FromF32(dw0)
			oracle.RMSNormBackward(wdx, wdw, oracle.FromF32(dout), oracle.FromF32(x), oracle.FromF32(wr), rstd, rows, dim)
			gb, _ := be.Weight(wh)
			for _, w := range []compute.Tensor{gb, be.FromF32(wr)} {
				dx, dw := be.FromF32(dx0), be.FromF32(dw0)
				be.RMSNormBackward(dx, dw, be.FromF32(dout), be.FromF32(x), w, be.FromF32(rs), rows, dim)
				closeTo(t, "rmsnorm dx", readF32(be, dx, rows*dim), readF32(oracle, wdx, rows*dim), 1e-5, 1e-5)
				closeTo(t, "rmsnorm dw", readF32(be, dw, dim), readF32(oracle, wdw, dim), 1e-5, 1e-5)
			}
		})
	}
	t.Run("rope", func(t *testing.T) {
		for _, hd := range []int{2, 64, 128} {
			tokens, heads := 9, 3
			pos := []int32{0, 1, 2, 3, 0, 1, 500, 4095, 30000}
			inv := make([]float32, hd/2)
			for i := range inv {
				inv[i] = float32(1 / math.Pow(1e6, float64(2*i)/float64(hd)))
			}
			cs, sn := ropeTable(pos, inv)
			d := randF32(r, tokens*heads*hd)
			got, want := be.FromF32(d), oracle.FromF32(d)
			be.RoPEBackward(got, be.FromF32(cs), be.FromF32(sn), tokens, heads, hd)
			oracle.RoPEBackward(want, oracle.FromF32(cs), oracle.FromF32(sn), tokens, heads, hd)
			closeTo(t, fmt.Sprintf("rope backward hd=%d", hd), readF32(be, got, len(d)), readF32(oracle, want, len(d)), 1e-6, 1e-5)
		}
	})
	t.Run("swiglu", func(t *testing.T) {
		n := 10007
		g, u, dout := randF32(r, n), randF32(r, n), randF32(r, n)
		for i := 0; i < 20; i++ {
			g[i] = float32(-90 + 9*i)
		}
		dg0, du0 := randF32(r, n), randF32(r, n)
		dg, du := be.FromF32(dg0), be.FromF32(du0)
		be.SwiGLUBackward(dg, du, be.FromF32(dout), be.FromF32(g), be.FromF32(u), n)
		wdg, wdu := oracle.FromF32(dg0), oracle.FromF32(du0)
		oracle.SwiGLUBackward(wdg, wdu, oracle.FromF32(dout), oracle.FromF32(g), oracle.FromF32(u), n)
		closeTo(t, "swiglu dgate", readF32(be, dg, n), readF32(oracle, wdg, n), 1e-6, 1e-5)
		closeTo(t, "swiglu dup", readF32(be, du, n), readF32(oracle, wdu, n), 1e-6, 1e-5)
	})
}

// TestAttentionBackwardConformance: the flash-style backward on ragged
// packed samples that straddle its tiles (16 rows and 32-key steps for the
// fp32 kernels, 64 for the tensor-core ones), GQA and MHA, with the head
// dims of Qwen3 (128), Llama (64) and odd ones, against the CPU; the lse
// is the CPU's forward's. Run twice: the same bits.
//
// The fp32 kernels are held to 1e-4. The tensor-core kernels round Q, K,
// V, dout, P and dS to BF16 (2⁻⁹ relative each) and accumulate in fp32;
// against the CPU on the same BF16-rounded q, k, v and dout the remaining
// error is that of P and dS: a dv or dk element sums the rounding errors
// (2⁻⁹·|p·dout|) of every later query of its sample, so the bound grows
// like the square root of the longest sample: atol 2e-2·sqrt(maxLen/65)
// (65, the emulator's longest, measured at 0.63 of it for dv), rtol 2e-2.
func TestAttentionBackwardConformance(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(51, 52))
	lens := []int{1, 5, 16, 17, 33, 64, 65, 2}
	if onGPU() && !underRacecheck() { // racecheck: the emulator's lengths
		lens = []int{1, 5, 16, 17, 63, 64, 65, 128, 129, 300, 1000, 2}
	}
	type cfg struct {
		nHead, nKV, hd int
		mode           attnMode
	}
	cfgs := []cfg{{4, 2, 16, "simt"}, {3, 3, 80, "simt"}, {4, 1, 64, "simt"}, {4, 2, 128, "simt"}, {2, 2, 256, "simt"},
		{4, 1, 64, "mma"}, {4, 2, 128, "mma"}, {2, 2, 64, "mma"}}
	for _, c := range cfgs {
		nHead, nKV, hd := c.nHead, c.nKV, c.hd
		t.Run(fmt.Sprintf("%s_h%d_kv%d_hd%d", c.mode, nHead, nKV, hd), func(t *testing.T) {
			be.attn = c.mode
			defer func() { be.attn = "" }()
			ac := newAttnCase(r, lens, nHead, nKV, hd)
			dout := randF32(r, ac.tokens*nHead*hd)
			dq0, dk0, dv0 := randF32(r, len(ac.q)), randF32(r, len(ac.k)), randF32(r, len(ac.v))
			scale := float32(1 / math.Sqrt(float64(hd)))
			run := func(be compute.Backend, q, k, v, dout []float32) (dq, dk, dv []float32) {
				o, lse := ac.run(oracle, q, k, v)
				gq, gk, gv := be.FromF32(dq0), be.FromF32(dk0), be.FromF32(dv0)
				be.AttentionBackward(gq, gk, gv, be.FromF32(dout), be.FromF32(q), be.FromF32(k), be.FromF32(v), be.FromF32(o), be.FromF32(lse),
					be.FromI32(ac.starts), len(ac.lens), ac.maxLen, ac.tokens, nHead, nKV, hd, scale)
				return readF32(be, gq, len(q)), readF32(be, gk, len(k)), readF32(be, gv, len(v))
			}
			atol, rtol := 1e-4, 1e-4
			q, k, v, d := ac.q, ac.k, ac.v, dout
			if c.mode == "mma" {
				atol, rtol = 2e-2*math.Sqrt(float64(ac.maxLen)/65), 2e-2
				q, _ = roundBF16(q)
				k, _ = roundBF16(k)
				v, _ = roundBF16(v)
				d, _ = roundBF16(d)
			}
			gq, gk, gv := run(be, ac.q, ac.k, ac.v, dout)
			wq, wk, wv := run(oracle, q, k, v, d)
			closeTo(t, "attention dq", gq, wq, atol, rtol)
			closeTo(t, "attention dk", gk, wk, atol, rtol)
			closeTo(t, "attention dv", gv, wv, atol, rtol)
			gq2, gk2, gv2 := run(be, ac.q, ac.k, ac.v, dout)
			same(t, "attention dq", gq, gq2)
			same(t, "attention dk", gk, gk2)
			same(t, "attention dv", gv, gv2)
		})
	}
}

// TestAttentionBackwardBF16DV: a BF16 dv (v_proj's backward reads it)
// holds, bit for bit, the rounding of what an F32 dv that started at the
// same values gains, on cuDNN (its BF16 dV added in BF16) and on the own
// fp32 and tensor-core kernels (an F32 scratch added and rounded once);
// dq and dk are the F32 run's.
func TestAttentionBackwardBF16DV(t *testing.T) {
	be := testBackend(t)
	if be.dnn == nil {
		t.Fatal("cuDNN did not load (the emulator stands in for it)")
	}
	r := rand.New(rand.NewPCG(53, 54))
	eachAttnBackwardMode(t, be, func(t *testing.T, c attnBackwardMode) {
		ac := newAttnCase(r, []int{1, 17, 65, 2}, c.nHead, c.nKV, c.hd)
		o, lse := ac.run(oracle, ac.q, ac.k, ac.v)
		dout := randF32(r, len(o))
		dq0, dk0 := randF32(r, len(ac.q)), randF32(r, len(ac.k))
		dv0, _ := roundBF16(randF32(r, len(ac.v)))
		run := func(dvt compute.DType) (dq, dk, dv []float32) {
			gq, gk, gv := be.FromF32(dq0), be.FromF32(dk0), be.New(dvt, len(dv0))
			be.WriteF32(gv, dv0)
			ac.backwardOn(t, be, c, gq, gk, gv, be.FromF32(dout), be.FromF32(o), lse)
			return readF32(be, gq, len(ac.q)), readF32(be, gk, len(ac.k)), readF32(be, gv, len(dv0))
		}
		q32, k32, v32 := run(compute.F32)
		qb, kb, vb := run(compute.BF16)
		same(t, "dq", qb, q32)
		same(t, "dk", kb, k32)
		vr, _ := roundBF16(v32)
		same(t, "dv (bf16) vs the f32 dv rounded", vb, vr)
		changed := 0
		for i := range vb {
			if vb[i] != dv0[i] {
				changed++
			}
		}
		if changed < len(vb)/2 {
			t.Fatalf("only %d of %d dv elements moved", changed, len(vb))
		}
	})
}

// TestAttentionBackwardBF16Dout: a BF16 dout (o_proj's backward writes
// attention's in BF16) gives dq, dk and dv bit for bit as an F32 dout of
// the same values, on cuDNN and on the own fp32 and tensor-core kernels,
// and so does a BF16 out (the decoder's) against its F32 widening; cuDNN
// and the tensor-core chain read only dout's rounding (D too: the same
// bits from an unrounded F32 dout), so the decoder's BF16 gradients train
// as its F32 ones.
func TestAttentionBackwardBF16Dout(t *testing.T) {
	be := testBackend(t)
	if be.dnn == nil {
		t.Fatal("cuDNN did not load (the emulator stands in for it)")
	}
	r := rand.New(rand.NewPCG(55, 56))
	eachAttnBackwardMode(t, be, func(t *testing.T, c attnBackwardMode) {
		ac := newAttnCase(r, []int{1, 17, 65, 2}, c.nHead, c.nKV, c.hd)
		o, lse := ac.run(oracle, ac.q, ac.k, ac.v)
		o, _ = roundBF16(o) // the decoder's out is BF16
		dout := randF32(r, len(o))
		dr, _ := roundBF16(dout)
		dq0, dk0, dv0 := randF32(r, len(ac.q)), randF32(r, len(ac.k)), randF32(r, len(ac.v))
		run := func(d []float32, dt, ot compute.DType) [3][]float32 {
			gq, gk, gv := be.FromF32(dq0), be.FromF32(dk0), be.FromF32(dv0)
			dt0, ot0 := be.New(dt, len(d)), be.New(ot, len(o))
			be.WriteF32(dt0, d)
			be.WriteF32(ot0, o)
			ac.backwardOn(t, be, c, gq, gk, gv, dt0, ot0, lse)
			return [3][]float32{readF32(be, gq, len(ac.q)), readF32(be, gk, len(ac.k)), readF32(be, gv, len(ac.v))}
		}
		f32 := run(dr, compute.F32, compute.F32)
		for _, v := range []struct {
			what   string
			dt, ot compute.DType
		}{{"a BF16 dout", compute.BF16, compute.F32}, {"a BF16 out", compute.F32, compute.BF16}, {"BF16 dout and out", compute.BF16, compute.BF16}} {
			bf := run(dr, v.dt, v.ot)
			for i, name := range []string{"dq", "dk", "dv"} {
				if j := firstDiff32(bf[i], f32[i]); j >= 0 {
					t.Fatalf("%s[%d] = %v from %s, %v from F32 tensors of the same values", name, j, bf[i][j], v.what, f32[i][j])
				}
			}
		}
		if c.mode == "simt" {
			return // the fp32 kernels read an F32 dout unrounded
		}
		raw := run(dout, compute.F32, compute.F32)
		for i, name := range []string{"dq", "dk", "dv"} {
			if j := firstDiff32(raw[i], f32[i]); j >= 0 {
				t.Fatalf("%s[%d] = %v from an unrounded F32 dout, %v from its rounding: the BF16 chain read more than dout's rounding", name, j, raw[i][j], f32[i][j])
			}
		}
	})
}

// attnBackwardMode is a path AttentionBackward may take (cuDNN: mode "";
// the own fp32 kernels, "simt"; the tensor-core chain, "mma") with head
// shapes it handles.
type attnBackwardMode struct {
	mode           attnMode
	nHead, nKV, hd int
}

// eachAttnBackwardMode runs f as a subtest for each path, be.attn set to
// it.
func eachAttnBackwardMode(t *testing.T, be *Backend, f func(t *testing.T, c attnBackwardMode)) {
	for _, c := range []attnBackwardMode{{"", 4, 2, 64}, {"simt", 4, 2, 16}, {"mma", 4, 1, 64}} {
		t.Run(fmt.Sprintf("%q_hd%d", c.mode, c.hd), func(t *testing.T) {
			be.attn = c.mode
			defer func() { be.attn = "" }()
			f(t, c)
		})
	}
}

// backwardOn runs be's AttentionBackward of ac (dout, out and lse as
// given) into dq, dk, dv, and fails t unless it ran on cuDNN exactly
// when c.mode is "".
func (ac *attnCase) backwardOn(t *testing.T, be *Backend, c attnBackwardMode, dq, dk, dv, dout, out compute.Tensor, lse []float32) {
	t.Helper()
	calls := be.dnn.calls[1]
	be.AttentionBackward(dq, dk, dv, dout, be.FromF32(ac.q), be.FromF32(ac.k), be.FromF32(ac.v), out,
		be.FromF32(lse), be.FromI32(ac.starts), len(ac.lens), ac.maxLen, ac.tokens, c.nHead, c.nKV, c.hd, float32(1/math.Sqrt(float64(c.hd))))
	if on := be.dnn.calls[1] != calls; on != (c.mode == "") {
		t.Fatalf("mode %q: the backward ran on cuDNN: %v", c.mode, on)
	}
}

// bf16Ulp is the spacing of BF16 values at v's magnitude.
func bf16Ulp(v float32) float64 {
	e := math.Float32bits(v) >> 23 & 0xff
	return math.Ldexp(1, int(e)-127-7)
}

// TestMatMulBackwardBF16DX: a BF16 dx (attention's dout) gains, bit for
// bit, the rounding of what an F32 dx that started at the same values
// gains (the fp32 sum rounded once: an accumulating BF16 dx goes through
// fp32, since cuBLASLt's BF16 C and D round the product before adding C);
// a zeroed BF16 dx (the trainer's: the GEMM's BF16 D, beta 0) is the F32
// dx's rounding; and a biased Linear's GEMMs read the rounding of dout
// that its column sums' pass writes: dx and dw the bits of the same call
// without the bias.
func TestMatMulBackwardBF16DX(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(57, 58))
	for _, sh := range [][3]int{{33, 70, 48}, {130, 256, 96}, {3, 5, 7}} {
		m, n, k := sh[0], sh[1], sh[2]
		t.Run(fmt.Sprintf("m%d_n%d_k%d", m, n, k), func(t *testing.T) {
			x, w, dout := randF32(r, m*k), randF32(r, n*k), randF32(r, m*n)
			dx0, _ := roundBF16(randF32(r, m*k))
			dw0 := randF32(r, n*k)
			run := func(dxt compute.DType, bias, zeroed bool) (dx, dw []float32) {
				gx, gw := be.New(dxt, m*k), be.FromF32(dw0)
				if zeroed {
					be.Zero(gx)
				} else {
					be.WriteF32(gx, dx0)
				}
				var db compute.Tensor
				if bias {
					db = be.New(compute.F32, n)
					be.Zero(db)
				}
				be.MatMulBackward(gx, gw, db, be.FromF32(dout), be.FromF32(x), be.FromF32(w), m, n, k)
				return readF32(be, gx, m*k), readF32(be, gw, n*k)
			}
			x32, w32 := run(compute.F32, false, false)
			xb, wb := run(compute.BF16, false, false)
			xr, _ := roundBF16(x32)
			// Accumulating: the F32 dx's own GEMM, then one rounding.
			if j := firstDiff32(xb, xr); j >= 0 {
				t.Fatalf("BF16 dx[%d] = %v, want the F32 dx's rounding %v (F32 dx %v)", j, xb[j], xr[j], x32[j])
			}
			// Zeroed: cuBLASLt may pick another kernel for the BF16 D than
			// for the F32 one, and so another order of the fp32 sums: where
			// the F32 dx lies that close to a midpoint of two BF16 values,
			// the BF16 dx may be the other one. Anywhere else, the bits.
			z32, _ := run(compute.F32, false, true)
			zb, _ := run(compute.BF16, false, true)
			zr, _ := roundBF16(z32)
			for j := range zb {
				if math.Float32bits(zb[j]) == math.Float32bits(zr[j]) {
					continue
				}
				i, q := j/k, j%k
				var sumAbs float64
				for c := 0; c < n; c++ {
					sumAbs += math.Abs(float64(dout[i*n+c]) * float64(w[c*k+q]))
				}
				mid := (float64(zb[j]) + float64(zr[j])) / 2
				adjacent := math.Abs(float64(zb[j]-zr[j])) <= bf16Ulp(zr[j])
				if !onGPU() || !adjacent || math.Abs(float64(z32[j])-mid) > 1e-6*float64(n)*sumAbs {
					t.Fatalf("zeroed BF16 dx[%d] = %v, want the F32 dx's rounding %v (F32 dx %v)", j, zb[j], zr[j], z32[j])
				}
				t.Logf("zeroed BF16 dx[%d] = %v, the F32 dx %v rounds to %v: %.3g from their midpoint, within the sums' order", j, zb[j], z32[j], zr[j], math.Abs(float64(z32[j])-mid))
			}
			if j := firstDiff32(wb, w32); j >= 0 {
				t.Fatalf("dw[%d] = %v with a BF16 dx, %v with an F32 one", j, wb[j], w32[j])
			}
			changed := 0
			for i := range xb {
				if xb[i] != dx0[i] {
					changed++
				}
			}
			if changed < len(xb)/2 {
				t.Fatalf("only %d of %d dx elements moved", changed, len(xb))
			}
			xbias, wbias := run(compute.F32, true, false)
			if j := firstDiff32(xbias, x32); j >= 0 {
				t.Fatalf("dx[%d] = %v with a bias, %v without", j, xbias[j], x32[j])
			}
			if j := firstDiff32(wbias, w32); j >= 0 {
				t.Fatalf("dw[%d] = %v with a bias, %v without", j, wbias[j], w32[j])
			}
		})
	}
}

// TestLossHeadConformance: the fused loss head's both passes against the
// CPU's on the same BF16-rounded x and w, with forced vocabulary tiles that
// do not divide the vocabulary, K = 0 and K = 64, T = 1 and T = 2; the
// backward's dL/dz is rounded to BF16 before its GEMMs, so dx and dw are
// held to the BF16 dot-product bound of the gradient's magnitude.
func TestLossHeadConformance(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(53, 54))
	N, C, V := 60, 32, 1000
	x := randF32(r, N*C)
	for i := range x {
		x[i] *= 3
	}
	xr, _ := roundBF16(x)
	wr, wh := roundBF16(randF32(r, V*C))
	gw, _ := be.Weight(wh)
	var rows, labels []int32
	for n := 0; n < N; n++ {
		if n%4 != 2 {
			rows = append(rows, int32(n))
			labels = append(labels, int32(r.IntN(V)))
		}
	}
	M := len(rows)
	for _, K := range []int{0, 64} {
		var ids []int32
		for m := 0; m < M; m++ {
			perm := r.Perm(V)[:K]
			sortInts(perm)
			for _, v := range perm {
				ids = append(ids, int32(v))
			}
		}
		for _, invT := range []float32{1, 0.5} {
			for _, tc := range []int{0, 333} {
				t.Run(fmt.Sprintf("K%d_invT%g_tile%d", K, invT, tc), func(t *testing.T) {
					head := func(be compute.Backend, x, w compute.Tensor) *compute.LossHead {
						h := &compute.LossHead{X: x, W: w, Rows: be.FromI32(rows), Labels: be.FromI32(labels), M: M, C: C, V: V, K: K, InvT: invT, TileCols: tc}
						if K > 0 {
							h.TopIDs = be.FromI32(ids)
						}
						return h
					}
					gh, oh := head(be, be.FromF32(x), gw), head(oracle, oracle.FromF32(xr), oracle.FromF32(wr))
					got, want := be.LossHeadForward(gh), oracle.LossHeadForward(oh)
					f := func(s []float64) []float32 {
						o := make([]float32, len(s))
						for i, v := range s {
							o[i] = float32(v)
						}
						return o
					}
					closeTo(t, "LseT", f(got.LseT), f(want.LseT), 1e-5, 1e-6)
					closeTo(t, "Lse1", f(got.Lse1), f(want.Lse1), 1e-5, 1e-6)
					closeTo(t, "Tail", f(got.Tail), f(want.Tail), 1e-7, 1e-4)
					closeTo(t, "ZK", got.ZK, want.ZK, 1e-4, 1e-5)
					closeTo(t, "ZLab", got.ZLab, want.ZLab, 1e-4, 1e-5)

					lseT, lse1 := f(want.LseT), f(want.Lse1)
					a, ck := randF32(r, M), randF32(r, M*K)
					for i := range ck {
						ck[i] *= 0.1
					}
					wsft := float32(0.3)
					coef := func(be compute.Backend) *compute.LossCoef {
						c := &compute.LossCoef{LseT: be.FromF32(lseT), Lse1: be.FromF32(lse1), A: be.FromF32(a), WSFT: wsft}
						if K > 0 {
							c.CK = be.FromF32(ck)
						}
						return c
					}
					dx0, dw0 := randF32(r, N*C), randF32(r, V*C)
					gdx, gdw := be.FromF32(dx0), be.FromF32(dw0)
					be.LossHeadBackward(gh, coef(be), gdx, gdw)
					wdx, wdw := oracle.FromF32(dx0), oracle.FromF32(dw0)
					oracle.LossHeadBackward(oh, coef(oracle), wdx, wdw)
					// dz's BF16 rounding: |dz| <= ~1, V terms into dx, M into dw.
					closeTo(t, "dx", readF32(be, gdx, N*C), readF32(oracle, wdx, N*C), bf16DotTol(V)/2, 1e-3)
					closeTo(t, "dw", readF32(be, gdw, V*C), readF32(oracle, wdw, V*C), bf16DotTol(M), 1e-3)
					// Deterministic: the same bits again.
					gdx2, gdw2 := be.FromF32(dx0), be.FromF32(dw0)
					be.LossHeadBackward(gh, coef(be), gdx2, gdw2)
					same(t, "loss head dx", readF32(be, gdx, N*C), readF32(be, gdx2, N*C))
					same(t, "loss head dw", readF32(be, gdw, V*C), readF32(be, gdw2, V*C))
					again := be.LossHeadForward(gh)
					for i := range got.LseT {
						if got.LseT[i] != again.LseT[i] || got.Tail[i] != again.Tail[i] {
							t.Fatalf("loss head forward is not deterministic at row %d", i)
						}
					}
				})
			}
		}
	}
}

func sortInts(s []int) {
	for i := 1; i < len(s); i++ {
		for j := i; j > 0 && s[j] < s[j-1]; j-- {
			s[j], s[j-1] = s[j-1], s[j]
		}
	}
}

// TestSumSquaresEach: the batched sums (one synchronization for many
// tensors, the gradient norm's) are SumSquares' bit for bit, tensor by
// tensor, the largest grid before a smaller one and after it (the partial
// sums' scratch is shared), an empty tensor, a NaN in one tensor kept to
// that tensor.
func TestSumSquaresEach(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(45, 46))
	sizes := []int{300007, 1, 0, 257, 1 << 18, 5000, 255}
	xs, ns := make([]compute.Tensor, len(sizes)), make([]int, len(sizes))
	for i, n := range sizes {
		x := randF32(r, max(n, 3))
		if i == 5 {
			x[4321] = float32(math.NaN())
		}
		xs[i], ns[i] = be.FromF32(x), n
	}
	got := make([]float64, len(xs))
	be.SumSquaresEach(got, xs, ns)
	for i := range xs {
		want := be.SumSquares(xs[i], ns[i])
		if math.Float64bits(got[i]) != math.Float64bits(want) {
			t.Errorf("tensor %d (n=%d): SumSquaresEach %.17g, SumSquares %.17g", i, ns[i], got[i], want)
		}
	}
	if !math.IsNaN(got[5]) || math.IsNaN(got[4]) || math.IsNaN(got[6]) {
		t.Errorf("a NaN in tensor 5 only: got %v", got)
	}
	be.SumSquaresEach(nil, nil, nil) // nothing to sum: no launch, no wait
	var _ compute.BatchSumSquares = be
}

// TestMultiTensor: AdamWEach, ScaleEach and CopyEach (one launch for
// every tensor) give, bit for bit, what AdamW, Scale and Copy give tensor
// by tensor: the parameters, both moments and the parameters' BF16
// shadows, on tensors around the launch's chunk of 2048 (and empty ones),
// decay on and off; AdamWEach's BF16 copies (bs) hold RoundBF16 of the
// updated parameters.
func TestMultiTensor(t *testing.T) {
	be := testBackend(t)
	sizes := []int{2048, 1, 0, 2047, 2049, 70001, 4096, 3}
	type set struct{ p, g, m, v []compute.Tensor }
	mk := func() set {
		var s set
		r := rand.New(rand.NewPCG(49, 50)) // the same values for both sets
		for _, n := range sizes {
			s.p = append(s.p, be.FromF32(randF32(r, n)))
			s.g = append(s.g, be.FromF32(randF32(r, n)))
			m, v := randF32(r, n), randF32(r, n)
			for i := range v {
				v[i] = v[i] * v[i]
			}
			s.m, s.v = append(s.m, be.FromF32(m)), append(s.v, be.FromF32(v))
		}
		return s
	}
	one, each, copied := mk(), mk(), mk()
	// copied's updates also write BF16 copies of every other tensor (bs).
	bs := make([]compute.Tensor, len(sizes))
	for i, n := range sizes {
		if i%2 == 0 {
			bs[i] = be.New(compute.BF16, n)
		}
	}
	// gemm reads parameter i as a GEMM's weight: after an update has
	// registered it, the first makes its BF16 shadow, which the next
	// updates must write too (the GEMMs after them read it).
	gemm := func(s set, i, n int) {
		out := be.New(compute.F32, 8*(n/64))
		x := be.FromF32(make([]float32, 8*64))
		be.MatMul(out, x, s.p[i], nil, 8, n/64, 64)
		be.Free(out)
		be.Free(x)
	}
	decays := []bool{true, false, true, true, false, true, true, false}
	st := compute.AdamWStep{Beta1: 0.9, Beta2: 0.95, Eps: 1e-8, StepSize: 3e-3, BC2Sqrt: 0.3, Decay: 0.9997}
	for step := 0; step < 3; step++ {
		for i, n := range sizes {
			s := st
			if !decays[i] {
				s.Decay = 1
			}
			be.AdamW(one.p[i], one.g[i], one.m[i], one.v[i], n, s)
		}
		be.AdamWEach(each.p, each.g, each.m, each.v, nil, sizes, decays, st)
		be.AdamWEach(copied.p, copied.g, copied.m, copied.v, bs, sizes, decays, st)
		for i, n := range sizes {
			if step == 0 && (n == 4096 || n == 70001) {
				gemm(one, i, n)
				gemm(each, i, n)
				gemm(copied, i, n)
			}
		}
	}
	// The BF16 copies hold RoundBF16 of the parameters, the rest
	// copied's updates as each's.
	for i, n := range sizes {
		for j, pair := range [][2]compute.Tensor{{each.p[i], copied.p[i]}, {each.m[i], copied.m[i]}, {each.v[i], copied.v[i]}} {
			a, b := readF32(be, pair[0], n), readF32(be, pair[1], n)
			if k := firstDiff32(a, b); k >= 0 {
				t.Fatalf("tensor %d (n=%d), %s[%d]: %v without a BF16 copy, %v with", i, n, []string{"p", "m", "v"}[j], k, a[k], b[k])
			}
		}
		if bs[i] == nil {
			continue
		}
		r := be.New(compute.BF16, n)
		be.RoundBF16(r, one.p[i], n)
		a, b := readF32(be, r, n), readF32(be, bs[i], n)
		be.Free(r)
		if k := firstDiff32(a, b); k >= 0 {
			t.Fatalf("tensor %d (n=%d): BF16 copy [%d] = %v, RoundBF16 of the parameter %v", i, n, k, b[k], a[k])
		}
	}
	for i := range sizes {
		be.Scale(one.g[i], sizes[i], 0.37)
	}
	be.ScaleEach(each.g, sizes, 0.37)
	// Copies of the second moments, into tensors one longer (whose last
	// element stays).
	var cOne, cEach []compute.Tensor
	for i, n := range sizes {
		cOne, cEach = append(cOne, be.FromF32(randF32(rand.New(rand.NewPCG(53, 54)), n+1))), append(cEach, be.FromF32(randF32(rand.New(rand.NewPCG(53, 54)), n+1)))
		be.Copy(cOne[i], one.v[i])
	}
	be.CopyEach(cEach, each.v)
	for i, n := range sizes {
		for j, pair := range [][2]compute.Tensor{{one.p[i], each.p[i]}, {one.m[i], each.m[i]}, {one.v[i], each.v[i]}, {one.g[i], each.g[i]}, {cOne[i], cEach[i]}} {
			a, b := make([]float32, pair[0].Len()), make([]float32, pair[1].Len())
			be.ReadF32(pair[0], a)
			be.ReadF32(pair[1], b)
			for k := range a {
				if math.Float32bits(a[k]) != math.Float32bits(b[k]) {
					t.Fatalf("tensor %d (n=%d), %s[%d]: one at a time %v, multi-tensor %v", i, n, []string{"p", "m", "v", "g", "copy of v"}[j], k, a[k], b[k])
				}
			}
		}
		if n == 4096 || n == 70001 {
			// The shadows: what a GEMM reads now.
			outs := [2][]float32{}
			for k, s := range []set{one, each} {
				out := be.New(compute.F32, 8*(n/64))
				x := be.FromF32(randF32(rand.New(rand.NewPCG(51, 52)), 8*64))
				be.MatMul(out, x, s.p[i], nil, 8, n/64, 64)
				outs[k] = make([]float32, 8*(n/64))
				be.ReadF32(out, outs[k])
				be.Free(out)
				be.Free(x)
			}
			for k := range outs[0] {
				if math.Float32bits(outs[0][k]) != math.Float32bits(outs[1][k]) {
					t.Fatalf("tensor %d: a GEMM after the updates reads other weights (shadow): %v vs %v at %d", i, outs[0][k], outs[1][k], k)
				}
			}
		}
	}
	if be.ShadowBytes() == 0 {
		t.Fatalf("no parameter has a BF16 shadow: the test does not reach the updates' shadow writes")
	}
	var _ compute.MultiTensor = be
}

// TestEmbedBackwardOrder: the embedding's backward adds each token's
// gradient row to its id's row in token order, as compute/cpu's serial
// loop does, so the two agree bit for bit: ids repeated far apart and
// next to each other (a vocabulary of 5 over 1003 tokens, a run of one
// id, one id at every 8-token edge), an id used once (the last token's),
// and a width that is no multiple of the block's threads.
func TestEmbedBackwardOrder(t *testing.T) {
	be := testBackend(t)
	r := rand.New(rand.NewPCG(53, 54))
	const V, n = 5, 1003
	ids := make([]int32, n)
	for i := range ids {
		switch {
		case i >= 100 && i < 140:
			ids[i] = 3 // a run of one id
		case i%8 == 7 || i%8 == 0:
			ids[i] = 1 // the batches' edges
		default:
			ids[i] = int32(r.IntN(V - 1))
		}
	}
	ids[n-1] = V - 1 // its only token
	// Width 300: more columns than a block's threads.
	for _, dim := range []int{70, 300} {
		// Gradients of mixed magnitudes, so that the order of the
		// additions shows in the rounding.
		dout := randF32(r, n*dim)
		for i := range dout {
			dout[i] *= float32(math.Pow(10, float64(r.IntN(7)-3)))
		}
		table := randF32(r, V*dim)
		run := func(be compute.Backend) []float32 {
			dt := be.FromF32(table)
			be.EmbedBackward(dt, be.FromF32(dout), be.FromI32(ids), n, dim)
			return readF32(be, dt, V*dim)
		}
		got, want := run(be), run(oracle)
		for i := range want {
			if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
				t.Fatalf("dim %d: dtable[%d][%d]: %v, the CPU's serial walk %v", dim, i/dim, i%dim, got[i], want[i])
			}
		}
	}
}

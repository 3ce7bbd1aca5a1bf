package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"strings"
	"testing"

	"distill/compute"
	"distill/compute/computetest"
)

// TestMoEGroupedGEMM: the experts' GEMMs on the device's grouping
// (k_moe_scan, k_moe_gemm_glu for gate and up with the SwiGLU, k_moe_gemm
// for down; no host round trip) against the host's grouping and
// per-expert cuBLASLt GEMMs on the same backend (the same routing and
// BF16 operands, so only the summation order differs), and bit for bit
// against the earlier kernels (MoEGEMM v1: the tokens gathered, 32-wide K
// steps in two buffers, the SwiGLU a pass of its own), on a shape that
// exercises every edge of the kernels: experts with several row tiles and
// a partial one, column tiles with a partial one (I = 200: four of the
// fused kernel's 64, three of 128 for v1), and K steps that wrap the three
// buffers with a partial last one; the profile shows the grouped launches
// and no per-expert GEMM. (TestMoEConformance
// holds both against compute/cpu.)
func TestMoEGroupedGEMM(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	r := rand.New(rand.NewPCG(91, 92))
	const tokens, H, I, E, K = 300, 136, 200, 5, 2
	c := newMoECase(r, tokens, H, I, E, K, true)
	be.Profile() // reset
	got := c.run(be, bf16Weight(t, be))
	prof := profileCalls(be)
	testMoEHostGrouping = true
	want := c.run(be, bf16Weight(t, be))
	testMoEHostGrouping = false
	// Sums of H or I BF16 products of O(1) in fp32, in two orders.
	closeTo(t, "grouped moe vs per-expert cuBLASLt", got, want, 1e-4*math.Sqrt(float64(H*I)), 1e-4)
	// Gate and up in one launch with the SwiGLU, the down projection in
	// another; the tokens read in place (no gathered copy).
	if prof["k_moe_gemm_glu"] != 1 || prof["k_moe_gemm"] != 1 || prof["k_moe_scan"] != 1 || prof["k_moe_gather"] != 0 {
		t.Fatalf("profile %v: want 1 k_moe_gemm_glu, 1 k_moe_gemm, 1 k_moe_scan and no k_moe_gather", prof)
	}
	// The earlier kernels (32-wide K steps in two buffers, the tokens
	// gathered, the SwiGLU a pass of its own): the same bits.
	v1 := testBackendWith(t, Options{Profile: true, MoEGEMM: "v1"})
	v1.Profile() // reset
	same(t, "grouped moe, default vs v1 kernels", got, c.run(v1, bf16Weight(t, v1)))
	prof = profileCalls(v1)
	if prof["k_moe_gemm_v1"] != 3 || prof["k_moe_gather"] != 1 || prof["k_moe_gemm_glu"] != 0 {
		t.Fatalf("v1 profile %v: want 3 k_moe_gemm_v1 launches, 1 k_moe_gather and no k_moe_gemm_glu", prof)
	}
	if _, err := Open(Options{KernelCache: kernelCacheForTests(t), MoEGEMM: "v2"}); err == nil || !strings.Contains(err.Error(), "v2") {
		t.Fatalf("Open with MoEGEMM v2: %v, want an error naming it", err)
	}
	// A GPU whose blocks opt in to less shared memory than the default
	// kernels stage (Ada's 99 KB) runs v1, saying so.
	if !onGPU() {
		t.Setenv("DISTILL_EMU_OPTIN_SMEM", "101376")
		var logged []string
		ada, err := Open(Options{KernelCache: kernelCacheForTests(t), Profile: true, Logf: func(f string, a ...any) { logged = append(logged, fmt.Sprintf(f, a...)) }})
		if err != nil {
			t.Fatal(err)
		}
		defer ada.Close()
		ada.Profile()
		same(t, "grouped moe, 99 KB of shared memory vs the default", got, c.run(ada, bf16Weight(t, ada)))
		prof = profileCalls(ada)
		if prof["k_moe_gemm_v1"] != 3 || !strings.Contains(strings.Join(logged, "\n"), "running the earlier kernels (MoEGEMM v1)") {
			t.Fatalf("99 KB of shared memory: profile %v, log %q: want the v1 kernels, named in the log", prof, logged)
		}
	}
	if n := prof["cublasLt GEMM (MoE)"]; n != 1 {
		t.Fatalf("profile %v: %d cuBLASLt GEMMs in MoE, want the router's alone", prof, n)
	}
	if !moeGroupedOK(H, I) || moeGroupedOK(12, 20) || moeGroupedOK(16, 36) {
		t.Fatal("moeGroupedOK: want multiples of 8 only")
	}
}

// TestMoEFP8Grouped: an MoE block with FP8 experts on the device's
// grouping (k_moe_gemm_fp8_glu for gate and up with the SwiGLU,
// k_moe_gemm_fp8 for down, the tokens' codes read in place; no host wait)
// against the host's grouping with a cuBLASLt FP8 GEMM per expert, and
// both against the CPU's FP8 block (TestMoEFP8Conformance's definition),
// on a shape with experts of two row tiles, a partial column tile of the
// fused kernel (I = 144: 64, 64, 16) and K steps that wrap the three
// buffers (H = 208: 64, 64, 64, 16 codes). The sums differ in order only,
// but h's quantization can move a code when a sum lands within rounding
// of an E4M3 tie: hence TestMoEFP8Conformance's tolerance.
func TestMoEFP8Grouped(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	const tokens, H, I, E, K = 300, 208, 144, 5, 2
	r := rand.New(rand.NewPCG(97, 98))
	c := newMoECase(r, tokens, H, I, E, K, true)
	want := c.run(oracle, c.fp8Weights(t, oracle))
	be.Profile() // reset
	got := c.run(be, c.fp8Weights(t, be))
	prof := profileCalls(be)
	testMoEHostGrouping = true
	host := c.run(be, c.fp8Weights(t, be))
	testMoEHostGrouping = false
	tol := 2e-3 * math.Sqrt(float64(H*I)) / 4
	closeTo(t, "grouped fp8 moe vs cpu", got, want, tol, 1e-3)
	// The per-expert path disagrees with the CPU on an H200 (2026-11-27
	// and -28, every shape below, with or without split-K; memcheck
	// clean; cause unknown), so a real GPU refuses it (MoEForward's
	// panic names the fix): there its disagreement is logged for
	// diagnosis, not held; the emulator holds it.
	perExpertOff := onGPU()
	if rows := badRows(host, want, H, tol, 1e-3); rows != "" {
		if perExpertOff {
			t.Logf("per-expert cuBLASLt fp8 moe vs cpu (off on GPUs; logged, not held): rows (token: bad columns of %d, worst |Δ|): %s", H, rows)
		} else {
			t.Errorf("per-expert cuBLASLt fp8 moe vs cpu: rows (token: bad columns of %d, worst |Δ|): %s", H, rows)
		}
		// Diagnosis: the same without split-K, and with one expert.
		dropPlans := func() {
			for _, q := range be.plans {
				be.lt.destroyPlan(q)
			}
			clear(be.plans)
		}
		func() {
			testMoEHostGrouping, testGemmNoSplitK = true, true
			dropPlans()
			defer func() {
				testMoEHostGrouping, testGemmNoSplitK = false, false
				dropPlans()
				if r := recover(); r != nil {
					t.Logf("without split-K: %v", r)
				}
			}()
			nosplit := c.run(be, c.fp8Weights(t, be))
			t.Logf("without split-K: %q", badRows(nosplit, want, H, tol, 1e-3))
		}()
		for _, sh := range [][5]int{{300, 208, 144, 1, 1}, {300, 128, 96, 5, 2}, {64, 208, 144, 5, 2}, {300, 256, 512, 5, 2}} {
			c := newMoECase(r, sh[0], sh[1], sh[2], sh[3], sh[4], true)
			tol := 2e-3 * math.Sqrt(float64(sh[1]*sh[2])) / 4
			want := c.run(oracle, c.fp8Weights(t, oracle))
			testMoEHostGrouping = true
			host := c.run(be, c.fp8Weights(t, be))
			testMoEHostGrouping = false
			t.Logf("per-expert %v: %q", sh, badRows(host, want, sh[1], tol, 1e-3))
		}
	}
	if !perExpertOff {
		closeTo(t, "grouped fp8 moe vs per-expert cuBLASLt", got, host, tol, 1e-3)
	}
	if prof["k_moe_gemm_fp8_glu"] != 1 || prof["k_moe_gemm_fp8"] != 1 || prof["k_moe_scan"] != 1 || prof["cublasLt GEMM (MoE)"] != 1 {
		t.Fatalf("profile %v: want 1 k_moe_gemm_fp8_glu, 1 k_moe_gemm_fp8, 1 k_moe_scan and the router's cuBLASLt GEMM alone", prof)
	}
}

// badRows lists the rows of got (rows of cols) with elements outside
// atol + rtol·|want|: each row's count of them and its worst difference,
// the first 12 rows; "" when there are none.
func badRows(got, want []float32, cols int, atol, rtol float64) string {
	var b strings.Builder
	n := 0
	for r := 0; r*cols < len(want); r++ {
		bad, worst := 0, 0.0
		for j := r * cols; j < (r+1)*cols; j++ {
			d := math.Abs(float64(got[j] - want[j]))
			if !(d <= atol+rtol*math.Abs(float64(want[j]))) {
				bad++
				worst = max(worst, d)
			}
		}
		if bad > 0 {
			if n < 12 {
				fmt.Fprintf(&b, "%d: %d, %.3g; ", r, bad, worst)
			}
			n++
		}
	}
	if n > 12 {
		fmt.Fprintf(&b, "and %d rows more", n-12)
	}
	return b.String()
}

// TestMoEGroupedBackward: MoEBackward on the device's grouping (k_moe_tiles,
// k_moe_gemm_nn for dh and dx, k_moe_wgrad_gemm for the experts' weight
// gradients; no host round trip) against the host's grouping and
// per-expert cuBLASLt GEMMs on the same backend, from the same forward:
// only the summation order differs. The shape has experts of several row
// tiles, a starved expert (its gradients untouched), and several steps of
// every kernel's pipeline (rows of an expert > 3·MOE_BK, H and I > 3·MOE_BK,
// and more than one tile of the gradients' both dimensions); with QAD off
// and on. TestMoETrainConformance holds both against compute/cpu.
func TestMoEGroupedBackward(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	v1 := testBackendWith(t, Options{MoEGEMM: "v1", Profile: true})
	r := rand.New(rand.NewPCG(93, 94))
	for _, qad := range []bool{false, true} {
		c := newMoETrainCase(r, 150, 136, 144, 6, 2, true, true, 3)
		if qad {
			c.inAmax, c.hAmax = 2688.0/1024, 2688.0/1024
		}
		be.Profile() // reset
		got := c.run(be, true)
		// The earlier kernels give the same bits: the forward's saved
		// products, the backward's NN GEMMs and weight gradients, each sum
		// in ascending k or rows; they gather the tokens for the forward
		// and again for dGate and dUp, the default kernels read them in
		// place.
		v1.Profile()
		g1 := c.run(v1, true)
		gathers := func(be *Backend) int {
			n := 0
			for _, e := range be.Profile() {
				if e.Name == "k_moe_gather" {
					n += e.Calls
				}
			}
			return n
		}
		if n, n1 := gathers(be), gathers(v1); n != 0 || n1 != 2 {
			t.Fatalf("k_moe_gather launches: %d (default), %d (v1), want 0 and 2", n, n1)
		}
		same(t, "dx, default vs v1 kernels", got.dx, g1.dx)
		for e := 0; e < c.E; e++ {
			same(t, "dGate, default vs v1 kernels", got.dgate[e], g1.dgate[e])
			same(t, "dUp, default vs v1 kernels", got.dup[e], g1.dup[e])
			same(t, "dDown, default vs v1 kernels", got.ddown[e], g1.ddown[e])
		}
		testMoEHostGrouping = true
		want := c.run(be, true)
		testMoEHostGrouping = false
		// Sums of up to 150 rows (weights) or H, I terms (dh, dx) of BF16
		// products in fp32, in two orders.
		tol := func(what string, g, w []float32) { closeTo(t, what, g, w, 1e-4*math.Sqrt(150*144), 1e-4) }
		tol("dx", got.dx, want.dx)
		tol("dRouter", got.drouter, want.drouter)
		for e := 0; e < c.E; e++ {
			tol("dGate", got.dgate[e], want.dgate[e])
			tol("dUp", got.dup[e], want.dup[e])
			tol("dDown", got.ddown[e], want.ddown[e])
		}
		same(t, "starved expert's dGate", got.dgate[3], c.dg0[3])
		same(t, "starved expert's dDown", got.ddown[3], c.dd0[3])
	}
}

// TestMoEFrozenBackward: MoEBackward of a frozen block (dm nil, a LoRA
// student's base) gives the dx of the backward with weight gradients bit
// for bit, on the device's grouping and on the host's, and launches no
// weight-gradient GEMM: no k_moe_wgrad_gemm, and of cuBLASLt's only the
// router's dx GEMM (the host grouping's per-expert dh and dx GEMMs
// besides).
func TestMoEFrozenBackward(t *testing.T) {
	be := testBackendWith(t, Options{Profile: true})
	r := rand.New(rand.NewPCG(95, 96))
	for _, host := range []bool{false, true} {
		c := newMoETrainCase(r, 150, 136, 144, 6, 2, true, true, 3)
		testMoEHostGrouping = host
		want := c.run(be, true)
		c.frozen = true
		be.Profile() // reset
		got := c.run(be, true)
		prof := profileCalls(be)
		testMoEHostGrouping = false
		same(t, fmt.Sprintf("frozen dx (host grouping %v)", host), got.dx, want.dx)
		if n := prof["k_moe_wgrad_gemm"]; n != 0 {
			t.Fatalf("host grouping %v: profile %v: %d k_moe_wgrad_gemm launches in a frozen backward, want none", host, prof, n)
		}
		// The forward's router GEMM and, with the host's grouping, 3 GEMMs
		// an expert with rows; the backward's router dx GEMM, and 3 an
		// expert with rows (dh, dx from gate, dx from up).
		wantGEMMs := 2
		if host {
			wantGEMMs += 6 * (c.E - 1) // expert 3 is starved
		}
		if n := prof["cublasLt GEMM (MoEForward)"] + prof["cublasLt GEMM (MoEBackward)"]; n != wantGEMMs {
			t.Fatalf("host grouping %v: profile %v: %d cuBLASLt GEMMs, want %d (no weight gradients)", host, prof, n, wantGEMMs)
		}
	}
}

// TestMoELoRAHostGrouping runs the suite's MoELoRA subtest (the experts'
// adapters against the float64 block and finite differences) on the
// host's grouping and per-expert cuBLASLt GEMMs (the path of shapes
// k_moe_gemm cannot take); TestSuite runs it on the device's.
func TestMoELoRAHostGrouping(t *testing.T) {
	be := testBackend(t)
	testMoEHostGrouping = true
	defer func() { testMoEHostGrouping = false }()
	tol := suiteTol
	tol.Skip = func(name string) string {
		if name != "MoELoRA" {
			return "TestSuite runs it"
		}
		return ""
	}
	computetest.Run(t, be, tol)
}

// BenchmarkMoE: one Qwen3-30B-A3B-shaped MoE layer (16384 tokens, 128
// experts of width 768, top-8, hidden 2048) on the default grouped GEMMs
// and on the earlier ones (MoEGEMM v1), on the same GPU in the same run:
// the teacher's forward (MoE, BF16 weights; and FP8 weights, grouped =
// 1 where they ran on the device's grouping) and the student's step
// (MoEForward + MoEBackward, fp32 masters read through their BF16
// shadows). It reports ms a call and TFLOP/s over the experts' GEMMs
// (6·T·K·H·I a forward, three times that with the backward). It needs a
// GPU; DISTILL_TRAIN_BENCH_DRYRUN=1 runs its code on the emulator at a
// tiny shape. train-lora is a LoRA student's step on the default kernels:
// the base frozen in BF16 (no weight gradients), every expert's gate, up
// and down adapted at rank 16 with lora_dropout 0.1 (moelora.cu's grouped
// kernels); its TFLOP/s count the base's GEMMs as train's (the frozen
// backward skips a third of them: a lower bound of the work) and not the
// adapters'. routing-stats is the layer's load-balancing statistics and
// gradient (benchRoutingStats), a training step's for each MoE layer and
// row.
func BenchmarkMoE(b *testing.B) {
	T, H, I, E, K := 16384, 2048, 768, 128, 8
	switch {
	case onGPU():
	case os.Getenv("DISTILL_TRAIN_BENCH_DRYRUN") == "1":
		useEmu(b)
		T, H, I, E, K = 96, 64, 48, 8, 2
	default:
		b.Skip("benchmarks need a GPU: set DISTILL_CUDA_TEST=gpu (scripts/gpu-suite.sh); DISTILL_TRAIN_BENCH_DRYRUN=1 runs this one's code on the emulator")
	}
	r := rand.New(rand.NewPCG(7, 8))
	x, dout := randF32(r, T*H), randF32(r, T*H)
	router := randF32(r, E*H)
	experts := make([][3][]float32, E)
	for e := range experts {
		for j := range experts[e] {
			experts[e][j] = randF32(r, I*H)
			for i := range experts[e][j] {
				experts[e][j][i] *= 0.03
			}
		}
	}
	fwdFlops := 6 * float64(T) * float64(K) * float64(H) * float64(I)
	for _, v := range []string{"", "v1"} {
		be, err := Open(Options{KernelCache: kernelCacheForTests(b), MoEGEMM: v})
		if err != nil {
			b.Fatal(err)
		}
		name := "default"
		if v != "" {
			name = v
		}
		weight := bf16Weight(b, be)
		moeWeights := func(w func([]float32) compute.Tensor) *compute.MoEWeights {
			mw := &compute.MoEWeights{Router: w(router), NumExperts: E, TopK: K, Hidden: H, Inter: I, NormTopK: true}
			for e := range experts {
				mw.Gate, mw.Up, mw.Down = append(mw.Gate, w(experts[e][0])), append(mw.Up, w(experts[e][1])), append(mw.Down, w(experts[e][2]))
			}
			return mw
		}
		xt, outt := be.FromF32(x), be.New(compute.F32, T*H)
		b.Run(fmt.Sprintf("forward/%s/T%d_H%d_I%d_E%d_K%d", name, T, H, I, E, K), func(b *testing.B) {
			mw := moeWeights(weight)
			timeMoE(b, be, fwdFlops, func() { be.MoE(outt, xt, mw, T) })
		})
		if v == "" {
			// FP8 experts (an FP8 teacher's): on the device's grouping
			// where the GPU and NVRTC have E4M3 tensor-core products, else
			// a cuBLASLt GEMM per expert.
			b.Run(fmt.Sprintf("forward-fp8/T%d_H%d_I%d_E%d_K%d", T, H, I, E, K), func(b *testing.B) {
				mw := &compute.MoEWeights{Router: weight(router), NumExperts: E, TopK: K, Hidden: H, Inter: I, NormTopK: true}
				for e := range experts {
					for j, n := range []int{I, I, H} {
						q, err := compute.QuantizeFP8(experts[e][j], n, len(experts[e][j])/n)
						if err != nil {
							b.Fatal(err)
						}
						w, err := be.WeightFP8(q)
						if err != nil {
							b.Skipf("FP8 weights: %v", err)
						}
						switch j {
						case 0:
							mw.Gate = append(mw.Gate, w)
						case 1:
							mw.Up = append(mw.Up, w)
						default:
							mw.Down = append(mw.Down, w)
						}
					}
				}
				timeMoE(b, be, fwdFlops, func() { be.MoE(outt, xt, mw, T) })
				grouped := 0.0
				if be.mmaE4M3() {
					grouped = 1
				}
				b.ReportMetric(grouped, "grouped")
			})
		}
		b.Run(fmt.Sprintf("train/%s/T%d_H%d_I%d_E%d_K%d", name, T, H, I, E, K), func(b *testing.B) {
			mw := moeWeights(be.FromF32)
			dm := &compute.MoEWeights{Router: be.New(compute.F32, E*H), NumExperts: E, TopK: K, Hidden: H, Inter: I}
			for e := 0; e < E; e++ {
				dm.Gate, dm.Up, dm.Down = append(dm.Gate, be.New(compute.F32, I*H)), append(dm.Up, be.New(compute.F32, I*H)), append(dm.Down, be.New(compute.F32, H*I))
			}
			nf, ni := compute.MoESavedSizes(T, E, K, H, I)
			s := compute.NewMoESaved(be, be.New(compute.F32, nf), be.New(compute.I32, ni), T, E, K, H, I)
			dt, dx := be.FromF32(dout), be.New(compute.F32, T*H)
			timeMoE(b, be, 3*fwdFlops, func() {
				be.MoEForward(outt, xt, mw, s, T)
				be.MoEBackward(dx, dm, dt, xt, mw, s, nil, T)
			})
		})
		if v == "" {
			b.Run(fmt.Sprintf("train-lora/r16/T%d_H%d_I%d_E%d_K%d", T, H, I, E, K), func(b *testing.B) {
				benchMoELoRA(b, be, moeWeights(weight), xt, outt, dout, T)
			})
			b.Run(fmt.Sprintf("routing-stats/T%d_E%d", T, E), func(b *testing.B) {
				benchRoutingStats(b, be, r, T, E)
			})
		}
		be.Close()
	}
}

// benchMoELoRA times MoEForward + MoEBackward of a LoRA student's MoE
// layer on be: mw's experts (BF16 weights) frozen, a rank-16 adapter on
// every projection of every expert, lora_dropout 0.1.
func benchMoELoRA(b *testing.B, be *Backend, mw *compute.MoEWeights, xt, outt compute.Tensor, dout []float32, T int) {
	const rank = 16
	E, K, H, I := mw.NumExperts, mw.TopK, mw.Hidden, mw.Inter
	r := rand.New(rand.NewPCG(9, 10))
	adapter := func(in, out, e, j int) *compute.LoRA {
		a, bm := randF32(r, rank*in), randF32(r, out*rank)
		for i := range a {
			a[i] *= 0.03
		}
		for i := range bm {
			bm[i] *= 0.03
		}
		return &compute.LoRA{A: be.FromF32(a), B: be.FromF32(bm), DA: be.New(compute.F32, rank*in), DB: be.New(compute.F32, out*rank),
			Rank: rank, In: in, Out: out, Scale: 2, Dropout: 0.1, Stream: uint64(3*e + j)}
	}
	mw.Adapters = make([]compute.MoEAdapter, E)
	for e := range mw.Adapters {
		mw.Adapters[e] = compute.MoEAdapter{Gate: adapter(H, I, e, 0), Up: adapter(H, I, e, 1), Down: adapter(I, H, e, 2)}
	}
	mw.Drop = &compute.MoEDrop{Step: 1, Row: 0}
	nf, ni := compute.MoESavedSizes(T, E, K, H, I)
	s := compute.NewMoESaved(be, be.New(compute.F32, nf), be.New(compute.I32, ni), T, E, K, H, I)
	dt, dx := be.FromF32(dout), be.New(compute.F32, T*H)
	timeMoE(b, be, 2*6*float64(T)*float64(K)*float64(H)*float64(I), func() {
		be.MoEForward(outt, xt, mw, s, T)
		be.MoEBackward(dx, nil, dt, xt, mw, s, nil, T)
	})
}

// benchRoutingStats times the load-balancing loss's statistics of one
// MoE layer of T tokens and E experts, as a training step records them
// for each MoE layer and row (compute.MoERouting: Record, k_moe_stats'
// float64 column sums of the (T, E) probabilities, one thread per expert
// adding the tokens in order; and AuxGrad, k_moe_aux_grad): ms a call and
// the probabilities' GB/s. Record reads only the saved probabilities and
// offsets, random here.
func benchRoutingStats(b *testing.B, be *Backend, r *rand.Rand, T, E int) {
	p := make([]float32, T*E)
	for i := range p {
		p[i] = r.Float32() / float32(E)
	}
	off := make([]int32, E+1)
	for e := 1; e <= E; e++ {
		off[e] = off[e-1] + int32(r.IntN(2*T/E+1))
	}
	s := &compute.MoESaved{Probs: be.FromF32(p), Offsets: be.FromI32(off)}
	rt, dprob := be.NewMoERouting(1, E), be.New(compute.F32, E)
	defer rt.Free()
	call := func() {
		rt.Record(0, s, T)
		rt.AuxGrad(dprob, 0.001, T)
	}
	call()
	be.wait()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		call()
	}
	be.wait()
	sec := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(1e3*sec, "ms/call")
	b.ReportMetric(float64(T*E*4)/sec/1e9, "GB/s")
}

// timeMoE times call on be, after one call to warm up (the memory pool,
// the router's copy, plans), and reports ms a call and TFLOP/s of flops
// a call.
func timeMoE(b *testing.B, be *Backend, flops float64, call func()) {
	call()
	be.wait()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		call()
	}
	be.wait()
	sec := b.Elapsed().Seconds() / float64(b.N)
	b.ReportMetric(1e3*sec, "ms/call")
	b.ReportMetric(flops/sec/1e12, "TFLOP/s")
}

// TestMoEFP8NeedsGroupedKernels: on a real driver, an MoE with FP8
// experts that cannot take the grouped FP8 kernels (an NVRTC older than
// 12.4) is refused naming what it needs, instead of running the
// per-expert cuBLASLt path that failed its test on an H200. The emulator
// stands in for such a driver (testAsRealDriver, testOldNVRTC).
func TestMoEFP8NeedsGroupedKernels(t *testing.T) {
	if onGPU() {
		t.Skip("checked on the emulator: a GPU run would refuse only under an old NVRTC")
	}
	be := testBackend(t)
	r := rand.New(rand.NewPCG(5, 6))
	c := newMoECase(r, 20, 32, 48, 3, 2, true)
	testAsRealDriver, testOldNVRTC = true, true
	defer func() { testAsRealDriver, testOldNVRTC = false, false }()
	defer func() {
		msg := fmt.Sprint(recover())
		if !strings.Contains(msg, "NVRTC 12.4 or newer") || !strings.Contains(msg, "BF16") {
			t.Fatalf("panic %q: want the refusal naming NVRTC 12.4 and BF16 weights", msg)
		}
	}()
	c.run(be, c.fp8Weights(t, be))
}

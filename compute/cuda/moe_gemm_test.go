package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
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
	if !onGPU() {
		useEmu(t)
	}
	be, err := Open(Options{KernelCache: kernelCacheForTests(t), Profile: true})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	r := rand.New(rand.NewPCG(91, 92))
	const tokens, H, I, E, K = 300, 136, 200, 5, 2
	c := newMoECase(r, tokens, H, I, E, K, true)
	weight := func(s []float32) compute.Tensor {
		h := make([]uint16, len(s))
		compute.NarrowBF16(h, s)
		w, err := be.Weight(h)
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	be.Profile() // reset
	got := c.run(be, weight)
	prof := map[string]int{}
	for _, e := range be.Profile() {
		prof[e.Name] = e.Calls
	}
	testMoEHostGrouping = true
	want := c.run(be, weight)
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
	v1, err := Open(Options{KernelCache: kernelCacheForTests(t), Profile: true, MoEGEMM: "v1"})
	if err != nil {
		t.Fatal(err)
	}
	defer v1.Close()
	weight1 := func(s []float32) compute.Tensor {
		h := make([]uint16, len(s))
		compute.NarrowBF16(h, s)
		w, err := v1.Weight(h)
		if err != nil {
			t.Fatal(err)
		}
		return w
	}
	v1.Profile() // reset
	same(t, "grouped moe, default vs v1 kernels", got, c.run(v1, weight1))
	prof = map[string]int{}
	for _, e := range v1.Profile() {
		prof[e.Name] = e.Calls
	}
	if prof["k_moe_gemm_v1"] != 3 || prof["k_moe_gather"] != 1 || prof["k_moe_gemm_glu"] != 0 {
		t.Fatalf("v1 profile %v: want 3 k_moe_gemm_v1 launches, 1 k_moe_gather and no k_moe_gemm_glu", prof)
	}
	if _, err := Open(Options{KernelCache: kernelCacheForTests(t), MoEGEMM: "v2"}); err == nil || !strings.Contains(err.Error(), "v2") {
		t.Fatalf("Open with MoEGEMM v2: %v, want an error naming it", err)
	}
	if n := prof["cublasLt GEMM (MoE)"]; n != 1 {
		t.Fatalf("profile %v: %d cuBLASLt GEMMs in MoE, want the router's alone", prof, n)
	}
	if !moeGroupedOK(H, I) || moeGroupedOK(12, 20) || moeGroupedOK(16, 36) {
		t.Fatal("moeGroupedOK: want multiples of 8 only")
	}
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
	if !onGPU() {
		useEmu(t)
	}
	be, err := Open(Options{KernelCache: kernelCacheForTests(t)})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	v1, err := Open(Options{KernelCache: kernelCacheForTests(t), MoEGEMM: "v1"})
	if err != nil {
		t.Fatal(err)
	}
	defer v1.Close()
	r := rand.New(rand.NewPCG(93, 94))
	for _, qad := range []bool{false, true} {
		c := newMoETrainCase(r, 150, 136, 144, 6, 2, true, true, 3)
		if qad {
			c.inAmax, c.hAmax = 2688.0/1024, 2688.0/1024
		}
		got := c.run(be, true)
		// The earlier kernels give the same bits: the forward's saved
		// products and the backward's NN GEMMs, each sum in ascending k.
		g1 := c.run(v1, true)
		same(t, "dx, default vs v1 kernels", got.dx, g1.dx)
		for e := 0; e < c.E; e++ {
			same(t, "dGate, default vs v1 kernels", got.dgate[e], g1.dgate[e])
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
	if !onGPU() {
		useEmu(t)
	}
	be, err := Open(Options{KernelCache: kernelCacheForTests(t), Profile: true})
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	r := rand.New(rand.NewPCG(95, 96))
	for _, host := range []bool{false, true} {
		c := newMoETrainCase(r, 150, 136, 144, 6, 2, true, true, 3)
		testMoEHostGrouping = host
		want := c.run(be, true)
		c.frozen = true
		be.Profile() // reset
		got := c.run(be, true)
		prof := map[string]int{}
		for _, e := range be.Profile() {
			prof[e.Name] = e.Calls
		}
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

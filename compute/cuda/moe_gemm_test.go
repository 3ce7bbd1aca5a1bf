package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"distill/compute"
)

// TestMoEGroupedGEMM: the experts' GEMMs on the device's grouping
// (k_moe_scan, k_moe_gemm; no host round trip) against the host's grouping
// and per-expert cuBLASLt GEMMs on the same backend (the same routing and
// BF16 operands, so only the summation order differs), on a shape that
// exercises every edge of the kernel: experts with several row tiles and a
// partial one, two column tiles with a partial one, and five K steps of
// its double-buffered pipeline with a partial last one; the profile shows
// the three grouped launches and no per-expert GEMM. (TestMoEConformance
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
	if prof["k_moe_gemm"] != 3 || prof["k_moe_scan"] != 1 {
		t.Fatalf("profile %v: want 3 k_moe_gemm launches and 1 k_moe_scan", prof)
	}
	if n := prof["cublasLt GEMM (MoE)"]; n != 1 {
		t.Fatalf("profile %v: %d cuBLASLt GEMMs in MoE, want the router's alone", prof, n)
	}
	if !moeGroupedOK(H, I) || moeGroupedOK(12, 20) || moeGroupedOK(16, 36) {
		t.Fatal("moeGroupedOK: want multiples of 8 only")
	}
}

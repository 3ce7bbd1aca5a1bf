package cuda

import (
	"fmt"
	"math"
	"math/rand/v2"
	"os"
	"testing"

	"distill/compute"
	"distill/compute/cpu"
	"distill/compute/cuda/cudaemu"
)

// The conformance tests run compute/cuda and compute/cpu (the oracle) on
// the same inputs. By default the CUDA side is the CPU emulator
// (emu_test.go); with DISTILL_CUDA_TEST=gpu it is the real GPU, and a GPU
// that cannot be opened fails the test instead of skipping it (the GPU
// suite, scripts/gpu-suite.sh, sets it).

// onGPU reports whether the tests target a real GPU.
func onGPU() bool { return cudaemu.OnGPU() }

// testBackend opens the backend under test and closes it when t ends.
func testBackend(t testing.TB) *Backend {
	t.Helper()
	return testBackendWith(t, Options{})
}

// testBackendWith is testBackend with options (the kernel cache is the
// tests').
func testBackendWith(t testing.TB, opt Options) *Backend {
	t.Helper()
	if !onGPU() {
		useEmu(t)
	}
	opt.KernelCache = kernelCacheForTests(t)
	b, err := Open(opt)
	if err != nil {
		if onGPU() {
			t.Fatalf("DISTILL_CUDA_TEST=gpu but the GPU backend does not open: %v", err)
		}
		t.Fatalf("opening the emulated backend: %v", err)
	}
	t.Cleanup(func() { b.Close() })
	return b
}

// kernelCacheForTests: the GPU suite keeps compiled kernels between its
// test binaries (DISTILL_KERNEL_CACHE); elsewhere a fresh directory.
func kernelCacheForTests(t testing.TB) string {
	if d := os.Getenv("DISTILL_KERNEL_CACHE"); d != "" && onGPU() {
		return d
	}
	return t.TempDir()
}

func randF32(r *rand.Rand, n int) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = float32(r.Float64()*2 - 1)
	}
	return s
}

// roundBF16 returns s rounded to bfloat16 (as float32) and its bits.
func roundBF16(s []float32) ([]float32, []uint16) {
	h := make([]uint16, len(s))
	compute.NarrowBF16(h, s)
	out := make([]float32, len(s))
	compute.WidenBF16(out, h)
	return out, h
}

// bf16Weight returns a maker of be's weights from fp32 values rounded to
// BF16 (as a checkpoint holds them), failing tb on an error.
func bf16Weight(tb testing.TB, be compute.Backend) func([]float32) compute.Tensor {
	return func(s []float32) compute.Tensor {
		h := make([]uint16, len(s))
		compute.NarrowBF16(h, s)
		w, err := be.Weight(h)
		if err != nil {
			tb.Fatal(err)
		}
		return w
	}
}

// profileCalls is be's profile since its last reset (Profile): the calls
// of each kernel and GEMM by name.
func profileCalls(be *Backend) map[string]int {
	prof := map[string]int{}
	for _, e := range be.Profile() {
		prof[e.Name] = e.Calls
	}
	return prof
}

// readF32 downloads n elements of t from be.
func readF32(be compute.Backend, t compute.Tensor, n int) []float32 {
	out := make([]float32, n)
	be.ReadF32(t, out)
	return out
}

// closeTo checks |got-want| <= atol + rtol·|want| elementwise and logs the
// largest error (the figure the GPU suite's log reports).
func closeTo(t testing.TB, what string, got, want []float32, atol, rtol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	worst, wi, maxAbs := 0.0, -1, 0.0
	for i := range want {
		g, w := float64(got[i]), float64(want[i])
		d := math.Abs(g - w)
		if math.IsNaN(g) != math.IsNaN(w) {
			t.Fatalf("%s[%d] = %v, want %v", what, i, got[i], want[i])
		}
		maxAbs = max(maxAbs, d)
		if r := d / (atol + rtol*math.Abs(w)); r > worst {
			worst, wi = r, i
		}
	}
	t.Logf("%s: max |Δ| = %.3g over %d values (%.2f of the tolerance atol=%g rtol=%g)", what, maxAbs, len(want), worst, atol, rtol)
	if worst > 1 {
		t.Fatalf("%s[%d] = %v, want %v (|Δ| = %.3g > atol %g + rtol %g·|want|)", what, wi, got[wi], want[wi],
			math.Abs(float64(got[wi])-float64(want[wi])), atol, rtol)
	}
}

// oracle is the CPU reference; two workers (its results do not depend on
// the count).
var oracle = cpu.New(2)

func fmtf(format string, args ...any) string { return fmt.Sprintf(format, args...) }

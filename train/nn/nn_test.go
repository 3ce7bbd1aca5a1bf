package nn

import (
	"fmt"
	"math"
	"math/rand"
	"testing"

	"distill/compute/cpu"
	"distill/train/internal/ref"
)

// Tolerances: every forward is compared with the float64 reference in
// package ref at |got-want| <= 2e-5 + 2e-4·|want|; every backward with the
// central finite differences (h = 1e-5, float64) of that reference at
// |got-want| <= 5e-5 + 1e-3·|want|. The shapes are small (values O(1), at
// most a few hundred terms per sum), so fp32 rounding stays near 1e-6.
const (
	fwdAtol, fwdRtol = 2e-5, 2e-4
	bwdAtol, bwdRtol = 5e-5, 1e-3
	fdStep           = 1e-5
)

func randn(rng *rand.Rand, n int, s float64) []float32 {
	x := make([]float32, n)
	for i := range x {
		x[i] = float32(rng.NormFloat64() * s)
	}
	return x
}

func closeTo(t *testing.T, name string, got []float32, want []float64, atol, rtol float64) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: len %d, want %d", name, len(got), len(want))
	}
	for i := range got {
		if d := math.Abs(float64(got[i]) - want[i]); !(d <= atol+rtol*math.Abs(want[i])) {
			t.Fatalf("%s[%d] = %.8g, want %.8g (|diff| %.3g)", name, i, got[i], want[i], d)
		}
	}
}

// withThreads runs f with cpu.Threads = 1, 3 (uneven splits) and 16 (a
// many-core machine, emulated): the test sizes cross the thresholds (see
// splits), so with more than one thread the parallel paths really run.
func withThreads(t *testing.T, f func(t *testing.T)) {
	old := cpu.Threads
	defer func() { cpu.Threads = old }()
	for _, th := range []int{1, 3, 16} {
		cpu.Threads = th
		t.Run(fmt.Sprintf("threads=%d", th), f)
	}
}

// splits fails t unless parallelRows(n, cost) splits over the current
// cpu.Threads, so that a test meant to cover the parallel path does.
func splits(t *testing.T, n, cost int) {
	t.Helper()
	if cpu.Threads > 1 && (n < 2 || n*cost < minParallelWork) {
		t.Fatalf("parallelRows(%d rows, cost %d) runs inline (threshold %d): grow the test", n, cost, minParallelWork)
	}
}

// sgemmParMin is where cpu.SgemmPar starts splitting (m·n·k >= 2^18).
const sgemmParMin = 1 << 18

// strided is every step-th index below n, and the last one: a subset that
// keeps finite differences affordable at sizes that go parallel.
func strided(n, step int) []int {
	var s []int
	for i := 0; i < n; i += step {
		s = append(s, i)
	}
	if s[len(s)-1] != n-1 {
		s = append(s, n-1)
	}
	return s
}

// gradAt checks got (minus its starting values base, for the += contract;
// nil: zero) at the indices idx against the finite differences of f in x.
func gradAt(t *testing.T, name string, got, base []float32, f func() float64, x []float64, idx []int) {
	t.Helper()
	g := ref.Grad(f, x, idx, fdStep)
	sub := make([]float32, len(idx))
	for n, i := range idx {
		sub[n] = got[i]
		if base != nil {
			sub[n] -= base[i]
		}
	}
	closeTo(t, name, sub, g, bwdAtol, bwdRtol)
}

func TestRMSNorm(t *testing.T) {
	withThreads(t, func(t *testing.T) {
		rng := rand.New(rand.NewSource(2))
		N, C := 700, 24
		splits(t, N, C)
		x, w, R := randn(rng, N*C, 1), randn(rng, C, 1), randn(rng, N*C, 1)
		eps := float32(1e-6)
		out, rstd := make([]float32, N*C), make([]float32, N)
		RMSNormForward(out, rstd, x, w, N, C, eps)
		xd, wd, Rd := ref.F64(x), ref.F64(w), ref.F64(R)
		f := func() float64 { return ref.Dot(ref.RMSNorm(xd, wd, C, float64(eps)), Rd) }
		closeTo(t, "out", out, ref.RMSNorm(xd, wd, C, float64(eps)), fwdAtol, fwdRtol)
		// Start gradients non-zero to check the += contract.
		dx0, dw0 := randn(rng, N*C, 1), randn(rng, C, 1)
		dx, dw := append([]float32(nil), dx0...), append([]float32(nil), dw0...)
		RMSNormBackward(dx, dw, R, x, w, rstd, N, C)
		gradAt(t, "dx", dx, dx0, f, xd, strided(N*C, 53))
		gradAt(t, "dw", dw, dw0, f, wd, strided(C, 1))
	})
}

func TestLinear(t *testing.T) {
	withThreads(t, func(t *testing.T) {
		for _, bias := range []bool{false, true} {
			rng := rand.New(rand.NewSource(3))
			N, C, OC := 256, 16, 64
			splits(t, N, OC) // bias rows
			if N*C*OC < sgemmParMin {
				t.Fatalf("%dx%dx%d GEMMs do not split", N, C, OC)
			}
			x, w, R := randn(rng, N*C, 1), randn(rng, OC*C, 0.3), randn(rng, N*OC, 1)
			var b []float32
			var bd []float64
			if bias {
				b = randn(rng, OC, 1)
				bd = ref.F64(b)
			}
			out := make([]float32, N*OC)
			LinearForward(out, x, w, b, N, C, OC)
			xd, wd, Rd := ref.F64(x), ref.F64(w), ref.F64(R)
			f := func() float64 { return ref.Dot(ref.Linear(xd, wd, bd, C, OC), Rd) }
			closeTo(t, "out", out, ref.Linear(xd, wd, bd, C, OC), fwdAtol, fwdRtol)
			// Start gradients non-zero to check the += contract.
			dx0, dw0 := randn(rng, N*C, 1), randn(rng, OC*C, 1)
			dx, dw := append([]float32(nil), dx0...), append([]float32(nil), dw0...)
			var db0, db []float32
			if bias {
				db0 = randn(rng, OC, 1)
				db = append([]float32(nil), db0...)
			}
			LinearBackward(dx, dw, db, R, x, w, N, C, OC)
			gradAt(t, "dx", dx, dx0, f, xd, strided(N*C, 29))
			gradAt(t, "dw", dw, dw0, f, wd, strided(OC*C, 7))
			if bias {
				gradAt(t, "db", db, db0, f, bd, strided(OC, 1))
			}
		}
	})
}

func TestRope(t *testing.T) {
	withThreads(t, func(t *testing.T) {
		rng := rand.New(rand.NewSource(4))
		H, D := 3, 8
		starts := []int32{0, 4, 5, 11, 700}
		N := 700
		splits(t, N, H*D)    // RopeForward, RopeBackward
		splits(t, N, D/2*40) // RopeTable
		pos := make([]int32, N)
		Positions(pos, starts)
		if pos[4] != 0 || pos[10] != 5 || pos[3] != 3 || pos[699] != 688 {
			t.Fatalf("positions %v", pos[:12])
		}
		inv := make([]float32, D/2)
		for i := range inv {
			inv[i] = float32(1 / math.Pow(10000, float64(2*i)/float64(D)))
		}
		x, R := randn(rng, N*H*D, 1), randn(rng, N*H*D, 1)
		cos, sin := make([]float32, N*D/2), make([]float32, N*D/2)
		RopeTable(cos, sin, pos, inv, N)
		y := append([]float32(nil), x...)
		RopeForward(y, cos, sin, N, H, D)
		xd, Rd := ref.F64(x), ref.F64(R)
		closeTo(t, "out", y, ref.Rope(xd, pos, inv, H, D), fwdAtol, fwdRtol)
		f := func() float64 { return ref.Dot(ref.Rope(xd, pos, inv, H, D), Rd) }
		d := append([]float32(nil), R...)
		RopeBackward(d, cos, sin, N, H, D)
		gradAt(t, "dx", d, nil, f, xd, strided(N*H*D, 37))
	})
}

func TestSwiGLU(t *testing.T) {
	withThreads(t, func(t *testing.T) {
		rng := rand.New(rand.NewSource(5))
		n := 1000
		splits(t, n, 20) // forward
		splits(t, n, 25) // backward
		g, u, R := randn(rng, n, 2), randn(rng, n, 1), randn(rng, n, 1)
		out := make([]float32, n)
		SwiGLUForward(out, g, u, n)
		gd, ud, Rd := ref.F64(g), ref.F64(u), ref.F64(R)
		closeTo(t, "out", out, ref.SwiGLU(gd, ud), fwdAtol, fwdRtol)
		f := func() float64 { return ref.Dot(ref.SwiGLU(gd, ud), Rd) }
		dg0, du0 := randn(rng, n, 1), randn(rng, n, 1)
		dg, du := append([]float32(nil), dg0...), append([]float32(nil), du0...)
		SwiGLUBackward(dg, du, R, g, u, n)
		gradAt(t, "dgate", dg, dg0, f, gd, strided(n, 1))
		gradAt(t, "dup", du, du0, f, ud, strided(n, 1))
	})
}

func TestEmbedding(t *testing.T) {
	rng := rand.New(rand.NewSource(6))
	V, C := 9, 5
	ids := []int32{3, 0, 3, 8, 1}
	N := len(ids)
	wte, R := randn(rng, V*C, 1), randn(rng, N*C, 1)
	out := make([]float32, N*C)
	EmbeddingForward(out, ids, wte, N, C)
	wd, Rd := ref.F64(wte), ref.F64(R)
	closeTo(t, "out", out, ref.Embedding(wd, ids, C), 0, 0)
	f := func() float64 { return ref.Dot(ref.Embedding(wd, ids, C), Rd) }
	dw := make([]float32, V*C)
	EmbeddingBackward(dw, R, ids, N, C)
	closeTo(t, "dwte", dw, ref.Grad(f, wd, nil, fdStep), bwdAtol, bwdRtol)
}

// TestAttention covers GQA (H=4, KV=2), several samples of lengths that
// straddle the query block (attnBlock=64), and a one-token sample.
func TestAttention(t *testing.T) {
	withThreads(t, func(t *testing.T) {
		rng := rand.New(rand.NewSource(7))
		H, KV, D := 4, 2, 8
		starts := []int32{0, 70, 71, 75, 140}
		N := int(starts[len(starts)-1])
		q, k, v := randn(rng, N*H*D, 1), randn(rng, N*KV*D, 1), randn(rng, N*KV*D, 1)
		R := randn(rng, N*H*D, 1)
		scale := float32(1 / math.Sqrt(float64(D)))
		out, lse := make([]float32, N*H*D), make([]float32, N*H)
		AttentionForward(out, lse, q, k, v, starts, H, KV, D, scale)
		qd, kd, vd, Rd := ref.F64(q), ref.F64(k), ref.F64(v), ref.F64(R)
		closeTo(t, "out", out, ref.Attention(qd, kd, vd, starts, H, KV, D, float64(scale)), fwdAtol, fwdRtol)
		dq, dk, dv := make([]float32, len(q)), make([]float32, len(k)), make([]float32, len(v))
		AttentionBackward(dq, dk, dv, R, q, k, v, lse, starts, H, KV, D, scale)
		f := func() float64 { return ref.Dot(ref.Attention(qd, kd, vd, starts, H, KV, D, float64(scale)), Rd) }
		// A strided subset keeps the O(N²) reference affordable while
		// touching every sample, head and position class.
		idx := func(n int) []int {
			var s []int
			for i := 0; i < n; i += 7 {
				s = append(s, i)
			}
			return s
		}
		check := func(name string, got []float32, x []float64) {
			ix := idx(len(x))
			g := ref.Grad(f, x, ix, fdStep)
			sub := make([]float32, len(ix))
			for n, i := range ix {
				sub[n] = got[i]
			}
			closeTo(t, name, sub, g, bwdAtol, bwdRtol)
		}
		check("dq", dq, qd)
		check("dk", dk, kd)
		check("dv", dv, vd)
	})
}

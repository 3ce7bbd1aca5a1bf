package cpu

import (
	"fmt"
	"math/rand/v2"
	"testing"
)

// naiveGemm is the float64 reference for Sgemm.
func naiveGemm(transA, transB bool, m, n, k int, a []float32, lda int, b []float32, ldb int) []float64 {
	out := make([]float64, m*n)
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			var s float64
			for p := 0; p < k; p++ {
				var av, bv float32
				if transA {
					av = a[p*lda+i]
				} else {
					av = a[i*lda+p]
				}
				if transB {
					bv = b[j*ldb+p]
				} else {
					bv = b[p*ldb+j]
				}
				s += float64(av) * float64(bv)
			}
			out[i*n+j] = s
		}
	}
	return out
}

func randSlice(r *rand.Rand, n int) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = float32(r.NormFloat64())
	}
	return s
}

func TestSgemmAllTransposes(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	// Sizes cover each SgemmPar path: plain (< 2^18 multiply-adds), and
	// goroutine slabs by rows and by columns. Three workers, whatever the
	// machine (a 1-core one would never split), and uneven slabs.
	old := Threads
	defer func() { Threads = old }()
	Threads = 3
	for _, sz := range [][3]int{{1, 1, 1}, {3, 5, 7}, {37, 65, 129}, {130, 3, 200}, {2, 300, 64}, {200, 90, 100}, {9, 700, 100}, {520, 517, 500}} {
		m, n, k := sz[0], sz[1], sz[2]
		for _, ta := range []bool{false, true} {
			for _, tb := range []bool{false, true} {
				lda, ldb := k, n
				if ta {
					lda = m
				}
				if tb {
					ldb = k
				}
				a, b := randSlice(r, m*k), randSlice(r, k*n)
				want := naiveGemm(ta, tb, m, n, k, a, lda, b, ldb)
				for _, par := range []bool{false, true} {
					c := make([]float32, m*n)
					if par {
						SgemmPar(ta, tb, m, n, k, 1, a, lda, b, ldb, 0, c, n)
					} else {
						Sgemm(ta, tb, m, n, k, 1, a, lda, b, ldb, 0, c, n)
					}
					for i := range c {
						if d := float64(c[i]) - want[i]; d > 1e-4*float64(k) || d < -1e-4*float64(k) {
							t.Fatalf("m=%d n=%d k=%d ta=%v tb=%v par=%v: c[%d]=%v want %v", m, n, k, ta, tb, par, i, c[i], want[i])
						}
					}
				}
			}
		}
	}
}

// BenchmarkSgemm reports GFLOP/s of the multithreaded fp32 GEMM.
func BenchmarkSgemm(b *testing.B) {
	for _, s := range []int{256, 512, 1024, 2048} {
		b.Run(fmt.Sprint(s), func(b *testing.B) {
			r := rand.New(rand.NewPCG(1, 2))
			x, w, c := randSlice(r, s*s), randSlice(r, s*s), make([]float32, s*s)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				SgemmPar(false, true, s, s, s, 1, x, s, w, s, 0, c, s)
			}
			b.ReportMetric(2*float64(s)*float64(s)*float64(s)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
	}
}

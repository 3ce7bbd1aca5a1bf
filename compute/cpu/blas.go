package cpu

/*
#cgo LDFLAGS: -lopenblas -lm
#cgo CFLAGS: -O3 -fopenmp-simd -Wall
#include <cblas.h>
*/
import "C"

import (
	"fmt"
	"sync"
	"unsafe"
)

// OpenBLAS runs single-threaded under us: this package splits work across
// cores itself (row slabs of a GEMM, attention blocks, LM-head slabs).
// OpenBLAS's own threads are faster on a lone large GEMM (1024³: ~215
// against ~160 GFLOP/s for two concurrent single-threaded halves, which it
// partly serializes), but after each call they spin-wait for their next job
// (OPENBLAS_THREAD_TIMEOUT, read before main runs) and steal the cores from
// the Go kernels in between: with them, a training step ran at 570-640
// tokens/s against 820-840 without, and the teacher forward at 1442 against
// 1503 tokens/s (BenchmarkTrainStep, BenchmarkTeacherForward).
var blasInit sync.Once

func initBLAS() { blasInit.Do(func() { C.openblas_set_num_threads(1) }) }

// Sgemm computes C = alpha·op(A)·op(B) + beta·C on row-major matrices, on
// the calling goroutine only: op(A) is (m,k), op(B) is (k,n), C is (m,n);
// transA/transB select Aᵀ/Bᵀ; lda/ldb/ldc are row strides in elements.
// OpenBLAS gets raw pointers, so the shapes are checked against the slices
// first: a mismatch panics with what is wrong (a caller's bug), instead of
// reading or writing memory past a slice.
func Sgemm(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	checkGemm(transA, transB, m, n, k, len(a), lda, len(b), ldb, len(c), ldc)
	if m == 0 || n == 0 {
		return
	}
	initBLAS()
	ta, tb := uint32(C.CblasNoTrans), uint32(C.CblasNoTrans)
	if transA {
		ta = C.CblasTrans
	}
	if transB {
		tb = C.CblasTrans
	}
	var pa, pb *float32
	if k > 0 {
		pa, pb = &a[0], &b[0]
	}
	C.cblas_sgemm(C.CblasRowMajor, C.enum_CBLAS_TRANSPOSE(ta), C.enum_CBLAS_TRANSPOSE(tb),
		C.blasint(m), C.blasint(n), C.blasint(k), C.float(alpha),
		(*C.float)(unsafe.Pointer(pa)), C.blasint(lda),
		(*C.float)(unsafe.Pointer(pb)), C.blasint(ldb), C.float(beta),
		(*C.float)(unsafe.Pointer(&c[0])), C.blasint(ldc))
}

// checkGemm panics unless the slices of a row-major Sgemm hold its
// matrices: a stored (rows, cols) with row stride ld needs ld >= cols and
// (rows-1)·ld + cols elements. A and B are not read when k = 0.
func checkGemm(transA, transB bool, m, n, k, na, lda, nb, ldb, nc, ldc int) {
	if m < 0 || n < 0 || k < 0 {
		panic(fmt.Sprintf("cpu.Sgemm: negative shape m=%d n=%d k=%d", m, n, k))
	}
	check := func(name string, rows, cols, have, ld int) {
		if rows == 0 || cols == 0 {
			return
		}
		if ld < cols {
			panic(fmt.Sprintf("cpu.Sgemm: %s is stored (%d,%d) but its row stride is %d, want >= %d", name, rows, cols, ld, cols))
		}
		if need := (rows-1)*ld + cols; have < need {
			panic(fmt.Sprintf("cpu.Sgemm: %s is stored (%d,%d) with row stride %d, which needs %d elements; the slice has %d", name, rows, cols, ld, need, have))
		}
	}
	if k > 0 {
		if transA {
			check("A (transposed)", k, m, na, lda)
		} else {
			check("A", m, k, na, lda)
		}
		if transB {
			check("B (transposed)", n, k, nb, ldb)
		} else {
			check("B", k, n, nb, ldb)
		}
	}
	check("C", m, n, nc, ldc)
}

// sgemmPar is Sgemm split over t goroutines by row slabs of C (or by
// column slabs when m is small), for GEMMs big enough to pay for it.
func sgemmPar(t int, transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	if t <= 1 || int64(m)*int64(n)*int64(k) < 1<<18 {
		Sgemm(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
		return
	}
	// The whole GEMM is checked here: a slab's check alone could let a
	// short slice through as a smaller, wrong product.
	checkGemm(transA, transB, m, n, k, len(a), lda, len(b), ldb, len(c), ldc)
	var g group
	if m >= 8*t || m >= n {
		for i := 0; i < t; i++ {
			lo, hi := m*i/t, m*(i+1)/t
			if lo == hi {
				continue
			}
			g.Go(func() {
				aoff := lo * lda
				if transA {
					aoff = lo
				}
				Sgemm(transA, transB, hi-lo, n, k, alpha, a[aoff:], lda, b, ldb, beta, c[lo*ldc:], ldc)
			})
		}
	} else {
		for i := 0; i < t; i++ {
			lo, hi := n*i/t, n*(i+1)/t
			if lo == hi {
				continue
			}
			g.Go(func() {
				boff := lo
				if transB {
					boff = lo * ldb
				}
				Sgemm(transA, transB, m, hi-lo, k, alpha, a, lda, b[boff:], ldb, beta, c[lo:], ldc)
			})
		}
	}
	g.Wait()
}

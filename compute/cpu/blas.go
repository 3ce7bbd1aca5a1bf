package cpu

/*
#cgo LDFLAGS: -lopenblas -lm
#cgo CFLAGS: -O3 -fopenmp-simd -Wall
#include <cblas.h>
*/
import "C"

import (
	"runtime"
	"sync"
	"unsafe"
)

// OpenBLAS's thread count is one global setting. Kernels that run many
// small GEMMs at once (attention blocks, LM-head slabs) call Sgemm from
// several goroutines and need it at 1, or the cores are oversubscribed; a
// single large GEMM (SgemmPar) is fastest with OpenBLAS's own threads, which
// share the packed panels: 1024³ runs at ~215 GFLOP/s that way on 2 cores,
// against ~160 for two concurrent single-threaded halves (OpenBLAS
// serializes part of concurrent calls). So the setting is 1, and SgemmPar
// raises it for the length of its call under blasMode's write lock, which
// Sgemm callers hold for reading.
var (
	blasInit sync.Once
	blasMode sync.RWMutex
)

func initBLAS() { blasInit.Do(func() { C.openblas_set_num_threads(1) }) }

// Threads is the number of worker goroutines the CPU kernels split into.
var Threads = runtime.NumCPU()

// Sgemm computes C = alpha·op(A)·op(B) + beta·C on row-major matrices, on
// the calling goroutine only: op(A) is (m,k), op(B) is (k,n), C is (m,n);
// transA/transB select Aᵀ/Bᵀ; lda/ldb/ldc are row strides in elements.
func Sgemm(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	if m == 0 || n == 0 {
		return
	}
	initBLAS()
	blasMode.RLock()
	defer blasMode.RUnlock()
	sgemm(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
}

func sgemm(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
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

// SgemmPar is Sgemm on all Threads cores: OpenBLAS's own threads for large
// GEMMs; below parThreshold multiply-adds, where they pay less than they
// cost, row (or column) slabs on goroutines with single-threaded calls.
func SgemmPar(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	size := int64(m) * int64(n) * int64(k)
	switch {
	case Threads <= 1 || size < 1<<18:
		Sgemm(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
	case size < parThreshold:
		sgemmSlabs(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
	default:
		initBLAS()
		blasMode.Lock()
		defer blasMode.Unlock()
		C.openblas_set_num_threads(C.int(Threads))
		defer C.openblas_set_num_threads(1)
		sgemm(transA, transB, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)
	}
}

// parThreshold (multiply-adds) is where OpenBLAS's threading overtakes
// goroutine slabs on the 2-core dev machine (BenchmarkSgemm: 256³ slabs 147
// vs threads 103 GFLOP/s; 1024³ slabs 157 vs threads 195).
const parThreshold = 1 << 27

// sgemmSlabs splits C into Threads row slabs (or column slabs when m is
// small) computed concurrently by single-threaded calls.
func sgemmSlabs(transA, transB bool, m, n, k int, alpha float32, a []float32, lda int, b []float32, ldb int, beta float32, c []float32, ldc int) {
	t := Threads
	var wg sync.WaitGroup
	if m >= 8*t || m >= n {
		for i := 0; i < t; i++ {
			lo, hi := m*i/t, m*(i+1)/t
			if lo == hi {
				continue
			}
			wg.Add(1)
			go func(lo, hi int) {
				defer wg.Done()
				aoff := lo * lda
				if transA {
					aoff = lo
				}
				Sgemm(transA, transB, hi-lo, n, k, alpha, a[aoff:], lda, b, ldb, beta, c[lo*ldc:], ldc)
			}(lo, hi)
		}
	} else {
		for i := 0; i < t; i++ {
			lo, hi := n*i/t, n*(i+1)/t
			if lo == hi {
				continue
			}
			wg.Add(1)
			go func(lo, hi int) {
				defer wg.Done()
				boff := lo
				if transB {
					boff = lo * ldb
				}
				Sgemm(transA, transB, m, hi-lo, k, alpha, a, lda, b[boff:], ldb, beta, c[lo:], ldc)
			}(lo, hi)
		}
	}
	wg.Wait()
}

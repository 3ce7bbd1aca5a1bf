package cpu

import (
	"errors"
	"runtime"
	"strings"
	"sync/atomic"
	"testing"
)

// recovered runs fn and returns what it panicked with (nil: no panic).
func recovered(fn func()) (r any) {
	defer func() { r = recover() }()
	fn()
	return nil
}

// TestWorkerPanicReachesCaller: a panic in a worker goroutine of parallel,
// WorkQueue or the GEMM slabs reaches the goroutine that called the
// kernel, where a recover (the daemon's forward pass) catches it. Before,
// it ended the process.
func TestWorkerPanicReachesCaller(t *testing.T) {
	be := New(4)
	parallel, WorkQueue := be.parallel, be.workQueue
	var oob []int
	cases := map[string]func(){
		"parallel": func() {
			parallel(8, func(lo, hi int) {
				if lo >= 4 {
					panic("boom in a parallel worker")
				}
			})
		},
		"WorkQueue": func() {
			WorkQueue(8, func(w, i int) {
				if i == 5 {
					_ = oob[i] // a runtime error, as a kernel bug would raise
				}
			})
		},
		"nested": func() {
			parallel(4, func(lo, hi int) {
				WorkQueue(4, func(w, i int) {
					if lo == 2 && i == 1 {
						panic("boom in a nested worker")
					}
				})
			})
		},
	}
	for name, fn := range cases {
		r := recovered(fn)
		wp, ok := r.(*WorkerPanic)
		if !ok {
			t.Fatalf("%s: the caller got %v (%T), want a *WorkerPanic", name, r, r)
		}
		if len(wp.Stack) == 0 {
			t.Errorf("%s: no worker stack", name)
		}
		t.Logf("%s: %v", name, wp)
	}
	var re runtime.Error
	if wp := recovered(cases["WorkQueue"]).(*WorkerPanic); !errors.As(wp, &re) || !strings.Contains(wp.Error(), "index out of range") {
		t.Errorf("the runtime error is lost: %v", wp)
	}
	if wp := recovered(cases["nested"]).(*WorkerPanic); wp.Value != "boom in a nested worker" {
		t.Errorf("a nested worker's panic is wrapped twice: %v", wp.Value)
	}
	// The kernels work again after a panic.
	var sum atomicSum
	parallel(4, func(lo, hi int) { sum.add(hi - lo) })
	WorkQueue(3, func(w, i int) { sum.add(1) })
	if sum.n.Load() != 7 {
		t.Fatalf("after a panic the kernels covered %d items, want 7", sum.n.Load())
	}
}

type atomicSum struct{ n atomic.Int64 }

func (s *atomicSum) add(d int) { s.n.Add(int64(d)) }

// TestSgemmChecksLengths: Sgemm hands OpenBLAS raw pointers, so a slice
// shorter than the shape says, or a stride below the row length, must
// panic with what is wrong instead of reading or writing past the slice.
// A mismatch inside a parallel GEMM's slab reaches the caller too.
func TestSgemmChecksLengths(t *testing.T) {
	const m, n, k = 64, 64, 128 // big enough for sgemmPar to split
	a, b, c := make([]float32, m*k), make([]float32, k*n), make([]float32, m*n)
	for _, tc := range []struct {
		name string
		run  func()
		want string
	}{
		{"short A", func() { Sgemm(false, false, m, n, k, 1, a[:m*k-1], k, b, n, 0, c, n) }, "A is stored (64,128) with row stride 128, which needs 8192 elements; the slice has 8191"},
		{"short Aᵀ", func() { Sgemm(true, false, m, n, k, 1, a[:m*k-3], m, b, n, 0, c, n) }, "A (transposed) is stored (128,64)"},
		{"short B", func() { Sgemm(false, false, m, n, k, 1, a, k, b[:10], n, 0, c, n) }, "B is stored (128,64)"},
		{"short Bᵀ", func() { Sgemm(false, true, m, n, k, 1, a, k, b[:k*n-1], k, 0, c, n) }, "B (transposed) is stored (64,128)"},
		{"short C", func() { Sgemm(false, false, m, n, k, 1, a, k, b, n, 0, c[:m*n-1], n) }, "C is stored (64,64)"},
		{"stride", func() { Sgemm(false, false, m, n, k, 1, a, k-1, b, n, 0, c, n) }, "row stride is 127, want >= 128"},
		{"negative", func() { Sgemm(false, false, -1, n, k, 1, a, k, b, n, 0, c, n) }, "negative shape"},
		{"parallel short C", func() { sgemmPar(4, false, true, m, n, k, 1, a, k, b, k, 0, c[:m*n-1], n) }, "C is stored (64,64)"},
	} {
		r := recovered(tc.run)
		msg := ""
		switch v := r.(type) {
		case string:
			msg = v
		case *WorkerPanic:
			msg = v.Error()
		}
		if !strings.Contains(msg, tc.want) {
			t.Errorf("%s: panic %v, want one containing %q", tc.name, r, tc.want)
		}
	}
	// The exact sizes pass, and k = 0 reads neither A nor B.
	Sgemm(false, false, m, n, k, 1, a, k, b, n, 0, c, n)
	sgemmPar(4, false, true, m, n, k, 1, a, k, b, k, 0, c, n)
	Sgemm(false, false, m, n, 0, 1, nil, 1, nil, n, 0, c, n)
}

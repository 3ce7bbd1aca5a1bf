package cuda

import (
	"fmt"
	"unsafe"

	"distill/compute"
)

// SumSquaresEach implements compute.BatchSumSquares: out[i] =
// SumSquares(xs[i], ns[i]), the same two kernels over the same grids (so
// the same bits), every sum written into one device array that is read
// back with a single synchronization. Clipping a student's gradients by
// their global norm asked for one wait per tensor (310 a step for a
// Qwen3-0.6B student), each leaving the GPU idle until the host issued
// the next two small kernels.
func (b *Backend) SumSquaresEach(out []float64, xs []compute.Tensor, ns []int) {
	defer b.enter()()
	if len(out) != len(xs) || len(ns) != len(xs) {
		panic(fmt.Sprintf("cuda: SumSquaresEach: %d outputs, %d tensors, %d lengths", len(out), len(xs), len(ns)))
	}
	if len(xs) == 0 {
		return
	}
	ts := make([]*tensor, len(xs))
	parts := 0 // the largest grid: the partial sums' scratch is reused
	for i, xT := range xs {
		ts[i] = b.ten(xT, "SumSquaresEach x")
		need(ts[i], "SumSquaresEach x", ns[i], compute.F32)
		parts = max(parts, reduceGrid(ns[i]))
	}
	sums := b.alloc(int64(len(xs)) * 8)
	b.memset0(sums, int64(len(xs))*8) // empty tensors sum to 0
	part := b.alloc(int64(parts) * 8)
	for i, x := range ts {
		if ns[i] == 0 {
			continue
		}
		// Stream order keeps one tensor's partial sums from being
		// overwritten by the next tensor's before k_sum_finish read them.
		nb := reduceGrid(ns[i])
		b.launchKernel(launch{kernel: "k_sumsq_part", grid: [3]int{nb, 1, 1}, block: 256}, dptr(part), dptr(x.p), int64(ns[i]))
		b.launchKernel(launch{kernel: "k_sum_finish", grid: [3]int{1, 1, 1}, block: 256}, dptr(sums+uint64(8*i)), dptr(part), int32(nb))
	}
	b.download(unsafe.Pointer(&out[0]), sums, int64(len(xs))*8)
	b.free(part)
	b.free(sums)
}

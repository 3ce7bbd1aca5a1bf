package cuda

import (
	"fmt"
	"unsafe"

	"distill/compute"
)

// SumSquaresEach implements compute.BatchSumSquares: out[i] =
// SumSquares(xs[i], ns[i]), each tensor's partial sums over the same grid
// and in the same trees as SumSquares' kernels (so the same bits), every
// sum written into one device array that is read back with a single
// synchronization. Clipping a student's gradients by
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
	for i, xT := range xs {
		ts[i] = b.ten(xT, "SumSquaresEach x")
		need(ts[i], "SumSquaresEach x", ns[i], compute.F32)
	}
	// Two launches for all the tensors (k_sumsq_multi, then
	// k_sum_finish_multi a block a tensor), each tensor's partial sums
	// over its own reduceGrid as k_sumsq_part makes them alone.
	tab := make([]int64, 0, mtWords*len(xs))
	parts := 0
	for i, x := range ts {
		nb := 0
		if ns[i] > 0 {
			nb = reduceGrid(ns[i])
		}
		tab = append(tab, int64(x.p), int64(ns[i]), int64(nb), int64(parts), 0, 0, 0, 0)
		parts += nb
	}
	sums := b.alloc(int64(len(xs)) * 8)
	part := b.alloc(int64(max(parts, 1)) * 8)
	d := b.alloc(int64(len(tab)) * 8)
	b.upload(d, unsafe.Pointer(&tab[0]), int64(len(tab))*8)
	if parts > 0 {
		b.launchKernel(launch{kernel: "k_sumsq_multi", grid: [3]int{parts, 1, 1}, block: 256}, dptr(part), dptr(d), int32(len(xs)))
	}
	// An empty tensor (no partials) sums to 0.
	b.launchKernel(launch{kernel: "k_sum_finish_multi", grid: [3]int{len(xs), 1, 1}, block: 256}, dptr(sums), dptr(part), dptr(d))
	b.download(unsafe.Pointer(&out[0]), sums, int64(len(xs))*8)
	b.free(d)
	b.free(part)
	b.free(sums)
}

// CopyEach implements compute.MultiTensor: Copy of every pair in one
// launch (k_copy_multi).
func (b *Backend) CopyEach(dsts, srcs []compute.Tensor) {
	defer b.enter()()
	if len(srcs) != len(dsts) {
		panic(fmt.Sprintf("cuda: CopyEach: %d destinations, %d sources", len(dsts), len(srcs)))
	}
	var tab []int64
	blocks := 0
	for i := range dsts {
		b.wroteT(dsts[i])
		dst, src := b.ten(dsts[i], "CopyEach destination"), b.ten(srcs[i], "CopyEach source")
		need(src, "CopyEach source", 0, compute.F32)
		need(dst, "CopyEach destination", src.n, compute.F32)
		if src.n == 0 {
			continue
		}
		tab = append(tab, int64(dst.p), int64(src.p), int64(src.n), int64(blocks), 0, 0, 0, 0)
		blocks += (src.n + mtChunk - 1) / mtChunk
	}
	b.mtLaunch("k_copy_multi", tab, blocks, 256, nil)
}

// mtWords is a multi-tensor table's i64 words a tensor (optim.cu: MT_W),
// mtChunk the elements a block of its elementwise kernels (MT_CHUNK).
const (
	mtWords = 8
	mtChunk = 2048
)

// mtLaunch uploads a multi-tensor table (rows of mtWords) and launches
// kernel over blocks blocks with the table and args after it; the table
// is freed in stream order.
func (b *Backend) mtLaunch(kernel string, tab []int64, blocks, threads int, pre []any, args ...any) {
	if blocks == 0 {
		return
	}
	d := b.alloc(int64(len(tab)) * 8)
	b.upload(d, unsafe.Pointer(&tab[0]), int64(len(tab))*8)
	a := append(append(pre, dptr(d), int32(len(tab)/mtWords)), args...)
	b.launchKernel(launch{kernel: kernel, grid: [3]int{blocks, 1, 1}, block: threads}, a...)
	b.free(d)
}

// AdamWEach implements compute.MultiTensor: k_adamw's update of every
// tensor in one launch (k_adamw_multi), the shadows' bookkeeping as AdamW
// does it for each. A tensor given a BF16 copy in bs has it written where
// its shadow would be (k_adamw's pb: f2bf of the new value, the rounding
// k_f32_to_bf16 makes), and is not made a shadowed parameter.
func (b *Backend) AdamWEach(ps, gs, ms, vs, bs []compute.Tensor, ns []int, decays []bool, s compute.AdamWStep) {
	defer b.enter()()
	if len(gs) != len(ps) || len(ms) != len(ps) || len(vs) != len(ps) || len(ns) != len(ps) || len(decays) != len(ps) || bs != nil && len(bs) != len(ps) {
		panic(fmt.Sprintf("cuda: AdamWEach: %d parameters, %d gradients, %d and %d moments, %d BF16 copies, %d lengths, %d decay flags", len(ps), len(gs), len(ms), len(vs), len(bs), len(ns), len(decays)))
	}
	tab := make([]int64, 0, mtWords*len(ps))
	blocks := 0
	for i := range ps {
		p, g, m, v := b.ten(ps[i], "AdamWEach p"), b.ten(gs[i], "AdamWEach g"), b.ten(ms[i], "AdamWEach m"), b.ten(vs[i], "AdamWEach v")
		n := ns[i]
		for _, x := range []struct {
			t    *tensor
			what string
		}{{p, "AdamWEach p"}, {g, "AdamWEach g"}, {m, "AdamWEach m"}, {v, "AdamWEach v"}} {
			need(x.t, x.what, n, compute.F32)
		}
		if n == 0 {
			continue
		}
		b.wrote(m, v)
		var pb uint64
		if bs != nil && bs[i] != nil {
			bt := b.ten(bs[i], "AdamWEach BF16 copy")
			need(bt, "AdamWEach BF16 copy", n, compute.BF16)
			b.wrote(p, bt)
			pb = bt.p
		} else {
			pb = b.adamwShadow(p, n)
		}
		dec := int64(0)
		if decays[i] {
			dec = 1
		}
		tab = append(tab, int64(p.p), int64(g.p), int64(m.p), int64(v.p), int64(pb), int64(n), dec, int64(blocks))
		blocks += (n + mtChunk - 1) / mtChunk
	}
	b.mtLaunch("k_adamw_multi", tab, blocks, 256, nil, s.Beta1, s.Beta2, s.Eps, s.StepSize, s.BC2Sqrt, s.Decay)
}

// ScaleEach implements compute.MultiTensor: k_scale of every tensor in
// one launch (k_scale_multi).
func (b *Backend) ScaleEach(xs []compute.Tensor, ns []int, c float32) {
	defer b.enter()()
	if len(ns) != len(xs) {
		panic(fmt.Sprintf("cuda: ScaleEach: %d tensors, %d lengths", len(xs), len(ns)))
	}
	var tab []int64
	blocks := 0
	for i, xT := range xs {
		b.wroteT(xT)
		x := b.ten(xT, "ScaleEach x")
		need(x, "ScaleEach x", ns[i], compute.F32)
		if ns[i] == 0 {
			continue
		}
		tab = append(tab, int64(x.p), int64(ns[i]), int64(blocks), 0, 0, 0, 0, 0)
		blocks += (ns[i] + mtChunk - 1) / mtChunk
	}
	b.mtLaunch("k_scale_multi", tab, blocks, 256, nil, c)
}

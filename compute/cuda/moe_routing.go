package cuda

import (
	"fmt"
	"unsafe"

	"distill/compute"
)

// moeRouting is the device's MoERouting: one allocation, the sums
// (layers, E) float64 then the counts (layers, E) int32. Record
// (k_moe_stats) and AuxGrad (k_moe_aux_grad) only enqueue kernels; Later
// copies the statistics into a pinned block behind an event, as
// LossHeadForwardKD does a loss's values, so the host reads them after
// the step's one wait (the gradient norm's) without a wait of its own.
type moeRouting struct {
	b         *Backend
	layers, e int
	p         uint64
}

// NewMoERouting implements compute.Backend.
func (b *Backend) NewMoERouting(layers, numExperts int) compute.MoERouting {
	defer b.enter()()
	if layers < 1 || numExperts < 1 {
		panic(fmt.Sprintf("cuda: NewMoERouting of %d layers of %d experts: want at least one of each", layers, numExperts))
	}
	r := &moeRouting{b: b, layers: layers, e: numExperts}
	n := r.bytes()
	r.p = b.alloc(n)
	b.keep(r.p)
	b.memset0(r.p, n)
	return r
}

// bytes is the statistics' size: 12 bytes a layer and expert (73 KiB
// for Qwen3-30B-A3B's 48 layers of 128 experts).
func (r *moeRouting) bytes() int64 { return int64(r.layers) * int64(r.e) * 12 }

// counts is the device address of the counts (layers, E).
func (r *moeRouting) counts() uint64 { return r.p + uint64(r.layers)*uint64(r.e)*8 }

func (r *moeRouting) live(what string) {
	if r.p == 0 {
		panic(fmt.Sprintf("cuda: MoERouting.%s after Free", what))
	}
}

// Record implements compute.MoERouting: k_moe_stats, one thread per
// expert.
func (r *moeRouting) Record(l int, s *compute.MoESaved, T int) {
	b := r.b
	defer b.enter()()
	b.label = "MoERouting.Record"
	r.live("Record")
	E := r.e
	if l < 0 || l >= r.layers {
		panic(fmt.Sprintf("cuda: MoERouting.Record of layer %d: the statistics hold layers 0..%d", l, r.layers-1))
	}
	probs, off := b.ten(s.Probs, "MoERouting.Record saved Probs"), b.ten(s.Offsets, "MoERouting.Record saved Offsets")
	need(probs, "MoERouting.Record saved Probs", T*E, compute.F32)
	need(off, "MoERouting.Record saved Offsets", E+1, compute.I32)
	b.launchKernel(launch{kernel: "k_moe_stats", grid: [3]int{(E + moeStatsThreads - 1) / moeStatsThreads, 1, 1}, block: moeStatsThreads},
		dptr(probs.p), dptr(off.p), int64(T), int32(E), dptr(r.p+uint64(l)*uint64(E)*8), dptr(r.counts()+uint64(l)*uint64(E)*4))
}

// moeStatsThreads is k_moe_stats' and k_moe_aux_grad's block
// (MOE_STATS_THREADS).
const moeStatsThreads = 128

// AuxGrad implements compute.MoERouting: k_moe_aux_grad, one thread per
// expert.
func (r *moeRouting) AuxGrad(dprobT compute.Tensor, coef float64, T int) {
	b := r.b
	defer b.enter()()
	b.label = "MoERouting.AuxGrad"
	r.live("AuxGrad")
	dprob := b.ten(dprobT, "MoERouting.AuxGrad dprob")
	need(dprob, "MoERouting.AuxGrad dprob", r.e, compute.F32)
	b.wroteT(dprobT)
	b.launchKernel(launch{kernel: "k_moe_aux_grad", grid: [3]int{(r.e + moeStatsThreads - 1) / moeStatsThreads, 1, 1}, block: moeStatsThreads},
		dptr(dprob.p), dptr(r.counts()), int32(r.layers), int32(r.e), int64(T), coef)
}

// Later implements compute.MoERouting: a copy into a pinned block behind
// an event; with Options.Pageable (or on the side stream, whose events the
// staging does not follow) a device copy, downloaded by Read.
func (r *moeRouting) Later() compute.MoERoutingValues {
	b := r.b
	defer b.enter()()
	r.live("Later")
	v := &moeRoutingValues{b: b, layers: r.layers, e: r.e}
	n := r.bytes()
	if !b.pageable && !b.besideOn {
		v.later = b.downloadLater(r.p, n)
		return v
	}
	v.dev = b.alloc(n)
	b.keep(v.dev)
	b.copyD(v.dev, r.p, n)
	return v
}

// Free implements compute.MoERouting.
func (r *moeRouting) Free() {
	b := r.b
	defer b.enter()()
	b.free(r.p)
	r.p = 0
}

// moeRoutingValues are a Later snapshot: in a pinned block (later) or a
// device copy (dev).
type moeRoutingValues struct {
	b         *Backend
	layers, e int
	later     *laterCopy
	dev       uint64
	read      bool
}

// Read implements compute.MoERoutingValues.
func (v *moeRoutingValues) Read(counts [][]int, sums [][]float64) {
	b := v.b
	defer b.enter()()
	if v.read {
		panic("cuda: MoERoutingValues read twice")
	}
	v.read = true
	L, E := v.layers, v.e
	if len(counts) < L || len(sums) < L {
		panic(fmt.Sprintf("cuda: MoERoutingValues.Read into %d and %d layers, want %d", len(counts), len(sums), L))
	}
	for l := 0; l < L; l++ {
		if len(counts[l]) < E || len(sums[l]) < E {
			panic(fmt.Sprintf("cuda: MoERoutingValues.Read: layer %d into %d and %d experts, want %d", l, len(counts[l]), len(sums[l]), E))
		}
	}
	n := L * E
	var host unsafe.Pointer
	if v.later != nil {
		host = b.arrived(v.later, "an MoE routing's statistics")
		defer b.putBlock(v.later.host, v.later.size)
		v.later = nil
	} else {
		buf := make([]float64, (12*n+7)/8) // (float64-aligned)
		host = unsafe.Pointer(&buf[0])
		b.download(host, v.dev, int64(12*n))
		b.free(v.dev)
		v.dev = 0
	}
	s := unsafe.Slice((*float64)(host), n)
	c := unsafe.Slice((*int32)(unsafe.Add(host, 8*n)), n)
	for l := 0; l < L; l++ {
		copy(sums[l], s[l*E:(l+1)*E])
		for e := 0; e < E; e++ {
			counts[l][e] = int(c[l*E+e])
		}
	}
}

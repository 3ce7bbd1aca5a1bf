package cpu

import (
	"fmt"

	"distill/compute"
)

// moeRouting is the CPU MoERouting: host slices, filled and read in
// place (the host computes what the CUDA backend's kernels compute on
// the device, in the same order).
type moeRouting struct {
	layers, e int
	counts    []int     // (layers, E)
	sums      []float64 // (layers, E)
	freed     bool
}

// NewMoERouting implements compute.Backend.
func (*Backend) NewMoERouting(layers, numExperts int) compute.MoERouting {
	if layers < 1 || numExperts < 1 {
		panic(fmt.Sprintf("cpu: NewMoERouting of %d layers of %d experts: want at least one of each", layers, numExperts))
	}
	return &moeRouting{layers: layers, e: numExperts, counts: make([]int, layers*numExperts), sums: make([]float64, layers*numExperts)}
}

func (r *moeRouting) live(what string) {
	if r.freed {
		panic(fmt.Sprintf("cpu: MoERouting.%s after Free", what))
	}
}

// Record implements compute.MoERouting: the offsets' differences, and each
// expert's probabilities summed over the tokens in order.
func (r *moeRouting) Record(l int, s *compute.MoESaved, T int) {
	r.live("Record")
	E := r.e
	if l < 0 || l >= r.layers {
		panic(fmt.Sprintf("cpu: MoERouting.Record of layer %d: the statistics hold layers 0..%d", l, r.layers-1))
	}
	off, p := i32(s.Offsets), f32(s.Probs)
	if len(off) < E+1 || len(p) < T*E {
		panic(fmt.Sprintf("cpu: MoERouting.Record: saved Offsets %d and Probs %d elements, want %d and %d (%d tokens, %d experts)", len(off), len(p), E+1, T*E, T, E))
	}
	cnt, sum := r.counts[l*E:(l+1)*E], r.sums[l*E:(l+1)*E]
	for e := range cnt {
		cnt[e] = int(off[e+1] - off[e])
		sum[e] = 0
	}
	for t := 0; t < T; t++ {
		for e, v := range p[t*E : (t+1)*E] {
			sum[e] += float64(v)
		}
	}
}

// AuxGrad implements compute.MoERouting with compute.MoEAuxGrad itself.
func (r *moeRouting) AuxGrad(dprob compute.Tensor, coef float64, T int) {
	r.live("AuxGrad")
	d := f32(dprob)
	if len(d) < r.e {
		panic(fmt.Sprintf("cpu: MoERouting.AuxGrad: dprob has %d elements, want %d (the experts)", len(d), r.e))
	}
	tot := make([]int, r.e)
	for i, c := range r.counts {
		tot[i%r.e] += c
	}
	copy(d, compute.MoEAuxGrad(coef, tot, r.layers, T))
}

// Later implements compute.MoERouting: a copy.
func (r *moeRouting) Later() compute.MoERoutingValues {
	r.live("Later")
	return &moeRoutingValues{e: r.e, counts: append([]int(nil), r.counts...), sums: append([]float64(nil), r.sums...)}
}

// Free implements compute.MoERouting.
func (r *moeRouting) Free() { r.freed, r.counts, r.sums = true, nil, nil }

type moeRoutingValues struct {
	e      int
	counts []int
	sums   []float64
	read   bool
}

// Read implements compute.MoERoutingValues.
func (v *moeRoutingValues) Read(counts [][]int, sums [][]float64) {
	if v.read {
		panic("cpu: MoERoutingValues read twice")
	}
	v.read = true
	readRouting(counts, sums, v.counts, v.sums, v.e, "cpu")
}

// readRouting copies (layers, E) statistics into the caller's per-layer
// slices, which must hold them.
func readRouting(counts [][]int, sums [][]float64, c []int, s []float64, E int, who string) {
	L := len(c) / E
	if len(counts) < L || len(sums) < L {
		panic(fmt.Sprintf("%s: MoERoutingValues.Read into %d and %d layers, want %d", who, len(counts), len(sums), L))
	}
	for l := 0; l < L; l++ {
		if len(counts[l]) < E || len(sums[l]) < E {
			panic(fmt.Sprintf("%s: MoERoutingValues.Read: layer %d into %d and %d experts, want %d", who, l, len(counts[l]), len(sums[l]), E))
		}
		copy(counts[l], c[l*E:(l+1)*E])
		copy(sums[l], s[l*E:(l+1)*E])
	}
}

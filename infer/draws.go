package infer

import (
	"fmt"
	"slices"

	"distill/cache"
	"distill/compute"
	"distill/internal/errkind"
	"distill/model/decoder"
)

// Draws asks ForwardDraws for the draws of a sampled kind (package cache,
// Draws): N per position from the teacher's softmax at the forward's
// temperature over the full vocabulary, by inverse CDF in ascending id
// order, with the uniforms U gives.
type Draws struct {
	// N is the number of draws per position, 1..cache.MaxDraws.
	N int
	// Head selects head+sampled: the draws come from outside the top-k
	// (renormalized), and the result carries the mass outside it.
	Head bool
	// U is the uniform in [0, 1) of draw d at position t of the s-th
	// sample of the forward (cache.DrawUniform keyed by the dataset and
	// that sample's index).
	U func(s, t, d int) float64
}

// DrawResult is a forward's draws in cache.Sample's layout, over the
// packed positions (n of them).
type DrawResult struct {
	N      []int32   // (n) distinct ids drawn at each position
	IDs    []int32   // (Σ N) by descending count, ties ascending id
	Counts []int32   // (Σ N)
	Tail   []float32 // (n) head+sampled: the mass outside the top-k
}

// ValidateDraws checks d against the model's limits.
func ValidateDraws(d Draws, k int) error {
	if d.N < 1 || d.N > cache.MaxDraws {
		return errkind.Errorf(ErrInput, "%d draws per position: want 1 to %d (cache.MaxDraws: a forward holds tokens x draws uniforms)", d.N, cache.MaxDraws)
	}
	if d.Head && k < 1 {
		return errkind.Errorf(ErrInput, "head+sampled with k %d: the head needs k >= 1", k)
	}
	if d.U == nil {
		return fmt.Errorf("%w: draws without a uniform generator", ErrInput)
	}
	return nil
}

// ForwardDraws is Forward plus the draws of d (validated: ValidateDraws).
// The top-k is the head under d.Head; without it k may be 0 (no top-k).
// The backend draws them in its streaming LM head, in the one pass over
// the vocabulary tiles that also makes the top-k (compute.Backend's
// LMHeadSample): [n x vocab] is never held, and only the blocks of 64 ids
// that the draws land in are multiplied again. The host computes the
// uniforms (n x N, sorted per position) and tallies the drawn ids.
func (m *Model) ForwardDraws(samples [][]int32, k int, temperature float32, d Draws) (ids []int32, logprobs []float32, res DrawResult) {
	head, out := m.drawsHead(k, d)
	m.pipe.Forward(samples, temperature, head)
	return out.ids, out.lps, out.res
}

// StartForwardDraws is ForwardDraws started (StartForward).
func (m *Model) StartForwardDraws(samples [][]int32, k int, temperature float32, d Draws) (wait func() (ids []int32, logprobs []float32, res DrawResult)) {
	head, out := m.drawsHead(k, d)
	fl := m.pipe.Start(samples, temperature, head)
	return func() ([]int32, []float32, DrawResult) {
		fl.Wait()
		return out.ids, out.lps, out.res
	}
}

// drawsResult is a forward's result with draws, as its heads add to it.
type drawsResult struct {
	ids []int32
	lps []float32
	res DrawResult
}

// drawsHead is the head of ForwardDraws: each micro-batch's top-k and
// draws, appended to out in micro-batch order.
func (m *Model) drawsHead(k int, d Draws) (decoder.Head, *drawsResult) {
	out := &drawsResult{}
	return func(last *decoder.Model, x compute.Tensor, s0, _ int, mb [][]int32) {
		i, l, r := m.sample(last, x, mb, s0, k, d)
		if out.ids == nil { // the first (or only) micro-batch's result
			out.ids, out.lps, out.res = i, l, r
			return
		}
		res := &out.res
		out.ids, out.lps = append(out.ids, i...), append(out.lps, l...)
		res.N, res.IDs, res.Counts = append(res.N, r.N...), append(res.IDs, r.IDs...), append(res.Counts, r.Counts...)
		if d.Head {
			res.Tail = append(res.Tail, r.Tail...)
		}
	}, out
}

// sample runs LMHeadSample on the LM head's input x of samples, the
// forward's samples [s0, s0+len(samples)), on the last stage, and turns
// its draws into DrawResult's layout.
func (m *Model) sample(last *decoder.Model, x compute.Tensor, samples [][]int32, s0, k int, d Draws) (ids []int32, logprobs []float32, res DrawResult) {
	be, N, n := last.Backend(), d.N, 0
	for _, smp := range samples {
		n += len(smp)
	}
	u := make([]float64, n*N)
	tmp, at := make([]float64, N), make([]int32, 2*N+1)
	r := 0
	for s, smp := range samples {
		for t := range smp {
			row := u[r*N : (r+1)*N]
			for i := range row {
				row[i] = d.U(s0+s, t, i)
			}
			sortUniforms(row, tmp, at)
			r++
		}
	}
	pu := make([]int32, 2*n*N)
	compute.PackUniforms(pu, u)
	uT := be.FromI32(pu)
	idT, lpT := be.New(compute.I32, n*k), be.New(compute.F32, n*k)
	drT, tlT := be.New(compute.I32, n*N), be.New(compute.F32, n)
	defer func() {
		for _, t := range []compute.Tensor{uT, idT, lpT, drT, tlT} {
			be.Free(t)
		}
	}()
	be.LMHeadSample(idT, lpT, drT, tlT, x, last.Head.W, uT, n, m.Cfg.Hidden, m.Cfg.VocabSize, k, N, d.Head)
	ids, logprobs = make([]int32, n*k), make([]float32, n*k)
	drawn, tail := make([]int32, n*N), make([]float32, n)
	be.ReadI32(idT, ids)
	be.ReadF32(lpT, logprobs)
	be.ReadI32(drT, drawn)
	be.ReadF32(tlT, tail)
	res.N = make([]int32, n)
	if d.Head {
		res.Tail = tail
	}
	for r := 0; r < n; r++ {
		row := drawn[r*N : (r+1)*N]
		if row[0] < 0 {
			continue // no mass outside the head: no draws
		}
		n0 := len(res.IDs)
		res.IDs, res.Counts = cache.Tally(row, res.IDs, res.Counts)
		res.N[r] = int32(len(res.IDs) - n0)
	}
	return ids, logprobs, res
}

// sortUniforms sorts u ascending (slices.Sort's result) by buckets: values
// in [0, 1) go to the first power of two at least len(u) buckets by
// value, then one insertion pass orders each bucket's few (independent
// uniforms: about one a bucket). tmp (len(u)) and at (2·len(u)+1) are
// scratch. About a quarter of slices.Sort's time for 50 (pdqsort's float
// comparisons, 8192 rows a forward; perf samples of a fill: 115 and 29). Values outside [0, 1) (PackUniforms
// refuses them) are sorted by slices.Sort.
func sortUniforms(u, tmp []float64, at []int32) {
	nb := 1
	for nb < len(u) {
		nb <<= 1
	}
	if len(tmp) < len(u) || len(at) < nb+1 {
		panic("infer: sortUniforms: scratch too small")
	}
	at = at[:nb+1]
	clear(at)
	for _, x := range u {
		if !(x >= 0 && x < 1) {
			slices.Sort(u)
			return
		}
		at[int(x*float64(nb))+1]++ // x·nb < nb: exact (nb a power of two)
	}
	for b := 0; b < nb; b++ {
		at[b+1] += at[b]
	}
	for _, x := range u {
		b := int(x * float64(nb))
		tmp[at[b]] = x
		at[b]++
	}
	copy(u, tmp[:len(u)])
	for i := 1; i < len(u); i++ {
		x, j := u[i], i
		for ; j > 0 && u[j-1] > x; j-- {
			u[j] = u[j-1]
		}
		u[j] = x
	}
}

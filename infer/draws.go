package infer

import (
	"fmt"
	"math"
	"runtime"
	"slices"
	"sync"

	"distill/cache"
	"distill/compute"
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

// drawTileFloats bounds one logits tile of the draw passes (n x width
// fp32 on the backend and on the host): 16 MiB.
var drawTileFloats = 1 << 22

// ValidateDraws checks d against the model's limits.
func ValidateDraws(d Draws, k int) error {
	if d.N < 1 || d.N > cache.MaxDraws {
		return fmt.Errorf("%w: %d draws per position: want 1 to %d (cache.MaxDraws: a forward holds tokens x draws uniforms)", ErrInput, d.N, cache.MaxDraws)
	}
	if d.Head && k < 1 {
		return fmt.Errorf("%w: head+sampled with k %d: the head needs k >= 1", ErrInput, k)
	}
	if d.U == nil {
		return fmt.Errorf("%w: draws without a uniform generator", ErrInput)
	}
	return nil
}

// ForwardDraws is Forward plus the draws of d (validated: ValidateDraws).
// The top-k is the head under d.Head; without it k may be 0 (no top-k).
//
//	x (n,C) -> for each vocab tile: z = x·W[tile]ᵀ (n,tile) on the backend,
//	           read to the host -> pass 1: running max and Σ exp (float64)
//	        -> pass 2 (logits recomputed): walk the CDF to the sorted
//	           thresholds u·Σ
//
// [n x vocab] is never held: two LM-head GEMMs over the tiles, and
// n x N thresholds on the host.
func (m *Model) ForwardDraws(samples [][]int32, k int, temperature float32, d Draws) (ids []int32, logprobs []float32, res DrawResult) {
	ids, logprobs = m.d.TopKThen(samples, k, temperature, func(x compute.Tensor, n int, top []int32, _ []float32) {
		res = m.draw(x, n, samples, k, top, d)
	})
	return ids, logprobs, res
}

// drawState is one position's (row's) state through the two passes.
type drawState struct {
	head     []int32 // the top-k ids ascending (head+sampled), else nil
	hp       int     // next head entry the walk has not passed
	mx       float64 // running max of the logits
	all, out float64 // Σ exp(z - mx) over the vocabulary and outside the head
	thr      []float64
	drawn    []int32
	next     int   // draws placed so far (pass 2)
	last     int32 // last id with mass outside the head (pass 2)
	cum      float64
}

func (m *Model) draw(x compute.Tensor, n int, samples [][]int32, k int, top []int32, d Draws) DrawResult {
	be, C, V := m.be, m.Cfg.Hidden, m.Cfg.VocabSize
	st := make([]drawState, n)
	r := 0
	for s, smp := range samples {
		for t := range smp {
			ds := &st[r]
			ds.mx, ds.last = math.Inf(-1), -1
			if d.Head {
				ds.head = slices.Clone(top[r*k : (r+1)*k])
				slices.Sort(ds.head)
			}
			ds.thr = make([]float64, d.N)
			for i := range ds.thr {
				ds.thr[i] = d.U(s, t, i)
			}
			slices.Sort(ds.thr)
			r++
		}
	}
	tw := min(V, max(64, drawTileFloats/max(n, 1)))
	tile := be.New(compute.F32, n*tw)
	defer be.Free(tile)
	buf := make([]float32, n*tw)
	logits := func(v0, w int) []float32 {
		out := be.View(tile, 0, n*w)
		be.MatMul(out, x, be.View(m.d.Head.W, v0*C, w*C), nil, n, w, C)
		be.ReadF32(out, buf[:n*w])
		return buf[:n*w]
	}
	// Pass 1: the normalizers, online (a running max, sums rescaled when
	// it grows), in ascending id order whatever the tile width.
	for v0 := 0; v0 < V; v0 += tw {
		w := min(tw, V-v0)
		z := logits(v0, w)
		rows(n, func(r int) {
			ds := &st[r]
			for j, zf := range z[r*w : (r+1)*w] {
				v, zz := int32(v0+j), float64(zf)
				if zz > ds.mx {
					sc := math.Exp(ds.mx - zz)
					ds.all, ds.out, ds.mx = ds.all*sc, ds.out*sc, zz
				}
				e := math.Exp(zz - ds.mx)
				ds.all += e
				if !ds.inHead(v) {
					ds.out += e
				}
			}
		})
	}
	for r := range st {
		ds := &st[r]
		ds.hp = 0
		for i := range ds.thr {
			ds.thr[i] *= ds.out
		}
		ds.drawn = make([]int32, 0, d.N)
		if ds.out == 0 {
			ds.next = d.N // no mass outside the head: no draws
		}
	}
	// Pass 2: walk each row's CDF (outside the head) to its thresholds.
	for v0 := 0; v0 < V; v0 += tw {
		if done(st, d.N) {
			break // every row has placed its draws: skip the rest
		}
		w := min(tw, V-v0)
		z := logits(v0, w)
		rows(n, func(r int) {
			ds := &st[r]
			if ds.next == d.N {
				return
			}
			for j, zf := range z[r*w : (r+1)*w] {
				v := int32(v0 + j)
				if ds.inHead(v) {
					continue
				}
				e := math.Exp(float64(zf) - ds.mx)
				if e == 0 {
					continue
				}
				ds.cum += e
				ds.last = v
				for ds.next < d.N && ds.cum > ds.thr[ds.next] {
					ds.drawn = append(ds.drawn, v)
					ds.next++
				}
				if ds.next == d.N {
					return
				}
			}
		})
	}
	res := DrawResult{N: make([]int32, n)}
	if d.Head {
		res.Tail = make([]float32, n)
	}
	for r := range st {
		ds := &st[r]
		for len(ds.drawn) < d.N && ds.out > 0 {
			// u so close to 1 that rounding left it above the sum.
			ds.drawn = append(ds.drawn, ds.last)
		}
		n0 := len(res.IDs)
		res.IDs, res.Counts = cache.Tally(ds.drawn, res.IDs, res.Counts)
		res.N[r] = int32(len(res.IDs) - n0)
		if d.Head {
			res.Tail[r] = float32(ds.out / ds.all)
		}
	}
	return res
}

// inHead reports whether v, met in ascending order, is in the head.
func (ds *drawState) inHead(v int32) bool {
	if ds.hp < len(ds.head) && ds.head[ds.hp] == v {
		ds.hp++
		return true
	}
	return false
}

func done(st []drawState, N int) bool {
	for r := range st {
		if st[r].next < N {
			return false
		}
	}
	return true
}

// rows runs f over [0, n) on the cores, each row on one goroutine: the
// result does not depend on how the rows are split.
func rows(n int, f func(r int)) {
	w := min(runtime.GOMAXPROCS(0), n)
	if w <= 1 {
		for r := 0; r < n; r++ {
			f(r)
		}
		return
	}
	var wg sync.WaitGroup
	for g := 0; g < w; g++ {
		wg.Add(1)
		go func(lo, hi int) {
			defer wg.Done()
			for r := lo; r < hi; r++ {
				f(r)
			}
		}(n*g/w, n*(g+1)/w)
	}
	wg.Wait()
}

package computetest

import (
	"fmt"
	"sync"

	"distill/compute"
)

// HostGroup stands in for a collective in tests: its ranks are goroutines
// of this process, each with its own backend; every operation waits for
// all ranks, then combines their buffers in rank order (deterministic).
type HostGroup struct {
	n    int
	mu   sync.Mutex
	cond *sync.Cond
	bufs [][]float32
	ops  []string  // what each rank called, checked alike
	in   int       // ranks that deposited for the current operation
	gen  int       // operations completed
	res  []float32 // the last completed operation's result
}

// NewHostGroup is a group of n ranks.
func NewHostGroup(n int) *HostGroup {
	g := &HostGroup{n: n, bufs: make([][]float32, n), ops: make([]string, n)}
	g.cond = sync.NewCond(&g.mu)
	return g
}

// exchange deposits x as rank's buffer for operation op and returns
// combine(all ranks' buffers), once every rank has deposited. Ranks that
// call different operations (or sizes) at the same point panic, naming
// both: the mistake NCCL would turn into a hang or garbage.
func (g *HostGroup) exchange(rank int, op string, x []float32, combine func([][]float32) []float32) []float32 {
	g.mu.Lock()
	defer g.mu.Unlock()
	gen := g.gen
	g.bufs[rank], g.ops[rank] = x, op
	if g.in++; g.in == g.n {
		for r := range g.ops {
			if g.ops[r] != g.ops[0] {
				panic(fmt.Sprintf("computetest: collective %d: rank 0 called %s, rank %d %s", g.gen, g.ops[0], r, g.ops[r]))
			}
		}
		g.res = combine(g.bufs)
		g.in, g.gen = 0, g.gen+1
		g.cond.Broadcast()
	}
	for g.gen == gen {
		g.cond.Wait()
	}
	return g.res
}

// Rank is rank i of the group over be (the backend its tensors are on).
func (g *HostGroup) Rank(i int, be compute.Backend) compute.Collective {
	return &hostRank{g: g, rank: i, be: be}
}

type hostRank struct {
	g    *HostGroup
	rank int
	be   compute.Backend
}

func (r *hostRank) Rank() int { return r.rank }
func (r *hostRank) Size() int { return r.g.n }
func (r *hostRank) read(t compute.Tensor, off, n int) []float32 {
	x := make([]float32, n)
	r.be.ReadF32(r.be.View(t, off, n), x)
	return x
}
func (r *hostRank) AllReduceSum(t compute.Tensor, n int) {
	sum := r.g.exchange(r.rank, fmt.Sprint("AllReduceSum ", n), r.read(t, 0, n), func(b [][]float32) []float32 {
		s := make([]float32, n)
		for _, x := range b {
			for i, v := range x {
				s[i] += v
			}
		}
		return s
	})
	r.be.WriteF32(t, sum)
}
func (r *hostRank) ReduceScatterSum(dst, src compute.Tensor, n int) {
	all := r.g.exchange(r.rank, fmt.Sprint("ReduceScatterSum ", n), r.read(src, 0, n*r.g.n), func(b [][]float32) []float32 {
		s := make([]float32, len(b[0]))
		for _, x := range b {
			for i, v := range x {
				s[i] += v
			}
		}
		return s
	})
	r.be.WriteF32(dst, all[r.rank*n:(r.rank+1)*n])
}

// AllGather moves F32 or BF16 tensors (read widened and written back
// rounded: exact for BF16 values), of one dtype on every rank.
func (r *hostRank) AllGather(dst, src compute.Tensor, n int) {
	if dst.DType() != src.DType() {
		panic(fmt.Sprintf("computetest: AllGather of a %v source into a %v destination", src.DType(), dst.DType()))
	}
	r.be.WriteF32(dst, r.g.exchange(r.rank, fmt.Sprint("AllGather ", n, " ", src.DType()), r.read(src, 0, n), func(b [][]float32) []float32 {
		var s []float32
		for _, x := range b {
			s = append(s, x...)
		}
		return s
	}))
}
func (r *hostRank) Broadcast(t compute.Tensor, n int, root int) {
	r.be.WriteF32(t, r.g.exchange(r.rank, fmt.Sprint("Broadcast ", n, " from ", root), r.read(t, 0, n), func(b [][]float32) []float32 { return b[root] }))
}
func (r *hostRank) Close() error { return nil }

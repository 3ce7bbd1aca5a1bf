package trainer

import (
	"fmt"

	"distill/compute"
	"distill/train"
)

// Parallel makes a run one rank of a data-parallel job (ZeRO stage 0,
// DDP's model: every rank holds the whole student and optimizer; package
// train/dist finds the ranks, launches them and joins them):
//
//   - every rank reads the same training order from the same source, and
//     runs the forward and backward of the step's rows i with
//     i mod WorldSize = Rank, each row's loss normalized by the whole
//     step's loss positions, so that the sum of the ranks' gradients is
//     the single-process gradient (summed in another order);
//   - the gradients and the step's loss sums are all-reduced (summed)
//     over the ranks, then every rank clips and steps AdamW alike: the
//     weights stay the same on every rank;
//   - every rank evaluates (the same rows: an eval costs what it does on
//     one device), rank 0 alone writes the run directory (its lock,
//     config.yaml, metrics, TensorBoard, checkpoints) and its progress;
//     the others read its checkpoints to resume;
//   - a stop (SIGTERM) on any rank stops all of them at the same step
//     boundary: the ranks all-reduce their stop flags before each step.
type Parallel struct {
	Rank, WorldSize int
	// LocalRank picks the GPU of this node the rank trains on.
	LocalRank int
	// Join joins the group once the rank's backend is open, and returns
	// its collective over that backend (the rendezvous and NCCL).
	Join func(be compute.Backend) (compute.Collective, error)
}

// ranks is a run's place in its data-parallel group: one rank of one
// (a single process) when c is nil.
type ranks struct {
	c          compute.Collective
	rank, size int
	be         compute.Backend
	flag       compute.Tensor // one element: the stop flags' sum
}

// single is the group of a run with no Parallel.
var single = ranks{size: 1}

// leader reports whether this rank writes the run directory (rank 0).
func (g *ranks) leader() bool { return g.rank == 0 }

// mine reports whether row i of a step is this rank's.
func (g *ranks) mine(i int) bool { return i%g.size == g.rank }

// joinRanks joins p's group over be, checking that the collective agrees
// with the rank and size p was launched with.
func joinRanks(p *Parallel, be compute.Backend) (ranks, error) {
	c, err := p.Join(be)
	if err != nil {
		return single, fmt.Errorf("joining the data-parallel group (rank %d of %d): %w", p.Rank, p.WorldSize, err)
	}
	if c.Rank() != p.Rank || c.Size() != p.WorldSize {
		c.Close()
		return single, fmt.Errorf("the data-parallel group made this process rank %d of %d, its launcher rank %d of %d", c.Rank(), c.Size(), p.Rank, p.WorldSize)
	}
	return ranks{c: c, rank: p.Rank, size: p.WorldSize, be: be, flag: be.New(compute.F32, 1)}, nil
}

// anyStop reports whether any rank asks to stop (a collective: every rank
// calls it before each step).
func (g *ranks) anyStop(mine bool) bool {
	if g.c == nil {
		return mine
	}
	v := float32(0)
	if mine {
		v = 1
	}
	g.be.WriteF32(g.flag, []float32{v})
	g.c.AllReduceSum(g.flag, 1)
	out := []float32{0}
	g.be.ReadF32(g.flag, out)
	return out[0] > 0
}

// reduceGrads sums the student's gradients over the ranks.
func (g *ranks) reduceGrads(s *train.Student) {
	if g.c != nil {
		s.AllReduceGrads(g.c)
	}
}

// reduceSums sums vals (a step's loss sums, weighted by loss positions)
// over the ranks, in place.
func (g *ranks) reduceSums(vals []float64) {
	if g.c == nil || len(vals) == 0 {
		return
	}
	f := make([]float32, len(vals))
	for i, v := range vals {
		f[i] = float32(v)
	}
	t := g.be.FromF32(f)
	g.c.AllReduceSum(t, len(f))
	g.be.ReadF32(t, f)
	g.be.Free(t)
	for i := range vals {
		vals[i] = float64(f[i])
	}
}

func (g *ranks) close() {
	if g.c != nil {
		g.be.Free(g.flag)
		g.c.Close()
	}
}

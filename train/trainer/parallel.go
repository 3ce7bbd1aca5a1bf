package trainer

import (
	"fmt"

	"distill/compute"
	"distill/train"
	"distill/train/optim"
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
//   - an eval's rows are shared out as a step's are, and its sums
//     summed; rank 0 alone writes the run directory (its lock,
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
	buf        compute.Tensor // what reduceSums sends, grown as needed
}

// single is the group of a run with no Parallel.
var single = ranks{size: 1}

// leader reports whether this rank writes the run directory (rank 0).
func (g *ranks) leader() bool { return g.rank == 0 }

// mine reports whether row i of a step is this rank's.
func (g *ranks) mine(i int) bool { return i%g.size == g.rank }

// rowsOf is how many of a step's (or an eval's) n rows rank r runs.
func (g *ranks) rowsOf(n, r int) int { return (n - r + g.size - 1) / g.size }

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
	return ranks{c: c, rank: p.Rank, size: p.WorldSize, be: be}, nil
}

// anyStop reports whether any rank asks to stop (a collective: every rank
// calls it before each step).
func (g *ranks) anyStop(mine bool) bool {
	if g.c == nil {
		return mine
	}
	v := []float64{0}
	if mine {
		v[0] = 1
	}
	g.reduceSums(v)
	return v[0] > 0
}

// reduceGrads sums the student's gradients over the ranks.
func (g *ranks) reduceGrads(s *train.Student) {
	if g.c != nil {
		s.AllReduceGrads(g.c)
	}
}

// reduceSums sums vals (a step's loss sums, weighted by loss positions;
// the stop flags) over the ranks, in place.
func (g *ranks) reduceSums(vals []float64) {
	if g.c == nil || len(vals) == 0 {
		return
	}
	f := make([]float32, len(vals))
	for i, v := range vals {
		f[i] = float32(v)
	}
	if g.buf == nil || g.buf.Len() < len(f) {
		if g.buf != nil {
			g.be.Free(g.buf)
		}
		g.buf = g.be.New(compute.F32, max(len(f), 64))
	}
	t := g.be.View(g.buf, 0, len(f))
	g.be.WriteF32(t, f)
	g.c.AllReduceSum(t, len(f))
	g.be.ReadF32(t, f)
	for i := range vals {
		vals[i] = float64(f[i])
	}
}

// reduceEval sums an eval's sums over the ranks (each scored its rows;
// nt teachers: every rank's sums get their slots, rows or not). The
// counts travel as fp32: exact below 2^24 positions.
func (g *ranks) reduceEval(es *evalSums, nt int) {
	if es.teachers == nil && nt > 0 {
		es.teachers, es.tAgree = make([]TeacherMetrics, nt), make([]int, nt)
	}
	v := []float64{es.loss, es.kd, es.ce, float64(es.tokens), float64(es.acc), float64(es.agree)}
	for i := range es.teachers {
		v = append(v, es.teachers[i].KD, float64(es.tAgree[i]))
	}
	for b := range es.binN {
		v = append(v, float64(es.binN[b]), float64(es.binAcc[b]), es.binConf[b])
	}
	g.reduceSums(v)
	es.loss, es.kd, es.ce = v[0], v[1], v[2]
	es.tokens, es.acc, es.agree = int(v[3]+0.5), int(v[4]+0.5), int(v[5]+0.5)
	for i := range es.teachers {
		es.teachers[i].KD, es.tAgree[i] = v[6+2*i], int(v[7+2*i]+0.5)
	}
	v = v[6+2*len(es.teachers):]
	for b := range es.binN {
		es.binN[b], es.binAcc[b], es.binConf[b] = int(v[3*b]+0.5), int(v[3*b+1]+0.5), v[3*b+2]
	}
}

func (g *ranks) close() {
	if g.c != nil {
		if g.buf != nil {
			g.be.Free(g.buf)
		}
		g.c.Close()
	}
}

// zero1 is ZeRO stage 1 over a data-parallel group: AdamW's moments are
// sharded over the ranks. The parameter arena is cut into contiguous
// slices, rank r's [bounds[r], bounds[r+1]), and each rank's optimizer
// holds the moments of its slice only, cut into pieces at the parameter
// tensors' boundaries (an optim.Group each). After the gradients are
// summed (every rank holds them whole, as at stage 0, so the clip's norm
// is the same everywhere), each rank steps AdamW over its pieces, then
// every rank broadcasts its slice of the updated parameters to the
// others. The checkpoint format does not change: the moments are
// gathered to rank 0 to save, and each rank takes its slices to resume,
// so a run resumes under any number of ranks and either stage.
type zero1 struct {
	g      *ranks
	s      *train.Student
	bounds []int         // (size+1) the ranks' slices of the arena
	pieces []train.Piece // this rank's, in arena order: the optimizer's groups
}

// newZero1 shards s's arena of P parameters over g: slices of
// ceil(P/size), the last shorter.
func newZero1(g *ranks, s *train.Student) *zero1 {
	P := 0
	for _, t := range s.Tensors {
		P = max(P, t.Off+t.N)
	}
	z := &zero1{g: g, s: s, bounds: make([]int, g.size+1)}
	per := (P + g.size - 1) / g.size
	for r := range z.bounds {
		z.bounds[r] = min(r*per, P)
	}
	z.pieces = piecesOf(s.Tensors, z.bounds[g.rank], z.bounds[g.rank+1])
	return z
}

// piecesOf cuts [lo, hi) of the arena at the tensors' boundaries.
func piecesOf(ts []train.Tensor, lo, hi int) []train.Piece {
	var out []train.Piece
	for i, t := range ts {
		a, b := max(lo, t.Off), min(hi, t.Off+t.N)
		if a < b {
			out = append(out, train.Piece{Tensor: i, Off: a - t.Off, N: b - a})
		}
	}
	return out
}

// groups are the optimizer's groups: this rank's pieces of full's.
func (z *zero1) groups(full []optim.Group) []optim.Group {
	out := make([]optim.Group, len(z.pieces))
	for i, p := range z.pieces {
		g := full[p.Tensor]
		be := g.Backend
		out[i] = optim.Group{Name: g.Name, Decay: g.Decay, Backend: be, P: be.View(g.P, p.Off, p.N), G: be.View(g.G, p.Off, p.N)}
		if g.Params != nil {
			out[i].Params, out[i].Grads = g.Params[p.Off:p.Off+p.N], g.Grads[p.Off:p.Off+p.N]
		}
	}
	return out
}

// at says where the optimizer's group i lies in its full tensor (offset,
// and the tensor's length), for loading a checkpoint's moments.
func (z *zero1) at(i int) (off, full int) {
	p := z.pieces[i]
	return p.Off, z.s.Tensors[p.Tensor].N
}

// share sends each rank's slice of the updated parameters to the others.
func (z *zero1) share() {
	for r := 0; r < z.g.size; r++ {
		if n := z.bounds[r+1] - z.bounds[r]; n > 0 {
			z.g.c.Broadcast(z.s.ParamsView(z.bounds[r], n), n, r)
		}
	}
}

// gatherMoments collects every tensor's moments from the ranks'
// optimizers, whose groups are pieces of the tensors (ZeRO-1's slices z,
// or a sharded student's pieces when z is nil); a collective: every rank
// calls it. On rank 0 the moments of tensor i are m[i], v[i]; the other
// ranks get nil. A piece at a time crosses the group, so no rank ever
// holds more than one piece of another's.
func gatherMoments(g *ranks, s *train.Student, ad *optim.AdamW, z *zero1) (m, v [][]float32) {
	ts := s.Tensors
	pieces := func(r int) []train.Piece { return s.ShardPieces(r) }
	if z != nil {
		pieces = func(r int) []train.Piece { return piecesOf(ts, z.bounds[r], z.bounds[r+1]) }
	}
	if g.leader() {
		m, v = make([][]float32, len(ts)), make([][]float32, len(ts))
		for i, t := range ts {
			m[i], v[i] = make([]float32, t.N), make([]float32, t.N)
		}
	}
	be := g.be
	for r := 0; r < g.size; r++ {
		for j, p := range pieces(r) {
			buf := be.New(compute.F32, 2*p.N)
			if r == g.rank {
				pm, pv := ad.MomentTensors(j)
				be.Copy(be.View(buf, 0, p.N), pm)
				be.Copy(be.View(buf, p.N, p.N), pv)
			}
			g.c.Broadcast(buf, 2*p.N, r)
			if g.leader() {
				be.ReadF32(be.View(buf, 0, p.N), m[p.Tensor][p.Off:p.Off+p.N])
				be.ReadF32(be.View(buf, p.N, p.N), v[p.Tensor][p.Off:p.Off+p.N])
			}
			be.Free(buf)
		}
	}
	return m, v
}

package cpu

import "distill/compute"

// LoRA adapters on the experts' projections (MoEWeights.Adapters), over
// one expert's grouped rows [lo, hi): the same formulas as compute.LoRA,
// as sgemm calls on the rows' slices, and the dropout's mask drawn per
// token (the grouped row's, order[lo+i]/K) as MoEWeights.Drop defines it.

// moeLoRA is one expert's rows: their first grouped row, count, the
// grouping and top-k (for each row's token), and the dropout's key.
type moeLoRA struct {
	be       *Backend
	order    []int32
	lo, n, K int
	drop     *compute.MoEDrop
}

// mask returns l's dropout mask in this batch, nil for none.
func (r *moeLoRA) mask(l *compute.LoRA) *compute.DropoutMask {
	if r.drop == nil || l.Dropout == 0 {
		return nil
	}
	d := compute.NewDropoutMask(l.Stream, r.drop.Step, r.drop.Row, l.Dropout)
	return &d
}

// dropped writes d's dropout of x (n, cols) into xd, row i masked as its
// token's row; with dx set it instead adds dxd·mask·scale to dx
// (DropoutBackward), xd unused.
func (r *moeLoRA) dropped(d *compute.DropoutMask, xd, x []float32, dx, dxd []float32, cols int) {
	r.be.rows(r.n, 4*cols, func(_, i0, i1 int) {
		keep := make([]bool, cols)
		for i := i0; i < i1; i++ {
			d.KeepRow(int(r.order[r.lo+i])/r.K, keep)
			for c, k := range keep {
				switch {
				case dx != nil && k:
					dx[i*cols+c] += dxd[i*cols+c] * d.Scale
				case dx != nil:
				case k:
					xd[i*cols+c] = x[i*cols+c] * d.Scale
				default:
					xd[i*cols+c] = 0
				}
			}
		}
	})
}

// forward adds l's term to out (n, Out) from x (n, In): out +=
// Scale·(drop(x)·Aᵀ)·Bᵀ.
func (r *moeLoRA) forward(l *compute.LoRA, out, x []float32) {
	if l == nil {
		return
	}
	be, n := r.be, r.n
	xa := x
	if d := r.mask(l); d != nil {
		xa = be.scratch(n * l.In)
		defer be.release(xa)
		r.dropped(d, xa, x, nil, nil, l.In)
	}
	t := be.scratch(n * l.Rank)
	defer be.release(t)
	be.sgemm(false, true, n, l.Rank, l.In, 1, xa, l.In, f32(l.A), l.In, 0, t, l.Rank)
	for i := range t {
		t[i] *= l.Scale
	}
	be.sgemm(false, true, n, l.Out, l.Rank, 1, t, l.Rank, f32(l.B), l.Rank, 1, out, l.Out)
}

// backward is forward's backward from dout (n, Out): DB += doutᵀ·t, DA +=
// dtᵀ·drop(x) and dx (n, In) += drop'(dt·A), with t = Scale·drop(x)·Aᵀ
// recomputed and dt = Scale·dout·B.
func (r *moeLoRA) backward(l *compute.LoRA, dx, dout, x []float32) {
	if l == nil {
		return
	}
	be, n := r.be, r.n
	d := r.mask(l)
	xa := x
	if d != nil {
		xa = be.scratch(n * l.In)
		defer be.release(xa)
		r.dropped(d, xa, x, nil, nil, l.In)
	}
	t, dt := be.scratch(n*l.Rank), be.scratch(n*l.Rank)
	defer be.release(t, dt)
	be.sgemm(false, true, n, l.Rank, l.In, 1, xa, l.In, f32(l.A), l.In, 0, t, l.Rank)
	for i := range t {
		t[i] *= l.Scale
	}
	be.sgemm(true, false, l.Out, l.Rank, n, 1, dout, l.Out, t, l.Rank, 1, f32(l.DB), l.Rank)
	be.sgemm(false, false, n, l.Rank, l.Out, 1, dout, l.Out, f32(l.B), l.Rank, 0, dt, l.Rank)
	for i := range dt {
		dt[i] *= l.Scale
	}
	be.sgemm(true, false, l.Rank, l.In, n, 1, dt, l.Rank, xa, l.In, 1, f32(l.DA), l.In)
	if d == nil {
		be.sgemm(false, false, n, l.In, l.Rank, 1, dt, l.Rank, f32(l.A), l.In, 1, dx, l.In)
		return
	}
	dxa := be.scratch(n * l.In)
	defer be.release(dxa)
	be.sgemm(false, false, n, l.In, l.Rank, 1, dt, l.Rank, f32(l.A), l.In, 0, dxa, l.In)
	r.dropped(d, nil, nil, dx, dxa, l.In)
}

// adapter returns expert e's adapters (zero: none).
func adapter(m *compute.MoEWeights, e int) compute.MoEAdapter {
	if m.Adapters == nil {
		return compute.MoEAdapter{}
	}
	return m.Adapters[e]
}

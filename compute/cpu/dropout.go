package cpu

import "distill/compute"

// Dropout implements compute.Backend: the mask row by row
// (DropoutMask.KeepRow), the rows split over the workers.
func (b *Backend) Dropout(out, x compute.Tensor, d *compute.DropoutMask, rows, cols int) {
	o, xs := f32(out), f32(x)
	b.rows(rows, 4*cols, func(_, lo, hi int) {
		keep := make([]bool, cols)
		for r := lo; r < hi; r++ {
			d.KeepRow(r, keep)
			or, xr := o[r*cols:(r+1)*cols], xs[r*cols:(r+1)*cols]
			for c, k := range keep {
				if k {
					or[c] = xr[c] * d.Scale
				} else {
					or[c] = 0
				}
			}
		}
	})
}

// DropoutBackward implements compute.Backend.
func (b *Backend) DropoutBackward(dx, dout compute.Tensor, d *compute.DropoutMask, rows, cols int) {
	g, dy := f32(dx), f32(dout)
	b.rows(rows, 4*cols, func(_, lo, hi int) {
		keep := make([]bool, cols)
		for r := lo; r < hi; r++ {
			d.KeepRow(r, keep)
			gr, dr := g[r*cols:(r+1)*cols], dy[r*cols:(r+1)*cols]
			for c, k := range keep {
				if k {
					gr[c] += dr[c] * d.Scale
				}
			}
		}
	})
}

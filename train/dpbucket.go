package train

import (
	"distill/compute"
	"distill/model/decoder"
)

// dpBuckets all-reduces an unsharded student's gradients (data parallel
// at ZeRO stages 0 and 1) in buckets, one a decoder block, beside the
// backward of the step's last row (PyTorch DDP's gradient buckets), on a
// backend that runs work beside its kernels (compute.Overlapper):
//
//   - when block i's backward is done (decoder.Residency's GradsDone),
//     its gradients (a contiguous range of the gradient arena) are
//     copied into a bucket buffer and all-reduced there on the backend's
//     second stream, while the blocks before it run their backward;
//   - the buckets alternate between two buffers (block i's is i mod 2):
//     when block i-2's backward starts (its Fetch), block i's reduced
//     gradients are copied back into the arena, after a wait for them;
//   - AllReduceGrads, after the step's rows, copies back the last ones
//     and reduces what is left: the units outside the blocks, and every
//     block on a rank whose last row did not reduce them (a rank without
//     a row in the step). The collectives' order is the same on every
//     rank: the blocks from the last to the first, then the rest.
//
// The arena itself is only read or written by the main stream: the
// all-reduce works on the bucket, so the backward's writes to the
// arena's other blocks never meet it. The sums are those of one
// all-reduce of the arena, element for element (NCCL sums each element
// over the ranks; a bucket boundary changes no element's sum on the
// emulator, and on a GPU at most NCCL's chunking of the reduction).
type dpBuckets struct {
	be     compute.Backend
	grads  compute.Tensor
	blocks [][2]int // block i's range [lo, hi) of the gradient arena
	rest   [][2]int // the ranges outside the blocks
	buf    [2]compute.Tensor
	fence  [2]compute.Fence
	pend   [2]int // the block whose reduced gradients buf[k] holds (-1: none)
	done   []bool // block i was reduced in this step's backward
	c      compute.Collective
	armed  bool
}

// newDPBuckets lays out s's buckets.
func newDPBuckets(s *Student) *dpBuckets {
	d := &dpBuckets{be: s.be, grads: s.grads, pend: [2]int{-1, -1}}
	d.blocks = make([][2]int, s.Cfg.Layers)
	for i := range d.blocks {
		d.blocks[i] = [2]int{-1, -1}
	}
	largest := 1
	for _, t := range s.Tensors {
		b := blockOf(t.Name)
		if b < 0 {
			if n := len(d.rest); n > 0 && d.rest[n-1][1] == t.Off {
				d.rest[n-1][1] = t.Off + t.N
			} else {
				d.rest = append(d.rest, [2]int{t.Off, t.Off + t.N})
			}
			continue
		}
		r := &d.blocks[b]
		if r[0] < 0 {
			r[0] = t.Off
		}
		r[1] = t.Off + t.N
		largest = max(largest, r[1]-r[0])
	}
	d.done = make([]bool, len(d.blocks))
	for k := range d.buf {
		d.buf[k] = s.be.New(compute.F32, largest)
	}
	return d
}

// view is range r of the arena.
func (d *dpBuckets) view(r [2]int) compute.Tensor { return d.be.View(d.grads, r[0], r[1]-r[0]) }

// land waits for bucket k's all-reduce and copies its block back into the
// arena.
func (d *dpBuckets) land(k int) {
	if d.pend[k] < 0 {
		return
	}
	r := d.blocks[d.pend[k]]
	d.fence[k].Wait()
	d.be.Copy(d.view(r), d.be.View(d.buf[k], 0, r[1]-r[0]))
	d.fence[k], d.pend[k] = nil, -1
}

// Fetch implements decoder.Residency: block i's gradients may be written
// from now on; its bucket's last block lands first.
func (d *dpBuckets) Fetch(i int) bool {
	d.land(i % 2)
	return false
}

// GradsDone implements decoder.Residency: in an armed backward, block
// i's gradients go to their bucket and its all-reduce starts.
func (d *dpBuckets) GradsDone(i int) {
	if !d.armed || d.blocks[i][0] < 0 {
		return
	}
	k, r := i%2, d.blocks[i]
	d.land(k)
	b := d.be.View(d.buf[k], 0, r[1]-r[0])
	d.be.Copy(b, d.view(r))
	c := d.c
	d.fence[k] = compute.Beside(d.be, func() { c.AllReduceSum(b, r[1]-r[0]) })
	d.pend[k], d.done[i] = i, true
}

func (d *dpBuckets) Slots() int                { return 0 }
func (d *dpBuckets) FetchOutside(int)          {}
func (d *dpBuckets) OutsideGradsDone(role int) {}

// finish lands the buckets in flight, then reduces in the arena what
// the backward did not: the blocks not reduced (last to first), then the
// rest. (Once every bucket has landed nothing runs beside: these run in
// order, after the buckets' on the GPU too.)
func (d *dpBuckets) finish(c compute.Collective) {
	d.reset()
	for i := len(d.blocks) - 1; i >= 0; i-- {
		if !d.done[i] && d.blocks[i][0] >= 0 {
			c.AllReduceSum(d.view(d.blocks[i]), d.blocks[i][1]-d.blocks[i][0])
		}
		d.done[i] = false
	}
	for _, r := range d.rest {
		c.AllReduceSum(d.view(r), r[1]-r[0])
	}
}

// reset lands the buckets in flight and disarms.
func (d *dpBuckets) reset() {
	d.land(0)
	d.land(1)
	d.armed = false
}

func (d *dpBuckets) free() {
	d.reset()
	for _, b := range d.buf {
		d.be.Free(b)
	}
}

var _ decoder.Residency = (*dpBuckets)(nil)

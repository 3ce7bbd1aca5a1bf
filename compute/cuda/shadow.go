package cuda

import (
	"math"
	"sort"

	"distill/compute"
)

// Weight shadows: the BF16 copies of the student's fp32 parameters that the
// GEMMs read, made once per optimizer step instead of once per GEMM call.
//
// Training keeps fp32 master weights; every GEMM reads BF16 operands. Made
// per use, the rounding of one weight runs three times a step (the
// forward, the recomputed forward of activation recomputation, the
// backward's dx), and under NVFP4 QAD the weight is fake-quantized into an
// F32 copy on every forward as well. Here the backend keeps, for each F32
// parameter tensor, a persistent BF16 shadow: AdamW's kernel writes the
// updated master and its BF16 rounding in one pass (k_adamw_bf16), and a
// GEMM that reads the parameter reads the shadow while it is current.
// Under QAD the fake quantization of a parameter writes the BF16 rounding
// of its result beside it (k_fakequant_nvfp4_bf16) and runs once per
// version of the parameter: the decoder's per-forward refresh is skipped
// when neither the master nor the quantized copy changed since.
//
// What is a parameter: a range AdamW updated (its p). The contract has no
// other word for it, and activations are never AdamW's p, so the
// backend learns the parameters at the first optimizer step without any
// call of the caller's: the first step rounds per use as before, every
// later one reads shadows. A GEMM operand uses a shadow only when it
// starts where the parameter starts (a decoder's weight is the view of
// the same range); any other F32 operand is rounded per use, as before.
//
// Exactness: a shadow is current only while nothing wrote to its range
// since it was made (each method that writes a tensor reports the range:
// wrote), and it holds f2bf of every element, the rounding
// k_f32_to_bf16 makes. So a GEMM reads the same BF16 bits it read when
// rounding per use, and the results are bit-identical (TestWeightShadows
// here, TestCUDAWeightShadows in package train: losses and weights bit for
// bit with Options.PerUseCasts). A shadow is its own allocation, like the
// per-use scratch it replaces: the operand's alignment, which selects the
// cuBLASLt plan, is unchanged.
//
// Memory: each shadow is half its parameter (BF16 of F32), allocated at
// the first GEMM that reads the parameter after an AdamW step and kept
// until the parameter's tensor is freed (ShadowBytes reports the total).
// Norm weights and biases, never GEMM operands, get none.

// region is a range of F32 device memory the backend watches for writes:
// a parameter (AdamW's p) or the destination of a parameter's fake
// quantization. Regions never overlap.
type region struct {
	p     uint64 // the first byte
	n     int    // F32 elements
	ver   uint64 // b.wseq at the last write
	bf    uint64 // the BF16 shadow (n elements); 0 until a GEMM needs it
	bfVer uint64 // the shadow holds the rounding of the values of version bfVer
	// fq, on a fake quantization's destination, says what it holds:
	// FakeQuantNVFP4 of src at version srcVer, which made version ver.
	fq *fqState
}

type fqState struct {
	src        *region
	srcVer     uint64
	rows, cols int
	amax       float32
	ver        uint64 // the destination's version it wrote
}

func (r *region) end() uint64 { return r.p + uint64(r.n)*4 }

// current reports whether r's shadow holds the rounding of its values.
func (r *region) current() bool { return r.bf != 0 && r.bfVer == r.ver }

// shadows is the backend's set of regions, sorted by address.
type shadows struct {
	off    bool // Options.PerUseCasts: no regions, every operand rounded per use
	regs   []*region
	wseq   uint64 // bumped by every write into a region
	lo, hi uint64 // the span of regs: writes outside it skip the search
}

// find returns the index of the first region ending after p.
func (s *shadows) find(p uint64) int {
	return sort.Search(len(s.regs), func(i int) bool { return s.regs[i].end() > p })
}

// exact returns the region that starts at p, or nil.
func (s *shadows) exact(p uint64) *region {
	if i := s.find(p); i < len(s.regs) && s.regs[i].p == p {
		return s.regs[i]
	}
	return nil
}

func (s *shadows) span() {
	s.lo, s.hi = 0, 0
	if len(s.regs) > 0 {
		s.lo, s.hi = s.regs[0].p, s.regs[len(s.regs)-1].end()
	}
}

// wrote records a write to bytes [p, p+n): every region it touches gets a
// new version, so its shadow (and, for a fake quantization's source or
// destination, the record of what it holds) is stale.
func (b *Backend) wroteRange(p uint64, n int64) {
	if k := b.keptW; k != nil && n > 0 && p < k.p+uint64(k.n)*4 && k.p < p+uint64(n) {
		k.stale = true
	}
	s := &b.shadow
	if n <= 0 || len(s.regs) == 0 || p >= s.hi || p+uint64(n) <= s.lo {
		return
	}
	s.wseq++
	for i := s.find(p); i < len(s.regs) && s.regs[i].p < p+uint64(n); i++ {
		s.regs[i].ver = s.wseq
	}
}

// wrote records writes to the whole of each tensor (nil ones skipped): a
// conservative bound of what a method writes.
func (b *Backend) wrote(ts ...*tensor) {
	for _, t := range ts {
		if t != nil {
			b.wroteRange(t.p, t.bytes())
		}
	}
}

// wroteT is wrote for contract tensors (nil skipped).
func (b *Backend) wroteT(ts ...compute.Tensor) {
	for _, t := range ts {
		if t != nil {
			if c, ok := t.(*tensor); ok && c != nil && c.b == b {
				b.wroteRange(c.p, c.bytes())
			}
		}
	}
}

// register returns the region of exactly [p, p+4n), making it if needed;
// regions it overlaps are dropped first (their shadows freed).
func (b *Backend) register(p uint64, n int) *region {
	s := &b.shadow
	i := s.find(p)
	if i < len(s.regs) && s.regs[i].p == p && s.regs[i].n == n {
		return s.regs[i]
	}
	j := i
	for j < len(s.regs) && s.regs[j].p < p+uint64(n)*4 {
		b.free(s.regs[j].bf)
		j++
	}
	s.wseq++
	r := &region{p: p, n: n, ver: s.wseq}
	s.regs = append(s.regs[:i], append([]*region{r}, s.regs[j:]...)...)
	s.span()
	return r
}

// dropRange forgets the regions in bytes [p, p+n) (their memory is being
// freed) and frees their shadows.
func (b *Backend) dropRange(p uint64, n int64) {
	s := &b.shadow
	if n <= 0 || len(s.regs) == 0 || p >= s.hi || p+uint64(n) <= s.lo {
		return
	}
	i := s.find(p)
	j := i
	for j < len(s.regs) && s.regs[j].p < p+uint64(n) {
		b.free(s.regs[j].bf)
		j++
	}
	s.regs = append(s.regs[:i], s.regs[j:]...)
	s.span()
}

// shadowOf returns the current BF16 shadow of an F32 GEMM operand t of n
// elements, making it now if it is stale, or 0 when t is no watched
// region's start (the caller rounds per use).
func (b *Backend) shadowOf(t *tensor, n int) uint64 {
	r := b.shadow.exact(t.p)
	if r == nil || n > r.n {
		return 0
	}
	if r.bf == 0 {
		r.bf = b.alloc(int64(r.n) * 2)
		b.keep(r.bf)
	}
	if !r.current() {
		b.convert("k_f32_to_bf16", r.bf, r.p, int64(r.n))
		r.bfVer = r.ver
	}
	return r.bf
}

// ShadowBytes returns the device bytes the weight shadows hold now (BF16
// copies of parameters, and of their fake-quantized copies under QAD).
func (b *Backend) ShadowBytes() int64 {
	defer b.enter()()
	var n int64
	for _, r := range b.shadow.regs {
		if r.bf != 0 {
			n += int64(r.n) * 2
		}
	}
	return n
}

// fakeQuantRegion prepares FakeQuantNVFP4(dst, src) of rows x cols. When
// src is a parameter and dst overlaps no region but its own, dst becomes a
// region that records what it holds; the call returns it, and whether it
// holds this quantization of src's current values already (the decoder
// refreshes its fake-quantized weights on every forward; they change once
// per optimizer step). Otherwise (activations, an in-place call) it
// records the write and returns nil.
func (b *Backend) fakeQuantRegion(dst, src *tensor, rows, cols int, amax float32) (*region, bool) {
	s := &b.shadow
	n := rows * cols
	bytes := uint64(n) * 4
	rs := s.exact(src.p)
	overlap := dst.p < src.p+bytes && src.p < dst.p+bytes
	if s.off || rs == nil || rs.n != n || rs.fq != nil || overlap || !s.freeFor(dst.p, n) {
		b.wrote(dst)
		return nil, false
	}
	d := b.register(dst.p, n)
	if f := d.fq; f != nil && f.src == rs && f.srcVer == rs.ver && f.ver == d.ver && f.rows == rows && f.cols == cols &&
		math.Float32bits(f.amax) == math.Float32bits(amax) {
		return d, true
	}
	s.wseq++
	d.ver = s.wseq
	d.fq = &fqState{src: rs, srcVer: rs.ver, rows: rows, cols: cols, amax: amax, ver: d.ver}
	return d, false
}

// freeFor reports whether F32 range [p, p+4n) overlaps no region, or
// exactly one region equal to it.
func (s *shadows) freeFor(p uint64, n int) bool {
	i := s.find(p)
	if i == len(s.regs) || s.regs[i].p >= p+uint64(n)*4 {
		return true
	}
	return s.regs[i].p == p && s.regs[i].n == n
}

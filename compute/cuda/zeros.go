package cuda

// Deferred zeros. The decoder's backward zeroes a gradient buffer and then
// accumulates into it (compute.Backend's += rule): about ten buffers a
// layer, 470 MB of memsets a Qwen3-0.6B layer at 8192 tokens, each then
// read back by the first call that adds to it. Zero therefore only
// records the buffer's bytes as pending, and the calls after it decide:
//
//   - a call that writes a pending range whole (a consumer: MatMulBackward's
//     dx GEMM, SwiGLUBackward, RMSNormBackward's dx, cuDNN's attention
//     backward) takes it (takeZero) and writes its result where it would
//     have added it: the GEMM with beta 0, the kernels with their acc flag
//     0 (they start each element's sum from 0, not from a load), cuDNN's dv
//     in place. Before any of its own work it enqueues the memsets of the
//     pending ranges that overlap any of its operands (flushZerosOver);
//     the others, memory it does not touch, stay pending;
//   - every other call enqueues all of them when it enters (enter), before
//     its own work, so that it, its marks and events, and any other stream
//     waiting on them see the zeros where they would have.
//
// Only Zero, View (which touch no memory) and the consumers leave pending
// ranges alone, so a memset moves past those calls only, never past work
// that could read its buffer, and never to another stream (Beside enters
// on the main stream first). The results are the same values: an
// element's sum starts from 0 either way. A GEMM with beta 0, or cuDNN's
// dv written in place, may leave -0 where adding to a zeroed +0 gave +0,
// which nothing downstream tells apart. Options.EagerZeros (or
// $DISTILL_CUDA_EAGER_ZEROS=1) turns it off for comparisons: each Zero is
// its memset, as before.

// zeroRange is a pending zero: n bytes at device address p.
type zeroRange struct {
	p uint64
	n int64
}

// deferZero records [p, p+n) as pending, or enqueues its memset under
// Options.EagerZeros.
func (b *Backend) deferZero(p uint64, n int64) {
	if n <= 0 {
		return
	}
	if b.eagerZeros {
		b.memset0(p, n)
		return
	}
	b.zeros = append(b.zeros, zeroRange{p, n})
}

// takeZero reports whether the n bytes at p, which the caller is about to
// write in whole, were pending zeros, and removes them: the caller then
// writes its result instead of adding it. A pending range that [p, p+n)
// is the start of stays pending for its rest (a call per run of samples
// over views of one buffer, in order). Anything else (a partly pending
// range, an overlap) is false: flushZerosOver then zeroes it before the
// caller adds to it. Call it before any work of the call is enqueued,
// and only when the call is sure to write the range.
func (b *Backend) takeZero(p uint64, n int64) bool {
	if n <= 0 {
		return false
	}
	for i, r := range b.zeros {
		if r.p != p || r.n < n {
			continue
		}
		if r.n == n {
			b.zeros = append(b.zeros[:i], b.zeros[i+1:]...)
		} else {
			b.zeros[i] = zeroRange{p + uint64(n), r.n - n}
		}
		return true
	}
	return false
}

// flushZeros enqueues the memsets of all pending zeros.
func (b *Backend) flushZeros() {
	for _, r := range b.zeros {
		b.memset0(r.p, r.n)
	}
	b.zeros = b.zeros[:0]
}

// accArg is a kernel's acc flag: 0 when the call took its output's
// pending zero (the kernel writes), 1 when it adds.
func accArg(took bool) int32 { return boolArg(!took) }

// takeZeros is takeZero for all of rs or none: true when every range was
// pending and is taken; false leaves the pending ranges as they were.
func (b *Backend) takeZeros(rs ...zeroRange) bool {
	saved := append([]zeroRange(nil), b.zeros...)
	for _, r := range rs {
		if !b.takeZero(r.p, r.n) {
			b.zeros = append(b.zeros[:0], saved...)
			return false
		}
	}
	return true
}

// flushZerosOver enqueues the memsets of the pending zeros that overlap
// any of ts (nil entries skipped): a consumer's operands.
func (b *Backend) flushZerosOver(ts ...*tensor) {
	keep := b.zeros[:0]
	for _, r := range b.zeros {
		hit := false
		for _, t := range ts {
			if t != nil && r.p < t.p+uint64(t.bytes()) && t.p < r.p+uint64(r.n) {
				hit = true
				break
			}
		}
		if hit {
			b.memset0(r.p, r.n)
		} else {
			keep = append(keep, r)
		}
	}
	b.zeros = keep
}

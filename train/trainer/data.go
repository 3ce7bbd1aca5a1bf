package trainer

import (
	"fmt"
	"slices"

	"distill/cache"
	"distill/internal/errkind"
	"distill/train"
	"distill/train/loss"
)

// sampleStream is the training order of a data source: a cache's
// (stream) or a dataset's (dsStream).
type sampleStream interface {
	// next returns the next training sample, starting a new epoch when
	// one ends.
	next() (cache.Sample, error)
	// position is the data position after the last sample next
	// returned: what a checkpoint stores to resume there.
	position() (epoch int, pos int64)
	close()
}

// stream yields training samples in the cache's seeded order, epoch after
// epoch, skipping the held-out range. Its position (epoch, samples pulled
// from the epoch's iterator) is all a checkpoint needs to resume it: the
// order of an epoch is a pure function of (seed+epoch, cache chunks).
type stream struct {
	rd     *cache.Reader
	seed   uint64
	window int
	held   cache.Range
	epoch  int
	pos    int64 // samples pulled from the current epoch's iterator
	it     *cache.Iterator
	seen   bool // the current epoch yielded at least one sample
}

func newStream(rd *cache.Reader, seed uint64, window int, held cache.Range, epoch int, pos int64) (*stream, error) {
	st := &stream{rd: rd, seed: seed, window: window, held: held, epoch: epoch}
	if err := st.open(); err != nil {
		return nil, err
	}
	for st.pos < pos { // resume: replay the order up to where the checkpoint was
		if !st.it.Next() {
			if err := st.it.Err(); err != nil {
				return nil, err
			}
			return nil, fmt.Errorf("%w: checkpoint data position (epoch %d, sample %d) is past the end of the cache's epoch (%d samples): was the cache changed?", ErrResume, epoch, pos, st.pos)
		}
		st.pos++
		// The replayed part counts for "this epoch has training samples":
		// a position at the very end of an epoch must roll into the next.
		if st.usable(st.it.Sample()) {
			st.seen = true
		}
	}
	return st, nil
}

func (st *stream) open() error {
	it, err := st.rd.Iter(cache.IterOptions{Seed: st.seed + uint64(st.epoch), Window: st.window})
	if err != nil {
		return err
	}
	st.it, st.pos, st.seen = it, 0, false
	return nil
}

func (st *stream) position() (int, int64) { return st.epoch, st.pos }

func (st *stream) close() {
	if st.it != nil {
		st.it.Close()
	}
}

// next returns the next training sample, starting a new epoch when one
// ends.
func (st *stream) next() (cache.Sample, error) {
	for {
		if !st.it.Next() {
			if err := st.it.Err(); err != nil {
				return cache.Sample{}, err
			}
			if !st.seen {
				return cache.Sample{}, errkind.Errorf(ErrData, "the cache has no non-empty training samples outside data.eval_range %v", st.held)
			}
			st.it.Close()
			st.epoch++
			if err := st.open(); err != nil {
				return cache.Sample{}, err
			}
			continue
		}
		st.pos++
		s := st.it.Sample()
		if !st.usable(s) {
			continue
		}
		st.seen = true
		return s, nil
	}
}

// usable reports whether s is a training sample: outside the held-out
// range and not an empty record (one the data layer dropped or skipped;
// a cache of nothing else must be an error, not an endless loop).
func (st *stream) usable(s cache.Sample) bool {
	return len(s.Tokens) > 0 && !(s.Index >= st.held.Start && s.Index < st.held.End)
}

// packer concatenates samples into rows of at most seqLen tokens, never
// splitting a sample: block-diagonal attention and per-sample positions
// come from the row's Starts, and a row is as long as its samples (no
// padding is computed).
type packer struct {
	seqLen   int
	truncate bool
	k        int
	// dense, for a cache of a sampled kind, turns each sample's draws
	// into rows of k = DenseK entries (cache.Dense); nil for topk.
	dense *cache.Manifest
	// Multi-teacher KD (data.caches, or several distill.teachers): multi
	// are the rows' Teachers (weight and k; teacher 0's top-k is the
	// sample's own), and more returns the other teachers' top-k of a
	// sample (a stream that carries them gives them itself, moreFrom).
	// nil: one teacher.
	multi []loss.Teacher
	more  func(cache.Sample) ([]teacherTopK, error)
}

// fit returns s cut to seqLen, or an error if it is longer and truncation
// is off.
func (p *packer) fit(s cache.Sample) (cache.Sample, error) {
	if p.dense != nil {
		s = cache.Dense(p.dense, s)
	}
	T := len(s.Tokens)
	if T <= p.seqLen {
		return s, nil
	}
	if !p.truncate {
		return s, &SampleTooLongError{Index: s.Index, Tokens: T, SeqLen: p.seqLen}
	}
	n := p.seqLen
	return cache.Sample{Index: s.Index, Tokens: s.Tokens[:n], Mask: s.Mask[:n], TopKIDs: s.TopKIDs[:n*p.k], TopKLogProbs: s.TopKLogProbs[:n*p.k]}, nil
}

// SampleTooLongError is a sample longer than the packed row length with
// truncation off. Its message names the config keys; a command that took
// the row length from a flag (student eval --seq-len) names the flag
// instead from its fields. It wraps ErrData.
type SampleTooLongError struct {
	Index          int64
	Tokens, SeqLen int
}

func (e *SampleTooLongError) Error() string {
	return fmt.Sprintf("sample %d has %d tokens, more than data.seq_len %d: raise seq_len or set data.truncate: true", e.Index, e.Tokens, e.SeqLen)
}

func (e *SampleTooLongError) Unwrap() error { return ErrData }

// appendSample adds s to row b (which has room), with the other teachers'
// top-k of s under multi-teacher KD (more is nil otherwise).
func (p *packer) appendSample(b *train.Batch, s cache.Sample, more []teacherTopK) {
	if len(b.Starts) == 0 {
		b.Starts = []int32{0}
	}
	b.Tokens = append(b.Tokens, s.Tokens...)
	b.Mask = append(b.Mask, s.Mask...)
	if p.multi != nil {
		if b.Teachers == nil {
			b.Teachers = slices.Clone(p.multi)
		}
		t0 := &b.Teachers[0]
		t0.TopIDs = append(t0.TopIDs, s.TopKIDs...)
		t0.TopLP = append(t0.TopLP, s.TopKLogProbs...)
		n := len(s.Tokens) // fit may have cut s: cut the others alike
		for i, m := range more {
			t, k := &b.Teachers[i+1], b.Teachers[i+1].K
			t.TopIDs = append(t.TopIDs, m.IDs[:n*k]...)
			t.TopLP = append(t.TopLP, m.LPs[:n*k]...)
		}
	} else {
		b.K = p.k
		b.TopIDs = append(b.TopIDs, s.TopKIDs...)
		b.TopLP = append(b.TopLP, s.TopKLogProbs...)
	}
	b.Starts = append(b.Starts, int32(len(b.Tokens)))
}

// moreOf returns the other teachers' top-k of s (nil with one teacher).
func (p *packer) moreOf(s cache.Sample) ([]teacherTopK, error) {
	if p.more == nil {
		return nil, nil
	}
	return p.more(s)
}

// teacherStream is a stream that carries the other teachers' top-k of
// its samples itself (online multi-teacher KD): more returns those of the
// sample next returned last.
type teacherStream interface {
	more(cache.Sample) ([]teacherTopK, error)
}

// moreFrom returns the other teachers' top-k of s, just taken from st:
// from st when it carries them, else as moreOf.
func (p *packer) moreFrom(st sampleStream, s cache.Sample) ([]teacherTopK, error) {
	if ts, ok := st.(teacherStream); ok && p.multi != nil {
		return ts.more(s)
	}
	return p.moreOf(s)
}

// counted is the number of loss positions of a row (t -> t+1 in the same
// sample with Mask[t+1] = 1), the loss package's definition.
func counted(b *train.Batch) int {
	n := 0
	for s := 0; s+1 < len(b.Starts); s++ {
		for t := b.Starts[s] + 1; t < b.Starts[s+1]; t++ {
			if b.Mask[t] != 0 {
				n++
			}
		}
	}
	return n
}

// nextStep pulls samples until at least tokens tokens are gathered and
// packs them into rows.
func (p *packer) nextStep(st sampleStream, tokens int) ([]*train.Batch, error) {
	var rows []*train.Batch
	cur := &train.Batch{}
	n := 0
	for n < tokens {
		s, err := st.next()
		if err != nil {
			return nil, err
		}
		if len(s.Tokens) == 0 {
			continue // a record the data layer dropped or skipped
		}
		more, err := p.moreFrom(st, s)
		if err != nil {
			return nil, err
		}
		if s, err = p.fit(s); err != nil {
			return nil, err
		}
		if len(cur.Tokens)+len(s.Tokens) > p.seqLen {
			rows = append(rows, cur)
			cur = &train.Batch{}
		}
		p.appendSample(cur, s, more)
		n += len(s.Tokens)
	}
	return append(rows, cur), nil
}

// evalRows packs the held-out samples [r.Start, r.End) of a cache in
// index order.
func (p *packer) evalRows(rd *cache.Reader, r cache.Range) ([]*train.Batch, int, error) {
	return p.packRows(int(r.End-r.Start), func(k int) (cache.Sample, error) {
		i := r.Start + int64(k)
		s, err := rd.Get(i)
		if err != nil {
			return s, fmt.Errorf("eval sample %d: %w", i, err)
		}
		return s, nil
	})
}

// packRows packs samples get(0..n-1) in that order into rows (eval),
// skipping empty ones, and returns the rows and the number of samples in
// them.
func (p *packer) packRows(n int, get func(k int) (cache.Sample, error)) ([]*train.Batch, int, error) {
	var rows []*train.Batch
	cur := &train.Batch{}
	used := 0
	for k := 0; k < n; k++ {
		s, err := get(k)
		if err != nil {
			return nil, 0, err
		}
		if len(s.Tokens) == 0 {
			continue // a record the data layer dropped or skipped
		}
		more, err := p.moreOf(s)
		if err != nil {
			return nil, 0, err
		}
		if s, err = p.fit(s); err != nil {
			return nil, 0, err
		}
		if len(cur.Tokens)+len(s.Tokens) > p.seqLen {
			rows = append(rows, cur)
			cur = &train.Batch{}
		}
		p.appendSample(cur, s, more)
		used++
	}
	if len(cur.Tokens) > 0 {
		rows = append(rows, cur)
	}
	return rows, used, nil
}

package trainer

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"sync/atomic"

	"distill/cache"
	"distill/data"
	"distill/internal/errkind"
)

// dsBlock is how many positions of the order the read-ahead tokenizes at
// a time (its workers share them).
const dsBlock = 64

// dsItem is one training sample of the read-ahead, with the data position
// after it (epoch, positions of the epoch's order consumed).
type dsItem struct {
	s     cache.Sample
	epoch int
	pos   int64
}

// dsStream yields a dataset's training samples in the order of epoch e,
// data.NewOrder(Len, seed+e), skipping the held-out range and the samples
// the data layer dropped or skipped. A goroutine tokenizes ahead of the
// consumer on the configured workers, at most limit tokens ahead, so the
// step never waits for tokenization unless it outruns the workers. Its
// position (epoch, positions of the order consumed) is that of the last
// sample next returned, and the order is a pure function of the seed, so
// a resume starts there directly: no replay.
type dsStream struct {
	ds      *data.Dataset
	seed    uint64
	held    cache.Range
	workers int
	limit   int

	epoch int
	pos   int64

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu     sync.Mutex
	cond   *sync.Cond
	q      []dsItem
	qhead  int
	tokens int   // tokens queued
	err    error // the producer's error, after the queued samples
	closed bool
}

// newDSStream starts the read-ahead at (epoch, pos). limit bounds the
// tokens queued ahead of the consumer.
func newDSStream(ds *data.Dataset, seed uint64, held cache.Range, workers, limit int, epoch int, pos int64) (*dsStream, error) {
	n := ds.Len()
	if pos < 0 || pos > n {
		return nil, fmt.Errorf("%w: checkpoint data position (epoch %d, sample %d) is past the end of the dataset's %d samples: was the dataset changed?", ErrResume, epoch, pos, n)
	}
	heldN := max(min(held.End, n)-max(held.Start, 0), 0)
	if n-heldN <= 0 {
		return nil, errkind.Errorf(ErrData, "the dataset's %d samples are all in data.eval_range %v: nothing is left to train on; shrink eval_range", n, held)
	}
	st := &dsStream{ds: ds, seed: seed, held: held, workers: max(workers, 1), limit: max(limit, 1), epoch: epoch, pos: pos}
	st.cond = sync.NewCond(&st.mu)
	st.ctx, st.cancel = context.WithCancel(context.Background())
	st.wg.Add(1)
	go st.produce(epoch, pos)
	return st, nil
}

func (st *dsStream) position() (int, int64) { return st.epoch, st.pos }

// next returns the next training sample, waiting for the read-ahead.
func (st *dsStream) next() (cache.Sample, error) {
	st.mu.Lock()
	defer st.mu.Unlock()
	for st.qhead == len(st.q) && st.err == nil {
		st.cond.Wait()
	}
	if st.qhead == len(st.q) {
		return cache.Sample{}, st.err
	}
	it := st.q[st.qhead]
	st.q[st.qhead] = dsItem{}
	st.qhead++
	if st.qhead == len(st.q) {
		st.q, st.qhead = st.q[:0], 0
	}
	st.tokens -= len(it.s.Tokens)
	st.epoch, st.pos = it.epoch, it.pos
	st.cond.Broadcast()
	return it.s, nil
}

// close stops the read-ahead and waits for it.
func (st *dsStream) close() {
	st.cancel()
	st.mu.Lock()
	st.closed = true
	st.cond.Broadcast()
	st.mu.Unlock()
	st.wg.Wait()
}

// push queues a sample, waiting while limit tokens are queued; false
// once the stream is closed.
func (st *dsStream) push(it dsItem) bool {
	st.mu.Lock()
	defer st.mu.Unlock()
	for st.tokens >= st.limit && !st.closed {
		st.cond.Wait()
	}
	if st.closed {
		return false
	}
	st.q = append(st.q, it)
	st.tokens += len(it.s.Tokens)
	st.cond.Broadcast()
	return true
}

func (st *dsStream) fail(err error) {
	st.mu.Lock()
	st.err = err
	st.cond.Broadcast()
	st.mu.Unlock()
}

// produce walks the epochs' orders from (epoch, pos), tokenizing dsBlock
// positions at a time on the workers and queueing the usable samples in
// order.
func (st *dsStream) produce(epoch int, pos int64) {
	defer st.wg.Done()
	n := st.ds.Len()
	// A saved position is always just after a training sample, so an
	// epoch resumed past its start has yielded one.
	seen := pos > 0
	idx := make([]int64, 0, dsBlock)
	after := make([]int64, 0, dsBlock)
	out := make([]data.Sample, dsBlock)
	errs := make([]error, dsBlock)
	for {
		order := data.NewOrder(n, st.seed+uint64(epoch))
		for pos < n {
			idx, after = idx[:0], after[:0]
			for ; pos < n && len(idx) < dsBlock; pos++ {
				i := order.At(pos)
				if i >= st.held.Start && i < st.held.End {
					continue
				}
				idx = append(idx, i)
				after = append(after, pos+1)
			}
			if err := st.tokenize(idx, out[:len(idx)], errs[:len(idx)]); err != nil {
				st.fail(err)
				return
			}
			for k, s := range out[:len(idx)] {
				if len(s.IDs) == 0 {
					continue // dropped or skipped by the data layer (counted in its Stats)
				}
				seen = true
				if !st.push(dsItem{s: cache.Sample{Index: s.Index, Tokens: s.IDs, Mask: s.Mask}, epoch: epoch, pos: after[k]}) {
					return
				}
			}
		}
		if !seen {
			st.fail(errkind.Errorf(ErrData, "the dataset has no non-empty training samples outside data.eval_range %v (every one was dropped or skipped: %s)", st.held, statsLine(st.ds.Stats())))
			return
		}
		epoch, pos, seen = epoch+1, 0, false
	}
}

// tokenize reads samples idx into out on the workers; the first error (by
// position) fails the block.
func (st *dsStream) tokenize(idx []int64, out []data.Sample, errs []error) error {
	var next atomic.Int64
	var wg sync.WaitGroup
	for w := 0; w < min(st.workers, len(idx)); w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				k := next.Add(1) - 1
				if k >= int64(len(idx)) {
					return
				}
				r, err := st.ds.Range(st.ctx, idx[k], idx[k]+1)
				errs[k] = err
				if err == nil {
					out[k] = r[0]
				}
			}
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return err
		}
	}
	return nil
}

// dsEvalSamples reads the held-out samples [r.Start, r.End) in index
// order, as cache samples without a teacher.
func dsEvalSamples(ds *data.Dataset, r cache.Range) ([]cache.Sample, error) {
	ss, err := ds.Range(context.Background(), r.Start, r.End)
	if err != nil {
		return nil, fmt.Errorf("eval samples %v: %w", r, err)
	}
	out := make([]cache.Sample, len(ss))
	for i, s := range ss {
		out[i] = cache.Sample{Index: s.Index, Tokens: s.IDs, Mask: s.Mask}
	}
	return out, nil
}

// statsLine sums up what the data layer did to the samples it read:
// "N samples, T tokens (X targets); a truncated, b dropped, c skipped
// (reason: count, ...)".
func statsLine(s data.Stats) string {
	line := fmt.Sprintf("%d samples read, %d tokens (%d targets); %d truncated, %d dropped, %d skipped", s.Samples, s.Tokens, s.Targets, s.Truncated, s.Dropped, s.Skipped)
	if len(s.Reasons) > 0 {
		keys := make([]string, 0, len(s.Reasons))
		for k := range s.Reasons {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		var parts []string
		for _, k := range keys {
			parts = append(parts, fmt.Sprintf("%s: %d", k, s.Reasons[k]))
		}
		line += " (" + strings.Join(parts, ", ") + ")"
	}
	return line
}

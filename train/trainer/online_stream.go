package trainer

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"sync"
	"time"

	"distill/cache"
	"distill/data"
	"distill/internal/errkind"
)

// chunkOrder is the training order of one epoch over samples [0, n) cut
// into chunks [c*C, (c+1)*C): the order in which cache.Reader.Iter (with
// the same seed and window) yields a cache filled with those chunks. The
// chunk list is shuffled; then the samples of each run of window
// consecutive chunks are shuffled among themselves. An online run thus
// visits the samples exactly as an offline run from a cache of the same
// teacher does, and a window's chunks are complete (for the write-through
// cache) once the window is done.
type chunkOrder struct {
	n, C   int64
	seed   uint64
	window int
	chunks []int64 // chunk numbers in shuffled order
	// the window being read
	w    int
	off  []int64 // cumulative sample offsets of its chunks
	perm []int32
}

func newChunkOrder(n, C int64, seed uint64, window int) *chunkOrder {
	if window <= 0 {
		window = 4
	}
	nc := int((n + C - 1) / C)
	o := &chunkOrder{n: n, C: C, seed: seed, window: window, chunks: make([]int64, nc), w: -1}
	for i := range o.chunks {
		o.chunks[i] = int64(i)
	}
	rand.New(rand.NewPCG(seed, 0)).Shuffle(nc, func(a, b int) { o.chunks[a], o.chunks[b] = o.chunks[b], o.chunks[a] })
	return o
}

// chunkRange is the sample range of chunk c.
func (o *chunkOrder) chunkRange(c int64) cache.Range {
	return cache.Range{Start: c * o.C, End: min((c+1)*o.C, o.n)}
}

// windows is the number of windows of the epoch.
func (o *chunkOrder) windows() int { return (len(o.chunks) + o.window - 1) / o.window }

// windowChunks are the chunk numbers of window w.
func (o *chunkOrder) windowChunks(w int) []int64 {
	return o.chunks[w*o.window : min((w+1)*o.window, len(o.chunks))]
}

// windowStart is the position of window w's first sample in the epoch.
func (o *chunkOrder) windowStart(w int) int64 {
	// Every chunk but the last (by number) has C samples.
	var p int64
	for _, c := range o.chunks[:w*o.window] {
		r := o.chunkRange(c)
		p += r.End - r.Start
	}
	return p
}

// enter makes window w current and returns its sample count.
func (o *chunkOrder) enter(w int) int64 {
	cs := o.windowChunks(w)
	o.w = w
	o.off = make([]int64, len(cs)+1)
	for i, c := range cs {
		r := o.chunkRange(c)
		o.off[i+1] = o.off[i] + r.End - r.Start
	}
	size := o.off[len(cs)]
	o.perm = make([]int32, size)
	for i := range o.perm {
		o.perm[i] = int32(i)
	}
	rand.New(rand.NewPCG(o.seed, uint64(w)+1)).Shuffle(len(o.perm), func(a, b int) { o.perm[a], o.perm[b] = o.perm[b], o.perm[a] })
	return size
}

// at is the sample at position p of the current window.
func (o *chunkOrder) at(p int64) int64 {
	e := int64(o.perm[p])
	cs := o.windowChunks(o.w)
	slot := sort.Search(len(cs), func(i int) bool { return o.off[i+1] > e })
	return o.chunkRange(cs[slot]).Start + e - o.off[slot]
}

// onItem is one position of the order on its way to the step.
type onItem struct {
	s     cache.Sample
	epoch int
	pos   int64 // data position after this item
	// skip: not a training sample (held out, or scored only to complete
	// a chunk of the write cache); the consumer passes over it.
	skip bool
	// more are teachers 1..'s top-k of s (multi-teacher runs); s holds
	// teacher 0's.
	more []teacherTopK
	done chan struct{}
	err  error
}

// onlineStream yields a dataset's samples with their teachers' top-k,
// asked from live teachers (a teacherPool each) ahead of the step: a planner walks the
// order (chunkOrder) from the data position and queues at most prefetch
// items; tokenization workers read each sample and submit it to the
// teachers, or take it from the write cache when its chunk is there; the
// consumer (next) takes the items in order and waits until every
// teacher has answered the head one. Its data position is that of the cache stream (epoch,
// positions of the epoch's order consumed), so checkpoints of online and
// offline runs mean the same thing.
type onlineStream struct {
	ds      *data.Dataset
	on      *online
	pools   []*teacherPool
	wcs     []*writeCache // per teacher; nil: no write-through
	seed    uint64
	window  int
	C       int64
	held    cache.Range
	workers int

	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
	items  chan *onItem
	work   chan *onItem

	// consumer
	epoch int
	pos   int64
	seen  bool
	wait  time.Duration // time next spent waiting for answers since the last stats call
	last  *onItem       // the item next returned last (its other teachers' top-k)
}

func newOnlineStream(ds *data.Dataset, on *online, seed uint64, window int, C int64, held cache.Range, workers, prefetch int, epoch int, pos int64) (*onlineStream, error) {
	n := ds.Len()
	if pos < 0 || pos > n {
		return nil, fmt.Errorf("%w: checkpoint data position (epoch %d, sample %d) is past the end of the dataset's %d samples: was the dataset changed?", ErrResume, epoch, pos, n)
	}
	st := &onlineStream{ds: ds, on: on, pools: on.pools, wcs: on.wcs, seed: seed, window: window, C: C, held: held, workers: max(workers, 1),
		items: make(chan *onItem, max(prefetch, 1)), work: make(chan *onItem, max(prefetch, 1)), epoch: epoch, pos: pos, seen: pos > 0}
	st.ctx, st.cancel = context.WithCancel(context.Background())
	st.wg.Add(1 + st.workers)
	go st.plan(epoch, pos)
	for w := 0; w < st.workers; w++ {
		go st.tokenize()
	}
	return st, nil
}

func (st *onlineStream) position() (int, int64) { return st.epoch, st.pos }

// stats returns the time next waited for answers since the last call,
// and the items queued ahead of the step (asked or answered).
func (st *onlineStream) stats() (time.Duration, int) {
	w := st.wait
	st.wait = 0
	return w, len(st.items)
}

// close stops the planner and the workers.
func (st *onlineStream) close() {
	st.cancel()
	st.wg.Wait()
}

// next returns the next training sample, waiting for its answer.
func (st *onlineStream) next() (cache.Sample, error) {
	for {
		var it *onItem
		select {
		case it = <-st.items:
		case <-st.on.ctx.Done():
			return cache.Sample{}, st.on.failed()
		}
		t0 := time.Now()
		select {
		case <-it.done:
		default:
			select {
			case <-it.done:
			case <-st.on.ctx.Done():
				select {
				case <-it.done:
				default:
					return cache.Sample{}, st.on.failed()
				}
			}
		}
		st.wait += time.Since(t0)
		if it.err != nil {
			return cache.Sample{}, it.err
		}
		if it.epoch != st.epoch {
			if !st.seen {
				return cache.Sample{}, errkind.Errorf(ErrData, "the dataset has no non-empty training samples outside data.eval_range %v (every one was dropped or skipped: %s)", st.held, statsLine(st.ds.Stats()))
			}
			st.epoch, st.seen = it.epoch, false
		}
		if it.skip {
			continue
		}
		if len(it.s.Tokens) == 0 {
			st.pos = it.pos // as the cache stream: counted, never trained on
			continue
		}
		st.epoch, st.pos, st.seen = it.epoch, it.pos, true
		st.last = it
		return it.s, nil
	}
}

// push queues it for the consumer and the workers; false once closed.
func (st *onlineStream) push(it *onItem) bool {
	select {
	case st.items <- it:
	case <-st.ctx.Done():
		return false
	}
	select {
	case st.work <- it:
		return true
	case <-st.ctx.Done():
		return false
	}
}

// plan walks the epochs' orders from (epoch, pos).
func (st *onlineStream) plan(epoch int, pos int64) {
	defer st.wg.Done()
	defer close(st.work)
	n := st.ds.Len()
	for ; ; epoch, pos = epoch+1, 0 {
		o := newChunkOrder(n, st.C, st.seed+uint64(epoch), st.window)
		dones := make([]map[int64]bool, len(st.wcs)) // per teacher: chunks in its write cache
		for j, wc := range st.wcs {
			if wc == nil {
				continue
			}
			var err error
			if dones[j], err = wc.epochStart(st.ctx); err != nil {
				st.failItem(epoch, err)
				return
			}
		}
		// need: some teacher's write cache lacks the chunk.
		need := func(chunk int64) bool {
			for j, wc := range st.wcs {
				if wc != nil && !dones[j][chunk] {
					return true
				}
			}
			return false
		}
		var at int64
		for w := 0; w < o.windows(); w++ {
			size := o.enter(w)
			if at+size <= pos {
				at += size
				continue
			}
			var backfill []int64 // samples before the resume position whose chunk must be completed
			for p := int64(0); p < size; p++ {
				i := o.at(p)
				it := &onItem{s: cache.Sample{Index: i}, epoch: epoch, pos: at + p + 1, done: make(chan struct{})}
				need := need(i / st.C)
				if at+p < pos {
					if need {
						backfill = append(backfill, i)
					}
					continue
				}
				if i >= st.held.Start && i < st.held.End {
					it.skip = true
					if !need {
						close(it.done)
					}
				}
				if !st.push(it) {
					return
				}
			}
			for _, i := range backfill {
				if !st.push(&onItem{s: cache.Sample{Index: i}, epoch: epoch, pos: at + size, skip: true, done: make(chan struct{})}) {
					return
				}
			}
			at += size
		}
	}
}

// failItem hands err to the consumer as an item.
func (st *onlineStream) failItem(epoch int, err error) {
	it := &onItem{epoch: epoch, err: err, done: make(chan struct{})}
	close(it.done)
	select {
	case st.items <- it:
	case <-st.ctx.Done():
	}
}

// tokenize reads the queued items' samples and gets their answers.
func (st *onlineStream) tokenize() {
	defer st.wg.Done()
	for it := range st.work {
		select {
		case <-it.done:
			continue // held out, nothing to do
		default:
		}
		if err := st.fill(it); err != nil {
			it.err = err
			close(it.done)
		}
		if st.ctx.Err() != nil {
			return
		}
	}
}

// more returns the other teachers' top-k of s, the sample next returned
// last (the packer's source of them in multi-teacher runs).
func (st *onlineStream) more(s cache.Sample) ([]teacherTopK, error) {
	if st.last == nil || st.last.s.Index != s.Index {
		return nil, fmt.Errorf("trainer: the other teachers' answers of sample %d were asked after the next sample was taken", s.Index)
	}
	return st.last.more, nil
}

// fill gets it's sample and every teacher's top-k of it: a teacher's from
// its write cache if the chunk is there, else asked. A sample is
// tokenized from the dataset unless every teacher's cache has it. An item
// skipped by training asks only the teachers whose write cache lacks its
// chunk. it.done is closed once every teacher's part is in.
func (st *onlineStream) fill(it *onItem) error {
	i := it.s.Index
	n := len(st.pools)
	ans := make([]cache.Sample, n)
	var ask []int // the teachers to ask
	for j := 0; j < n; j++ {
		wc := st.wcs[j]
		if it.skip {
			if wc != nil && !wc.has(i) {
				ask = append(ask, j)
			}
			continue
		}
		if wc != nil {
			s, ok, err := wc.get(i)
			if err != nil {
				return err
			}
			if ok {
				ans[j] = s
				continue
			}
		}
		ask = append(ask, j)
	}
	if len(ask) == 0 {
		if !it.skip {
			for j := 1; j < n; j++ {
				if err := sameSample(&ans[0], &ans[j]); err != nil {
					return errkind.Errorf(ErrMismatch, "sample %d differs between the write caches %s and %s: %s: they were written from other data; use another distill.write_cache",
						i, st.wcs[0].dir, st.wcs[j].dir, err)
				}
			}
			it.s, it.more = ans[0], st.on.moreOf(ans)
		}
		close(it.done)
		return nil
	}
	r, err := st.ds.Range(st.ctx, i, i+1)
	if err != nil {
		if errors.Is(err, context.Canceled) && st.ctx.Err() != nil {
			return err
		}
		return fmt.Errorf("sample %d: %w", i, err)
	}
	base := cache.Sample{Index: i, Tokens: r[0].IDs, Mask: r[0].Mask}
	for j := 0; j < n; j++ {
		if ans[j].Tokens != nil {
			if err := sameSample(&base, &ans[j]); err != nil {
				return errkind.Errorf(ErrMismatch, "sample %d in write cache %s differs from the dataset's: %s: the cache was written from other data; use another distill.write_cache",
					i, st.wcs[j].dir, err)
			}
		}
	}
	if len(base.Tokens) == 0 { // dropped or skipped by the data layer: nothing to ask
		for _, j := range ask {
			if st.wcs[j] != nil {
				if err := st.wcs[j].add(base); err != nil {
					return err
				}
			}
		}
		it.s = base
		close(it.done)
		return nil
	}
	// The last teacher to answer completes the item.
	var (
		mu      sync.Mutex
		pending = len(ask)
		errs    error
	)
	for _, j := range ask {
		ans[j] = base
		job := &scoreJob{s: &ans[j], done: make(chan struct{})}
		wc := st.wcs[j]
		job.then = func(job *scoreJob) {
			var err error
			if wc != nil {
				err = wc.add(*job.s)
			}
			mu.Lock()
			if err != nil && errs == nil {
				errs = err
			}
			pending--
			last := pending == 0
			mu.Unlock()
			if !last {
				return
			}
			if !it.skip {
				it.s, it.more = ans[0], st.on.moreOf(ans)
			}
			it.err = errs
			close(it.done)
		}
		st.pools[j].submit(job)
	}
	return nil
}

// writeCache is distill.write_cache: answers are gathered per chunk
// (chunks of ChunkSamples, as cachectl fill cuts them) and a chunk is
// committed, by the cache package's crash-safe writer, once all its
// samples are in; a chunk never completed (the run ended or died) leaves
// nothing. Reads go to a Reader of the chunks committed when the epoch
// began.
type writeCache struct {
	c   *cache.Cache
	dir string
	C   int64
	n   int64

	mu      sync.Mutex
	cond    *sync.Cond
	bufs    map[int64][]cache.Sample // chunk -> samples by offset (Tokens nil: not yet)
	have    map[int64]int64          // chunk -> samples in
	sent    map[int64]bool           // complete chunks handed to the committer
	pending int                      // of which not committed yet
	rd      *cache.Reader            // the chunks committed when the epoch began
	done    map[int64]bool
	err     error
	commits chan chunkBuf
	wg      sync.WaitGroup
	written int // chunks committed by this run
}

// openWriteCache opens (or creates) dir for manifest m and checks that
// its chunks are those of chunk_samples C.
func openWriteCache(dir string, m cache.Manifest, C int64) (*writeCache, error) {
	c, err := cache.Create(dir, m, nil)
	if err != nil {
		return nil, fmt.Errorf("distill.write_cache %s: %w", dir, err)
	}
	chunks, err := c.Chunks()
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("distill.write_cache %s: %w", dir, err)
	}
	for _, ch := range chunks {
		if ch.Start%C != 0 || ch.End != min(ch.Start+C, m.Samples) {
			c.Close()
			return nil, errkind.Errorf(ErrConfig, "distill.write_cache %s holds chunk [%d, %d), which is not a chunk of distill.chunk_samples %d: set chunk_samples to the chunking the cache was filled with, or use another directory",
				dir, ch.Start, ch.End, C)
		}
	}
	wc := &writeCache{c: c, dir: dir, C: C, n: m.Samples, bufs: map[int64][]cache.Sample{}, have: map[int64]int64{}, sent: map[int64]bool{},
		commits: make(chan chunkBuf, 64)}
	wc.cond = sync.NewCond(&wc.mu)
	wc.wg.Add(1)
	go wc.committer()
	return wc, nil
}

// epochStart waits until the chunks the previous epoch gathered are
// committed (its last window's answers may still be arriving: the
// teachers run ahead) and returns the chunks committed now, which the
// epoch reads instead of asking.
func (wc *writeCache) epochStart(ctx context.Context) (map[int64]bool, error) {
	stop := context.AfterFunc(ctx, func() { wc.mu.Lock(); wc.cond.Broadcast(); wc.mu.Unlock() })
	defer stop()
	wc.mu.Lock()
	defer wc.mu.Unlock()
	for (len(wc.bufs) > 0 || wc.pending > 0) && wc.err == nil && ctx.Err() == nil {
		wc.cond.Wait()
	}
	if wc.err != nil {
		return nil, wc.err
	}
	if err := ctx.Err(); err != nil {
		return nil, err
	}
	done := map[int64]bool{}
	chunks, err := wc.c.Chunks()
	if err != nil {
		return nil, err
	}
	for _, ch := range chunks {
		done[ch.Start/wc.C] = true
	}
	wc.rd, wc.done = nil, done
	if len(chunks) > 0 {
		if wc.rd, err = cache.OpenReader(wc.dir); err != nil {
			return nil, fmt.Errorf("distill.write_cache %s: %w", wc.dir, err)
		}
	}
	return done, nil
}

// get returns sample i from the cache if its chunk was committed when
// the epoch began.
func (wc *writeCache) get(i int64) (cache.Sample, bool, error) {
	wc.mu.Lock()
	rd, ok, err := wc.rd, wc.done[i/wc.C], wc.err
	wc.mu.Unlock()
	if err != nil || !ok {
		return cache.Sample{}, false, err
	}
	s, err := rd.Get(i)
	if err != nil {
		return s, false, fmt.Errorf("distill.write_cache %s: %w", wc.dir, err)
	}
	return s, true, nil
}

// has reports whether sample i's chunk was committed when the epoch
// began (get would return it).
func (wc *writeCache) has(i int64) bool {
	wc.mu.Lock()
	defer wc.mu.Unlock()
	return wc.done[i/wc.C]
}

// add gathers answered sample s; a complete chunk goes to the committer.
func (wc *writeCache) add(s cache.Sample) error {
	c := s.Index / wc.C
	wc.mu.Lock()
	if wc.err != nil || wc.done[c] || wc.sent[c] {
		wc.mu.Unlock()
		return wc.err
	}
	r := cache.Range{Start: c * wc.C, End: min((c+1)*wc.C, wc.n)}
	b := wc.bufs[c]
	if b == nil {
		b = make([]cache.Sample, r.End-r.Start)
		wc.bufs[c] = b
	}
	off := s.Index - r.Start
	if b[off].Tokens != nil {
		wc.mu.Unlock()
		return nil // already in
	}
	if s.Tokens == nil {
		s.Tokens = []int32{}
	}
	b[off] = s
	wc.have[c]++
	full := wc.have[c] == r.End-r.Start
	if full {
		delete(wc.bufs, c)
		delete(wc.have, c)
		wc.sent[c] = true
		wc.pending++
	}
	wc.mu.Unlock()
	if full {
		wc.commits <- chunkBuf{c, b}
	}
	return nil
}

// chunkBuf is a complete chunk on its way to the cache.
type chunkBuf struct {
	c int64
	b []cache.Sample
}

// committer commits complete chunks in the background.
func (wc *writeCache) committer() {
	defer wc.wg.Done()
	for cb := range wc.commits {
		err := wc.commit(cb.c, cb.b)
		wc.mu.Lock()
		if err != nil && wc.err == nil {
			wc.err = fmt.Errorf("distill.write_cache %s: chunk [%d, %d): %w", wc.dir, cb.c*wc.C, cb.c*wc.C+int64(len(cb.b)), err)
		}
		wc.pending--
		wc.cond.Broadcast()
		wc.mu.Unlock()
	}
}

func (wc *writeCache) commit(c int64, b []cache.Sample) error {
	w, err := wc.c.BeginChunk(c*wc.C, c*wc.C+int64(len(b)))
	if errors.Is(err, cache.ErrRangeDone) || errors.Is(err, cache.ErrRangeBusy) {
		return nil // done, or another writer (a cachectl fill) is committing it
	}
	if err != nil {
		return err
	}
	for _, s := range b {
		if err := w.Add(s); err != nil {
			w.Abort()
			return err
		}
	}
	if err := w.Commit(); err != nil {
		return err
	}
	wc.mu.Lock()
	wc.written++
	wc.mu.Unlock()
	return nil
}

// close commits the chunks complete so far and closes the cache; chunks
// still being gathered are dropped (never partly visible).
func (wc *writeCache) close() error {
	wc.mu.Lock()
	close(wc.commits)
	wc.mu.Unlock()
	wc.wg.Wait()
	err := wc.c.Close()
	if wc.err != nil {
		return wc.err
	}
	return err
}

// failed returns the write error, if any.
func (wc *writeCache) failed() error {
	wc.mu.Lock()
	defer wc.mu.Unlock()
	return wc.err
}

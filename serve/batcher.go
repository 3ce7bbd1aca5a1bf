package serve

import (
	"context"
	"fmt"
	"runtime/debug"
	"sync"
	"time"

	"go.uber.org/zap"

	"distill/compute"
	"distill/infer"
)

// forwardFunc runs one packed forward pass: samples (total n tokens) ->
// ids (n,k), log-probs (n,k). It is (*infer.Model).Forward in the daemon.
type forwardFunc func(samples [][]int32, k int, temperature float32) (ids []int32, logprobs []float32)

// drawFunc is forwardFunc with the draws of a sampled kind:
// (*infer.Model).ForwardDraws in the daemon.
type drawFunc func(samples [][]int32, k int, temperature float32, d infer.Draws) (ids []int32, logprobs []float32, res infer.DrawResult)

// startFunc starts one forward (with d's draws when d is not nil) and
// returns at once; wait returns its result, or raises its failure. The
// forwards started are served in the order they were started: a
// pipelined teacher's (infer.Model.StartForward and StartForwardDraws).
type startFunc func(samples [][]int32, k int, temperature float32, d *infer.Draws) (wait func() (ids []int32, logprobs []float32, res infer.DrawResult))

// job is one unit of queued work. A Score sample is a shared job: the
// batcher packs it with other shared jobs of the same temperature. A fill
// forward group is exclusive: it runs as one forward on its own, so the
// cache holds exactly what infer.Model.TopK gives for that chunk, whatever
// else the daemon serves (GEMM rounding depends on the batch shape).
type job struct {
	ctx       context.Context
	samples   [][]int32
	tokens    int
	k         int
	temp      float32
	exclusive bool
	// background marks work queued by submit (fills): it may hold at most
	// half of the queue, so Score requests keep room.
	background bool
	enq        time.Time
	done       chan jobResult // buffered 1
	// draws, when set, asks for the draws of a sampled kind: a fill
	// group's (exclusive) or a Score sample's, which is packed only with
	// Score samples asking for the same draws (sameTargets). U's sample
	// index s counts the job's own samples.
	draws *infer.Draws
	// prog, when set, hears that the queue moved while j waits in it
	// (its call asked for progress messages).
	prog *progress
}

// sameTargets reports whether shared jobs a and b can share a forward:
// the same temperature, and either both top-k (their k may differ: cutK)
// or both the same draws (N, head or not, and k, which under head+sampled
// decides what the draws come from).
func sameTargets(a, b *job) bool {
	if a.temp != b.temp || (a.draws == nil) != (b.draws == nil) {
		return false
	}
	return a.draws == nil || (a.draws.N == b.draws.N && a.draws.Head == b.draws.Head && a.k == b.k)
}

type jobResult struct {
	ids   []int32 // (tokens, k)
	lps   []float32
	draws infer.DrawResult
	err   error
}

// batcherStats is what the batcher reports per forward pass.
type batcherStats interface {
	forward(tokens, budget, jobs int, d time.Duration)
	queued(jobs, tokens int)
	waited(d time.Duration)
}

// batcher packs queued jobs into forward passes of at most budget tokens,
// one forward at a time (a forward uses every core or the whole device),
// or, for a teacher pipelined over several GPUs (start), up to maxFlight
// forwards in flight, one a stage, so that the first GPU takes the next
// batch while the others finish this one; their results are handed out
// batch by batch in the order the batches were taken. The queue is
// bounded in jobs and tokens: trySubmit (Score) fails with ErrOverloaded
// when full; submit (fill work) waits for room, and may hold at most half
// of the queue, so Score is still served during a fill.
type batcher struct {
	fwd       forwardFunc
	draw      drawFunc  // nil: no sampled kinds (test fakes)
	start     startFunc // nil: fwd and draw, one forward at a time
	maxFlight int       // forwards in flight at most with start (below 1: one)
	budget    int
	maxJobs   int
	maxTokens int
	stats     batcherStats
	log       *zap.Logger // nil: panics are not logged (the error still says)

	mu     sync.Mutex
	queue  []*job
	qTok   int
	bJobs  int // background jobs queued, and their tokens
	bTok   int
	room   chan struct{} // closed and replaced when room frees up
	work   chan struct{} // buffered 1: the worker has something to look at
	closed bool
	wg     sync.WaitGroup

	inflight int           // forwards started whose results are not all handed out (b.mu)
	last     chan struct{} // closed once the last batch started has handed out its results (the loop's)

	waiting func(*job) // tests: called when submit finds no room and waits
	full    func()     // tests: called when the loop finds work queued but maxFlight forwards in flight
	behind  func()     // tests: called when a forward is done before the one started before it has handed out its results
}

func newBatcher(fwd forwardFunc, budget, maxJobs, maxTokens int, st batcherStats) *batcher {
	return newPipelinedBatcher(fwd, nil, 1, budget, maxJobs, maxTokens, st, nil)
}

// newPipelinedBatcher is newBatcher with start and depth, the most
// forwards in flight (a pipelined teacher's; nil and 1 for one forward at
// a time), and the draws' forward.
func newPipelinedBatcher(fwd forwardFunc, start startFunc, depth, budget, maxJobs, maxTokens int, st batcherStats, draw drawFunc) *batcher {
	b := &batcher{fwd: fwd, draw: draw, start: start, maxFlight: max(1, depth), budget: budget, maxJobs: maxJobs, maxTokens: maxTokens, stats: st,
		room: make(chan struct{}), work: make(chan struct{}, 1)}
	b.wg.Add(1)
	go b.loop()
	return b
}

func newJob(ctx context.Context, samples [][]int32, k int, temp float32, exclusive bool) *job {
	n := 0
	for _, s := range samples {
		n += len(s)
	}
	return &job{ctx: ctx, samples: samples, tokens: n, k: k, temp: temp, exclusive: exclusive, enq: time.Now(), done: make(chan jobResult, 1)}
}

// fits reports whether j can be queued now; b.mu held.
func (b *batcher) fits(j *job) bool {
	if len(b.queue) == 0 {
		return true // a job larger than the bound alone must still run
	}
	return len(b.queue) < b.maxJobs && b.qTok+j.tokens <= b.maxTokens
}

// fitsBackground is fits for submit's work, which may hold at most half of
// the queue's jobs and tokens: without that share, a fill keeps the queue
// full (it takes every slot as it frees up) and every Score request is
// refused. One background job may always wait, however large.
func (b *batcher) fitsBackground(j *job) bool {
	if !b.fits(j) {
		return false
	}
	return b.bJobs == 0 || (b.bJobs < max(1, b.maxJobs/2) && b.bTok+j.tokens <= b.maxTokens/2)
}

func (b *batcher) enqueue(j *job) {
	b.queue = append(b.queue, j)
	b.qTok += j.tokens
	if j.background {
		b.bJobs++
		b.bTok += j.tokens
	}
	b.stats.queued(len(b.queue), b.qTok)
	select {
	case b.work <- struct{}{}:
	default:
	}
}

// trySubmit queues j or fails at once with ErrOverloaded (Score requests:
// the client sees RESOURCE_EXHAUSTED and backs off).
func (b *batcher) trySubmit(j *job) error {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.closed {
		return fmt.Errorf("%w: not accepting work", ErrShutdown)
	}
	if !b.fits(j) {
		return fmt.Errorf("%w: work queue full (%d samples, %d tokens queued; limits %d and %d): retry later", ErrOverloaded, len(b.queue), b.qTok, b.maxJobs, b.maxTokens)
	}
	b.enqueue(j)
	return nil
}

// submit queues j, waiting for room (fill work: it is paced by the queue
// instead of failing).
func (b *batcher) submit(j *job) error {
	j.background = true
	for {
		b.mu.Lock()
		if b.closed {
			b.mu.Unlock()
			return fmt.Errorf("%w: not accepting work", ErrShutdown)
		}
		if b.fitsBackground(j) {
			b.enqueue(j)
			b.mu.Unlock()
			return nil
		}
		room := b.room
		b.mu.Unlock()
		if b.waiting != nil {
			b.waiting(j)
		}
		select {
		case <-room:
			// The loop took a batch: the daemon works, and j waits its
			// turn to be queued.
			j.prog.poke()
		case <-j.ctx.Done():
			return j.ctx.Err()
		}
	}
}

// wait returns j's result or the context's error.
func (j *job) wait() jobResult {
	select {
	case r := <-j.done:
		return r
	case <-j.ctx.Done():
		return jobResult{err: j.ctx.Err()}
	}
}

// unqueued accounts for j leaving the queue; b.mu held.
func (b *batcher) unqueued(j *job) {
	b.qTok -= j.tokens
	if j.background {
		b.bJobs--
		b.bTok -= j.tokens
	}
}

// take removes the next batch from the queue; b.mu held. The head job
// decides: exclusive -> alone; shared -> every shared job of the same
// temperature and targets (sameTargets) that still fits the budget, in
// queue order.
func (b *batcher) take() []*job {
	var batch []*job
	keep := b.queue[:0]
	n := 0
	for i, j := range b.queue {
		switch {
		case j.ctx.Err() != nil:
			j.done <- jobResult{err: j.ctx.Err()}
			b.unqueued(j)
			continue
		case len(batch) == 0:
			batch, n = append(batch, j), j.tokens
		case batch[0].exclusive || j.exclusive || !sameTargets(j, batch[0]) || n+j.tokens > b.budget:
			keep = append(keep, j)
		default:
			batch, n = append(batch, j), n+j.tokens
		}
		if len(batch) > 0 && batch[0].exclusive {
			keep = append(keep, b.queue[i+1:]...)
			break
		}
	}
	clear(b.queue[len(keep):])
	b.queue = keep
	for _, j := range batch {
		b.unqueued(j)
	}
	b.stats.queued(len(b.queue), b.qTok)
	close(b.room)
	b.room = make(chan struct{})
	return batch
}

// loop takes batches off the queue and starts their forwards, while
// fewer than maxFlight are in flight; it returns once closed with nothing
// queued or in flight.
func (b *batcher) loop() {
	defer b.wg.Done()
	for {
		b.mu.Lock()
		for len(b.queue) == 0 || b.inflight >= b.maxFlight {
			if b.closed && len(b.queue) == 0 && b.inflight == 0 {
				b.mu.Unlock()
				return
			}
			if len(b.queue) > 0 && b.full != nil {
				b.full()
			}
			b.mu.Unlock()
			<-b.work
			b.mu.Lock()
		}
		batch := b.take()
		if len(batch) > 0 {
			b.inflight++
		}
		b.mu.Unlock()
		if len(batch) > 0 {
			b.run(batch)
		}
		b.signal() // another round may be due without a new signal
	}
}

// movedOn tells the jobs still queued that a forward pass completed:
// they are waiting, not hung (progress "queued"); b.mu held. Only a
// forward that returns says it, so a forward that hangs silences every
// job behind it too, as it holds them all.
func (b *batcher) movedOn() {
	for _, j := range b.queue {
		j.prog.poke()
	}
}

// signal tells the loop to look at the queue again.
func (b *batcher) signal() {
	select {
	case b.work <- struct{}{}:
	default:
	}
}

// run starts one forward over batch and hands each job its rows once it
// is done and the batch taken before has handed out its own: at once
// with one forward at a time, else on a goroutine of its own.
func (b *batcher) run(batch []*job) {
	k, n := 0, 0
	var samples [][]int32
	now := time.Now()
	for _, j := range batch {
		k = max(k, j.k)
		n += j.tokens
		samples = append(samples, j.samples...)
		b.stats.waited(now.Sub(j.enq))
	}
	var d *infer.Draws
	if batch[0].draws != nil {
		bd := batchDraws(batch)
		d = &bd
	}
	wait := b.begin(samples, k, batch[0].temp, d)
	prev, mine := b.last, make(chan struct{})
	b.last = mine
	finish := func() {
		ids, lps, dr, err := wait()
		if prev != nil { // results in the order the batches were taken
			select {
			case <-prev:
			default:
				if b.behind != nil {
					b.behind()
				}
				<-prev
			}
		}
		b.stats.forward(n, b.budget, len(batch), time.Since(now))
		hand(batch, k, d != nil, ids, lps, dr, err)
		close(mine)
		b.mu.Lock()
		b.inflight--
		b.movedOn()
		b.mu.Unlock()
		b.signal()
	}
	if b.maxFlight == 1 {
		finish()
		return
	}
	go finish()
}

// begin starts a forward (start), or runs it at once (fwd or draw), and
// returns its wait; a panic (a bug: inputs are validated; or a device out
// of memory) becomes the wait's error.
func (b *batcher) begin(samples [][]int32, k int, temp float32, d *infer.Draws) func() ([]int32, []float32, infer.DrawResult, error) {
	if b.start == nil {
		var ids []int32
		var lps []float32
		var dr infer.DrawResult
		var err error
		if d != nil {
			ids, lps, dr, err = b.forwardDraws(samples, k, temp, *d)
		} else {
			ids, lps, err = b.forward(samples, k, temp)
		}
		return func() ([]int32, []float32, infer.DrawResult, error) { return ids, lps, dr, err }
	}
	var wait func() ([]int32, []float32, infer.DrawResult)
	if err := b.guard(pipelinedPanic, func() { wait = b.start(samples, k, temp, d) }); err != nil {
		return func() ([]int32, []float32, infer.DrawResult, error) { return nil, nil, infer.DrawResult{}, err }
	}
	return func() (ids []int32, lps []float32, dr infer.DrawResult, err error) {
		err = b.guard(pipelinedPanic, func() { ids, lps, dr = wait() })
		return ids, lps, dr, err
	}
}

// pipelinedPanic is the log line of a pipelined forward's panic.
const pipelinedPanic = "pipelined forward pass panicked: its requests fail, the daemon goes on"

// guard runs f, turning its panic (a bug: inputs are validated; or a
// device out of memory) into an error so one bad batch does not take the
// daemon down, logged with msg and the stack. A panic in a
// kernel's worker goroutine arrives here too: the backend carries it to
// the goroutine that called the kernel (compute.WorkerPanic), with the
// worker's stack.
func (b *batcher) guard(msg string, f func()) (err error) {
	defer func() {
		if r := recover(); r != nil {
			stack := debug.Stack()
			if wp, ok := r.(*compute.WorkerPanic); ok {
				stack = wp.Stack
			}
			if b.log != nil {
				b.log.Error(msg, zap.Any("panic", r), zap.ByteString("stack", stack))
			}
			err = fmt.Errorf("serve: forward pass panicked: %v", r)
		}
	}()
	f()
	return nil
}

// hand gives each job of batch its rows of a forward's result (k per
// position; with draws: the draws too), or the forward's error.
func hand(batch []*job, k int, draws bool, ids []int32, lps []float32, dr infer.DrawResult, err error) {
	if draws {
		if err != nil {
			for _, j := range batch {
				j.done <- jobResult{err: err}
			}
			return
		}
		splitDraws(batch, k, ids, lps, dr)
		return
	}
	off := 0
	for _, j := range batch {
		if err != nil {
			j.done <- jobResult{err: err}
			continue
		}
		r := jobResult{ids: ids[off*k : (off+j.tokens)*k], lps: lps[off*k : (off+j.tokens)*k]}
		if j.k != k {
			// The top-k of a larger k is a prefix-extension of the smaller
			// one (same full-vocab log-probs, same order): cut each row.
			r = cutK(r, j.tokens, k, j.k)
		}
		off += j.tokens
		j.done <- r
	}
}

// batchDraws is the draws of a batch of jobs asking for the same ones
// (sameTargets): the forward's sample s is sample s-first[j] of job j,
// and draws with that job's uniforms.
func batchDraws(batch []*job) infer.Draws {
	d := *batch[0].draws
	if len(batch) == 1 {
		return d
	}
	var owner []*job
	var local []int
	for _, j := range batch {
		for s := range j.samples {
			owner, local = append(owner, j), append(local, s)
		}
	}
	d.U = func(s, t, dd int) float64 { return owner[s].draws.U(local[s], t, dd) }
	return d
}

// splitDraws hands each job of a draws batch its rows of the forward's
// top-k (k per position) and draws.
func splitDraws(batch []*job, k int, ids []int32, lps []float32, dr infer.DrawResult) {
	pos, doff := 0, 0
	for _, j := range batch {
		T := j.tokens
		r := jobResult{ids: ids[pos*k : (pos+T)*k], lps: lps[pos*k : (pos+T)*k]}
		r.draws.N = dr.N[pos : pos+T]
		nd := 0
		for _, v := range r.draws.N {
			nd += int(v)
		}
		r.draws.IDs, r.draws.Counts = dr.IDs[doff:doff+nd], dr.Counts[doff:doff+nd]
		if dr.Tail != nil {
			r.draws.Tail = dr.Tail[pos : pos+T]
		}
		pos, doff = pos+T, doff+nd
		j.done <- r
	}
}

// forward calls fwd under guard.
func (b *batcher) forward(samples [][]int32, k int, temp float32) (ids []int32, lps []float32, err error) {
	err = b.guard("forward pass panicked (a bug): its requests fail, the daemon goes on", func() { ids, lps = b.fwd(samples, k, temp) })
	return ids, lps, err
}

// forwardDraws is forward for a job with draws.
func (b *batcher) forwardDraws(samples [][]int32, k int, temp float32, d infer.Draws) (ids []int32, lps []float32, dr infer.DrawResult, err error) {
	if b.draw == nil {
		return nil, nil, dr, fmt.Errorf("serve: this teacher cannot draw sampled targets")
	}
	err = b.guard("forward pass with draws panicked (a bug): its fill or Score requests fail, the daemon goes on", func() { ids, lps, dr = b.draw(samples, k, temp, d) })
	return ids, lps, dr, err
}

// cutK keeps the first k2 of every row of k entries: (n,k) -> (n,k2).
func cutK(r jobResult, n, k, k2 int) jobResult {
	out := jobResult{ids: make([]int32, n*k2), lps: make([]float32, n*k2)}
	for t := 0; t < n; t++ {
		copy(out.ids[t*k2:(t+1)*k2], r.ids[t*k:t*k+k2])
		copy(out.lps[t*k2:(t+1)*k2], r.lps[t*k:t*k+k2])
	}
	return out
}

// close stops accepting work, fails what is queued with ErrShutdown and
// waits for the forwards in flight to hand out their results.
func (b *batcher) close() {
	b.mu.Lock()
	if !b.closed {
		b.closed = true
		for _, j := range b.queue {
			j.done <- jobResult{err: fmt.Errorf("%w: queued work dropped", ErrShutdown)}
		}
		b.queue, b.qTok, b.bJobs, b.bTok = nil, 0, 0, 0
		close(b.room)
		b.room = make(chan struct{})
	}
	b.mu.Unlock()
	select {
	case b.work <- struct{}{}:
	default:
	}
	b.wg.Wait()
}

// depth returns the queued jobs and tokens.
func (b *batcher) depth() (int, int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.queue), b.qTok
}

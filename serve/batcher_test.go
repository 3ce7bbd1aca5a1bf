package serve

import (
	"context"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"distill/infer"
)

type nopStats struct{}

func (nopStats) forward(int, int, int, time.Duration) {}
func (nopStats) queued(int, int)                      {}
func (nopStats) waited(time.Duration)                 {}

// fakeForward records each forward's samples and answers, for position t
// of the packed batch, ids (tok, tok+1, ...) and log-probs (-j - temp):
// every row is checkable from the input alone. A gated fake (gatedForward)
// is a blocking backend: each forward first reports its samples on entered,
// then waits for one value on gate, so a test knows which batch is in the
// forward and holds the queue still while it looks.
type fakeForward struct {
	mu      sync.Mutex
	batches [][][]int32
	entered chan [][]int32 // when set: each forward's samples, as it starts
	gate    chan struct{}  // when set: each forward waits for a value (or the close)
	open    sync.Once
}

// gatedForward is a blocking fake.
func gatedForward() *fakeForward {
	return &fakeForward{entered: make(chan [][]int32, 64), gate: make(chan struct{})}
}

// startBatcher starts a batcher over f; the test's cleanup opens f's gate
// for good, then closes the batcher, so no forward outlives the test even
// when it fails half-way.
func startBatcher(t *testing.T, f *fakeForward, budget, maxJobs, maxTokens int) *batcher {
	b := newBatcher(f.fwd, budget, maxJobs, maxTokens, nopStats{})
	t.Cleanup(func() {
		if f.gate != nil {
			f.openGate()
		}
		b.close()
	})
	return b
}

// openGate lets every forward through, now and later.
func (f *fakeForward) openGate() { f.open.Do(func() { close(f.gate) }) }

// inForward waits until a forward has started and returns its samples'
// first tokens.
func (f *fakeForward) inForward() []int32 {
	var firsts []int32
	for _, s := range <-f.entered {
		firsts = append(firsts, s[0])
	}
	return firsts
}

func (f *fakeForward) fwd(samples [][]int32, k int, temp float32) ([]int32, []float32) {
	if f.entered != nil {
		f.entered <- samples
	}
	if f.gate != nil {
		<-f.gate
	}
	f.mu.Lock()
	f.batches = append(f.batches, samples)
	f.mu.Unlock()
	var ids []int32
	var lps []float32
	for _, s := range samples {
		for _, tok := range s {
			for j := 0; j < k; j++ {
				ids = append(ids, tok+int32(j))
				lps = append(lps, -float32(j)-temp)
			}
		}
	}
	return ids, lps
}

// watchWaits makes b report on the returned channel every job that submit
// parks for lack of room.
func watchWaits(b *batcher) <-chan *job {
	waits := make(chan *job, 64)
	b.waiting = func(j *job) { waits <- j }
	return waits
}

// submitStep starts b.submit(j) on a goroutine and returns once submit has
// either queued j (queued true) or parked it for lack of room (false; its
// result comes on res later). Nothing else may be submitting meanwhile.
func submitStep(t *testing.T, b *batcher, waits <-chan *job, j *job) (queued bool, res <-chan error) {
	t.Helper()
	c := make(chan error, 1)
	go func() { c <- b.submit(j) }()
	select {
	case err := <-c:
		if err != nil {
			t.Fatalf("submit: %v", err)
		}
		return true, c
	case w := <-waits:
		if w != j {
			t.Fatalf("another job reported waiting")
		}
		return false, c
	}
}

func checkRows(t *testing.T, j *job, r jobResult) {
	t.Helper()
	if r.err != nil {
		t.Fatal(r.err)
	}
	p := 0
	for _, s := range j.samples {
		for _, tok := range s {
			for q := 0; q < j.k; q++ {
				if r.ids[p*j.k+q] != tok+int32(q) || r.lps[p*j.k+q] != -float32(q)-j.temp {
					t.Fatalf("row %d slot %d: got (%d, %v), want (%d, %v)", p, q, r.ids[p*j.k+q], r.lps[p*j.k+q], tok+int32(q), -float32(q)-j.temp)
				}
			}
			p++
		}
	}
}

func TestBatcherPacking(t *testing.T) {
	f := gatedForward()
	b := startBatcher(t, f, 10, 100, 1000)
	ctx := context.Background()
	// The first job blocks the worker in its forward while the rest queue.
	first := newJob(ctx, [][]int32{{1}}, 2, 1, false)
	if err := b.trySubmit(first); err != nil {
		t.Fatal(err)
	}
	f.inForward()
	jobs := []*job{
		newJob(ctx, [][]int32{{10, 11, 12}}, 3, 1, false),         // shared, T=1
		newJob(ctx, [][]int32{{20, 21}}, 1, 2, false),             // other temperature: own batch
		newJob(ctx, [][]int32{{30, 31, 32, 33}}, 2, 1, false),     // joins the first shared batch (k cut from 3)
		newJob(ctx, [][]int32{{40, 41}, {42}}, 2, 1, true),        // exclusive: alone
		newJob(ctx, [][]int32{{50, 51, 52, 53, 54}}, 2, 1, false), // would exceed 10 with 10..33: next batch
	}
	for _, j := range jobs {
		if err := b.trySubmit(j); err != nil {
			t.Fatal(err)
		}
	}
	f.openGate()
	checkRows(t, first, first.wait())
	for _, j := range jobs {
		checkRows(t, j, j.wait())
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	got := [][]int{}
	for _, bt := range f.batches {
		var firsts []int
		for _, s := range bt {
			firsts = append(firsts, int(s[0]))
		}
		got = append(got, firsts)
	}
	want := [][]int{{1}, {10, 30}, {20}, {40, 42}, {50}}
	if len(got) != len(want) {
		t.Fatalf("batches %v, want %v", got, want)
	}
	for i := range want {
		if len(got[i]) != len(want[i]) {
			t.Fatalf("batches %v, want %v", got, want)
		}
		for j := range want[i] {
			if got[i][j] != want[i][j] {
				t.Fatalf("batches %v, want %v", got, want)
			}
		}
	}
}

// TestBatcherBackpressureAndClose: with one job in its forward (a blocking
// fake backend), a queue of two takes two; trySubmit then fails with
// ErrOverloaded at once, submit parks until room frees or its context ends.
// close fails what is queued with ErrShutdown, lets the forward in progress
// finish, and refuses later work.
func TestBatcherBackpressureAndClose(t *testing.T) {
	f := gatedForward()
	b := startBatcher(t, f, 8, 2, 100)
	waits := watchWaits(b)
	ctx := context.Background()
	running := newJob(ctx, [][]int32{{1}}, 1, 1, false)
	if err := b.trySubmit(running); err != nil {
		t.Fatal(err)
	}
	if got := f.inForward(); got[0] != 1 {
		t.Fatalf("in the forward: %v, want [1]", got)
	}
	q1, q2 := newJob(ctx, [][]int32{{2}}, 1, 1, true), newJob(ctx, [][]int32{{3}}, 1, 1, true)
	if b.trySubmit(q1) != nil || b.trySubmit(q2) != nil {
		t.Fatal("queue of 2 should take 2")
	}
	if err := b.trySubmit(newJob(ctx, [][]int32{{4}}, 1, 1, false)); !errors.Is(err, ErrOverloaded) {
		t.Fatalf("full queue: %v", err)
	}
	// submit waits for room instead, and gives up with its context.
	cctx, cancel := context.WithCancel(ctx)
	if queued, res := submitStep(t, b, waits, newJob(cctx, [][]int32{{5}}, 1, 1, true)); queued {
		t.Fatal("submit queued a job on a full queue")
	} else {
		cancel()
		if err := <-res; !errors.Is(err, context.Canceled) {
			t.Fatalf("submit on a full queue, context cancelled: %v", err)
		}
	}
	w := newJob(ctx, [][]int32{{6}}, 1, 1, true)
	queued, waiter := submitStep(t, b, waits, w)
	if queued {
		t.Fatal("submit queued a job on a full queue")
	}
	f.gate <- struct{}{} // finish "running": q1 starts, room for w
	if got := f.inForward(); got[0] != 2 {
		t.Fatalf("in the forward: %v, want [2] (q1)", got)
	}
	if err := <-waiter; err != nil {
		t.Fatal(err)
	}
	checkRows(t, running, running.wait())
	// close: q1 is in its forward and finishes; q2 and w fail with
	// ErrShutdown. q1's forward is let go only once close has dropped the
	// queue (q2's result says so): otherwise the worker could start q2.
	done := make(chan struct{})
	go func() { b.close(); close(done) }()
	for _, j := range []*job{q2, w} {
		if r := j.wait(); !errors.Is(r.err, ErrShutdown) {
			t.Fatalf("queued at close: %v", r.err)
		}
	}
	f.gate <- struct{}{}
	<-done
	checkRows(t, q1, q1.wait())
	if err := b.trySubmit(newJob(ctx, [][]int32{{7}}, 1, 1, false)); !errors.Is(err, ErrShutdown) {
		t.Fatalf("after close: %v", err)
	}
	if err := b.submit(newJob(ctx, [][]int32{{8}}, 1, 1, true)); !errors.Is(err, ErrShutdown) {
		t.Fatalf("submit after close: %v", err)
	}
}

// TestBatcherFillLeavesRoomForScore: fill work (submit) that keeps the
// queue busy holds at most half of it, so Score requests (trySubmit) still
// get in; before, the fill took every slot as it freed up and every Score
// request was refused. A blocking fake backend holds the queue still, and
// the batcher's waiting hook says when a submit is parked, so every step
// is known: nothing here waits on time.
func TestBatcherFillLeavesRoomForScore(t *testing.T) {
	f := gatedForward()
	b := startBatcher(t, f, 64, 4, 1000)
	waits := watchWaits(b)
	ctx := context.Background()
	fill := func(i int) *job { return newJob(ctx, [][]int32{{int32(10 + i)}}, 1, 1, true) }
	if queued, _ := submitStep(t, b, waits, fill(0)); !queued {
		t.Fatal("the first fill job waits on an empty queue")
	}
	f.inForward() // fill job 0 computes; the queue is empty and stays put
	// Fill jobs 1 and 2 take their half of the 4-job queue; 3 and 4 wait.
	var parked []<-chan error
	for i := 1; i <= 4; i++ {
		queued, res := submitStep(t, b, waits, fill(i))
		if queued != (i <= 2) {
			n, _ := b.depth()
			t.Fatalf("fill job %d: queued %v with %d jobs queued; want fill work to hold at most 2 of the 4 slots", i, queued, n)
		}
		if !queued {
			parked = append(parked, res)
		}
	}
	for i := 0; i < 2; i++ {
		if err := b.trySubmit(newJob(ctx, [][]int32{{int32(100 + i)}}, 1, 1, false)); err != nil {
			t.Fatalf("Score request %d during a fill: %v", i, err)
		}
	}
	if err := b.trySubmit(newJob(ctx, [][]int32{{200}}, 1, 1, false)); !errors.Is(err, ErrOverloaded) {
		t.Fatalf("a full queue still refuses Score: %v", err)
	}
	// A slot frees (fill job 1 starts): of the two parked fill jobs exactly
	// one takes it, bringing the fill back to its half; the other waits on.
	f.gate <- struct{}{}
	if got := f.inForward(); got[0] != 11 {
		t.Fatalf("in the forward: %v, want [11] (fill job 1)", got)
	}
	queued, waiting := 0, 0
	for queued+waiting < 2 {
		select {
		case err := <-parked[0]:
			if err != nil {
				t.Fatal(err)
			}
			queued, parked[0] = queued+1, nil
		case err := <-parked[1]:
			if err != nil {
				t.Fatal(err)
			}
			queued, parked[1] = queued+1, nil
		case <-waits:
			waiting++
		}
	}
	b.mu.Lock()
	n, bj := len(b.queue), b.bJobs
	b.mu.Unlock()
	if queued != 1 || waiting != 1 || n != 4 || bj != 2 {
		t.Fatalf("after a slot freed: %d parked fill jobs queued, %d wait again, %d jobs queued of which %d fill; want 1, 1, 4, 2", queued, waiting, n, bj)
	}
}

// fakeDraw is fakeForward's forward with draws: at each position it
// "draws" one id, U(s, t, 0)·1e6 (the job's uniforms name the job, its
// sample and the position), N times, and a tail mass of t under head.
func (f *fakeForward) fakeDraw(samples [][]int32, k int, temp float32, d infer.Draws) ([]int32, []float32, infer.DrawResult) {
	ids, lps := f.fwd(samples, k, temp)
	var r infer.DrawResult
	for s, smp := range samples {
		for t := range smp {
			r.N = append(r.N, 1)
			r.IDs = append(r.IDs, int32(math.Round(d.U(s, t, 0)*1e6)))
			r.Counts = append(r.Counts, int32(d.N))
			if d.Head {
				r.Tail = append(r.Tail, float32(t))
			}
		}
	}
	return ids, lps, r
}

// drawJob is a Score job of a sampled kind whose uniforms name it: the
// draw at position t of its sample is key·1000 + t (fakeDraw).
func drawJob(ctx context.Context, key int, tokens []int32, k, n int, head bool) *job {
	j := newJob(ctx, [][]int32{tokens}, k, 1, false)
	j.draws = &infer.Draws{N: n, Head: head, U: func(s, t, d int) float64 { return float64(key*1000+t) / 1e6 }}
	return j
}

// TestBatcherPacksDraws: Score jobs with draws share a forward only with
// jobs asking for the same draws (N, head, k) at the same temperature,
// never with top-k jobs; each gets its own rows of the top-k and draws,
// drawn with its own uniforms.
func TestBatcherPacksDraws(t *testing.T) {
	f := gatedForward()
	b := startBatcher(t, f, 20, 100, 1000)
	b.draw = f.fakeDraw
	ctx := context.Background()
	first := newJob(ctx, [][]int32{{1}}, 2, 1, false)
	if err := b.trySubmit(first); err != nil {
		t.Fatal(err)
	}
	f.inForward()
	jobs := []*job{
		drawJob(ctx, 1, []int32{10, 11, 12}, 2, 4, true),
		newJob(ctx, [][]int32{{20, 21}}, 2, 1, false),        // top-k: not with the draws
		drawJob(ctx, 3, []int32{30, 31}, 2, 4, true),         // joins 10
		drawJob(ctx, 4, []int32{40}, 2, 5, true),             // other N: own batch
		drawJob(ctx, 5, []int32{50, 51}, 3, 4, true),         // other head k: own batch
		drawJob(ctx, 6, []int32{60, 61, 62, 63}, 2, 4, true), // joins 10 and 30
		drawJob(ctx, 7, []int32{70}, 0, 4, false),            // sampled: own batch
	}
	for _, j := range jobs {
		if err := b.trySubmit(j); err != nil {
			t.Fatal(err)
		}
	}
	f.openGate()
	checkRows(t, first, first.wait())
	for _, j := range jobs {
		r := j.wait()
		checkRows(t, j, r)
		if j.draws == nil {
			continue
		}
		T := j.tokens
		if len(r.draws.N) != T || len(r.draws.IDs) != T || len(r.draws.Counts) != T || (j.draws.Head && len(r.draws.Tail) != T) || (!j.draws.Head && r.draws.Tail != nil) {
			t.Fatalf("job %d: draws %+v for %d positions", j.samples[0][0], r.draws, T)
		}
		key := int32(j.samples[0][0]) / 10
		for p := 0; p < T; p++ {
			if r.draws.N[p] != 1 || r.draws.IDs[p] != key*1000+int32(p) || r.draws.Counts[p] != int32(j.draws.N) || (j.draws.Head && r.draws.Tail[p] != float32(p)) {
				t.Fatalf("job %d position %d: draws %+v", key, p, r.draws)
			}
		}
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	var got [][]int
	for _, bt := range f.batches {
		var firsts []int
		for _, s := range bt {
			firsts = append(firsts, int(s[0]))
		}
		got = append(got, firsts)
	}
	want := [][]int{{1}, {10, 30, 60}, {20}, {40}, {50}, {70}}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("batches %v, want %v", got, want)
	}
}

// pipeFake is a pipelined teacher's start (startFunc) for the batcher:
// each start reports its samples on started, and its wait blocks until
// the test releases that forward (release[i], i counting the starts),
// then answers as fakeForward does (or panics, for the forwards in fail).
type pipeFake struct {
	mu       sync.Mutex
	n        int
	started  chan [][]int32
	release  []chan struct{}
	returned chan int // each forward's index as its wait returns
	fail     map[int]bool
}

func newPipeFake(n int) *pipeFake {
	p := &pipeFake{started: make(chan [][]int32, n), returned: make(chan int, n), fail: map[int]bool{}}
	for i := 0; i < n; i++ {
		p.release = append(p.release, make(chan struct{}))
	}
	return p
}

func (p *pipeFake) start(samples [][]int32, k int, temp float32, d *infer.Draws) func() ([]int32, []float32, infer.DrawResult) {
	p.mu.Lock()
	i := p.n
	p.n++
	p.mu.Unlock()
	p.started <- samples
	return func() ([]int32, []float32, infer.DrawResult) {
		<-p.release[i]
		defer func() { p.returned <- i }()
		if p.fail[i] {
			panic(fmt.Errorf("forward %d: out of memory on the test's GPU", i))
		}
		ids, lps := (&fakeForward{}).fwd(samples, k, temp)
		return ids, lps, infer.DrawResult{}
	}
}

func (p *pipeFake) starts() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.n
}

// orderStats records the tokens of each forward as its results are
// handed out, and calls check first.
type orderStats struct {
	nopStats
	mu     sync.Mutex
	tokens []int
	check  func(tokens int)
}

func (s *orderStats) forward(tokens, _, _ int, _ time.Duration) {
	s.check(tokens)
	s.mu.Lock()
	s.tokens = append(s.tokens, tokens)
	s.mu.Unlock()
}

// TestBatcherPipelined: with a pipelined teacher (start, two forwards in
// flight) the batcher starts the second batch while the first is still
// in flight, starts no third until one is done (the loop reports work
// queued with two in flight, and only two have started), and hands out
// the results batch by batch in the order it took them, even when the
// second forward finishes first. A forward that fails fails its jobs
// only; close waits for the forwards in flight.
func TestBatcherPipelined(t *testing.T) {
	p := newPipeFake(7)
	var jobs []*job
	var mu sync.Mutex
	st := &orderStats{check: func(int) {}}
	b := newPipelinedBatcher(nil, p.start, 2, 100, 16, 1000, st, nil)
	full := make(chan struct{}, 16)
	b.mu.Lock()
	b.full = func() { full <- struct{}{} }
	behind := make(chan struct{}, 16)
	b.behind = func() { behind <- struct{}{} }
	b.mu.Unlock()
	defer func() {
		for i := range p.release {
			select {
			case <-p.release[i]:
			default:
				close(p.release[i])
			}
		}
		b.close()
	}()
	submit := func(toks ...int32) *job {
		j := newJob(context.Background(), [][]int32{toks}, 2, 1, true)
		mu.Lock()
		jobs = append(jobs, j)
		mu.Unlock()
		if err := b.trySubmit(j); err != nil {
			t.Fatal(err)
		}
		return j
	}
	j1 := submit(10)
	<-p.started
	j2 := submit(20, 21)
	<-p.started // two in flight, the first not done
	j3 := submit(30, 31, 32)
	select {
	case <-full:
	case <-p.started:
		t.Fatal("a third forward started with two in flight")
	}
	if n := p.starts(); n != 2 {
		t.Fatalf("%d forwards started with two in flight, want 2", n)
	}
	close(p.release[1]) // the second finishes first
	select {
	case <-behind: // and waits for the first to hand out its results
	case <-time.After(time.Minute):
		t.Fatal("the second forward, done first, did not wait for the first's results")
	}
	close(p.release[0])
	<-p.returned
	<-p.returned
	if s := <-p.started; s[0][0] != 30 {
		t.Fatalf("third start: %v", s)
	}
	close(p.release[2])
	for _, j := range []*job{j1, j2, j3} {
		checkRows(t, j, j.wait())
	}
	p.fail[3] = true
	j4, j5 := submit(40), submit(50, 51, 52, 53)
	<-p.started
	<-p.started
	close(p.release[3])
	close(p.release[4])
	if r := j4.wait(); r.err == nil || !strings.Contains(r.err.Error(), "out of memory on the test's GPU") {
		t.Errorf("the failing forward's job: %v", r.err)
	}
	checkRows(t, j5, j5.wait())
	// close (a daemon's drain) with two forwards in flight: it returns
	// once both have handed out their results.
	j6, j7 := submit(60), submit(70, 71)
	<-p.started
	<-p.started
	closed := make(chan struct{})
	go func() {
		b.close()
		close(closed)
	}()
	close(p.release[5])
	close(p.release[6])
	<-closed
	for _, j := range []*job{j6, j7} {
		if len(j.done) != 1 {
			t.Fatalf("close returned before the forward in flight of job %v handed out its result", j.samples)
		}
		checkRows(t, j, j.wait())
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	if !slices.Equal(st.tokens, []int{1, 2, 3, 1, 4, 1, 2}) {
		t.Errorf("results handed out for forwards of %v tokens, want [1 2 3 1 4 1 2] (the order taken)", st.tokens)
	}
}

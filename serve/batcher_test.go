package serve

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
)

type nopStats struct{}

func (nopStats) forward(int, int, int, time.Duration) {}
func (nopStats) queued(int, int)                      {}
func (nopStats) waited(time.Duration)                 {}

// fakeForward records each forward's samples and answers, for position t
// of the packed batch, ids (tok, tok+1, ...) and log-probs (-j - temp):
// every row is checkable from the input alone.
type fakeForward struct {
	mu      sync.Mutex
	batches [][][]int32
	gate    chan struct{} // when set, each forward waits for a value
}

func (f *fakeForward) fwd(samples [][]int32, k int, temp float32) ([]int32, []float32) {
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
	f := &fakeForward{gate: make(chan struct{})}
	b := newBatcher(f.fwd, 10, 100, 1000, nopStats{})
	defer b.close()
	ctx := context.Background()
	// The first job blocks the worker in its forward while the rest queue.
	first := newJob(ctx, [][]int32{{1}}, 2, 1, false)
	b.trySubmit(first)
	for !queueEmpty(b) {
		time.Sleep(time.Millisecond)
	}
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
	go func() {
		for i := 0; i < 10; i++ {
			f.gate <- struct{}{}
		}
	}()
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

func queueEmpty(b *batcher) bool { n, _ := b.depth(); return n == 0 }

func TestBatcherBackpressureAndClose(t *testing.T) {
	f := &fakeForward{gate: make(chan struct{})}
	b := newBatcher(f.fwd, 8, 2, 100, nopStats{})
	ctx := context.Background()
	running := newJob(ctx, [][]int32{{1}}, 1, 1, false)
	b.trySubmit(running)
	for !queueEmpty(b) {
		time.Sleep(time.Millisecond)
	}
	q1, q2 := newJob(ctx, [][]int32{{2}}, 1, 1, true), newJob(ctx, [][]int32{{3}}, 1, 1, true)
	if b.trySubmit(q1) != nil || b.trySubmit(q2) != nil {
		t.Fatal("queue of 2 should take 2")
	}
	if err := b.trySubmit(newJob(ctx, [][]int32{{4}}, 1, 1, false)); !errors.Is(err, ErrOverloaded) {
		t.Fatalf("full queue: %v", err)
	}
	// submit waits for room instead, and gives up with its context.
	cctx, cancel := context.WithTimeout(ctx, 50*time.Millisecond)
	defer cancel()
	if err := b.submit(newJob(cctx, [][]int32{{5}}, 1, 1, true)); !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("submit on a full queue: %v", err)
	}
	waiter := make(chan error, 1)
	w := newJob(ctx, [][]int32{{6}}, 1, 1, true)
	go func() { waiter <- b.submit(w) }()
	f.gate <- struct{}{} // finish "running": q1 starts, room for w
	if err := <-waiter; err != nil {
		t.Fatal(err)
	}
	checkRows(t, running, running.wait())
	// close: q1 is in its forward and finishes; q2 and w fail with ErrShutdown.
	done := make(chan struct{})
	go func() { b.close(); close(done) }()
	time.Sleep(20 * time.Millisecond)
	f.gate <- struct{}{}
	<-done
	checkRows(t, q1, q1.wait())
	for _, j := range []*job{q2, w} {
		if r := j.wait(); !errors.Is(r.err, ErrShutdown) {
			t.Fatalf("queued at close: %v", r.err)
		}
	}
	if err := b.trySubmit(newJob(ctx, [][]int32{{7}}, 1, 1, false)); !errors.Is(err, ErrShutdown) {
		t.Fatalf("after close: %v", err)
	}
}

// TestBatcherFillLeavesRoomForScore: fill work (submit) that keeps the
// queue busy holds at most half of it, so Score requests (trySubmit) still
// get in; before, the fill took every slot as it freed up and every Score
// request was refused.
func TestBatcherFillLeavesRoomForScore(t *testing.T) {
	f := &fakeForward{gate: make(chan struct{})}
	b := newBatcher(f.fwd, 64, 4, 1000, nopStats{})
	defer func() {
		go func() {
			for range 100 {
				select {
				case f.gate <- struct{}{}:
				case <-time.After(time.Second):
					return
				}
			}
		}()
		b.close()
	}()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// Six fill jobs from six goroutines: one runs (blocked in the forward),
	// at most two may wait in the queue, the rest wait in submit.
	for i := range 6 {
		go b.submit(newJob(ctx, [][]int32{{int32(10 + i)}}, 1, 1, true))
	}
	deadline := time.Now().Add(2 * time.Second)
	for {
		b.mu.Lock()
		bj := b.bJobs
		b.mu.Unlock()
		if bj == 2 || time.Now().After(deadline) {
			break
		}
		time.Sleep(time.Millisecond)
	}
	time.Sleep(20 * time.Millisecond) // give the other submits a chance to (wrongly) get in
	if n, _ := b.depth(); n != 2 {
		t.Fatalf("fill jobs queued: %d, want 2 (half of the 4-job queue)", n)
	}
	for i := 0; i < 2; i++ {
		if err := b.trySubmit(newJob(ctx, [][]int32{{int32(100 + i)}}, 1, 1, false)); err != nil {
			t.Fatalf("Score request %d during a fill: %v", i, err)
		}
	}
	if err := b.trySubmit(newJob(ctx, [][]int32{{200}}, 1, 1, false)); !errors.Is(err, ErrOverloaded) {
		t.Fatalf("a full queue still refuses Score: %v", err)
	}
}

package serve

import (
	"context"
	"errors"
	"io"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	pb "distill/proto/distill/v1"
)

// gate holds every forward pass of a core's batcher until the test lets
// it go: a forward that hangs (never let go), or one the test steps.
type gate struct {
	entered chan int      // n: the n-th forward pass waits at the gate
	step    chan struct{} // lets one waiting forward go on
	open    chan struct{} // closed: every forward goes on
	queued  chan int      // the queue lengths the batcher reports
	opened  atomic.Bool
}

// gateForwards puts a gate before c's forward passes; the gate opens
// when the test ends (before the daemon shuts down, which waits for the
// forward in flight).
func gateForwards(t *testing.T, c *Core) *gate {
	g := &gate{entered: make(chan int, 1000), step: make(chan struct{}), open: make(chan struct{}), queued: make(chan int, 1000)}
	b := c.b
	b.mu.Lock()
	real := b.fwd
	n := 0
	b.fwd = func(s [][]int32, k int, temp float32) ([]int32, []float32) {
		n++ // the batcher's one loop calls fwd
		g.entered <- n
		select {
		case <-g.step:
		case <-g.open:
		}
		return real(s, k, temp)
	}
	b.stats = gateStats{b.stats, g.queued}
	b.mu.Unlock()
	t.Cleanup(g.release)
	return g
}

// release lets every forward go on, now and from now on.
func (g *gate) release() {
	if g.opened.CompareAndSwap(false, true) {
		close(g.open)
	}
}

// gateStats reports the queue lengths to the test.
type gateStats struct {
	batcherStats
	q chan int
}

func (s gateStats) queued(jobs, tokens int) {
	s.batcherStats.queued(jobs, tokens)
	select {
	case s.q <- jobs:
	default:
	}
}

// drainQueued forgets the queue lengths reported so far.
func (g *gate) drainQueued() {
	for {
		select {
		case <-g.queued:
		default:
			return
		}
	}
}

// waitQueued waits until the batcher reports n jobs queued.
func (g *gate) waitQueued(n int) {
	for q := range g.queued {
		if q == n {
			return
		}
	}
}

// scoreTwo sends sample A, waits until its forward holds at the gate,
// sends B and waits until B is queued behind it, then lets A's forward
// go on: B waits in the queue while the daemon completes a forward.
// It returns the messages up to A's result and lets B's forward go on
// once asked (next).
func scoreTwo(t *testing.T, asked bool) (msgs []*pb.ScoreResponse) {
	mdir := tinyModel(t)
	d := startDaemon(t, Config{Model: mdir})
	d.Core().progEvery.Store(0) // every piece of news becomes a message
	g := gateForwards(t, d.Core())
	cl, conn := dialTeacher(t, d.Addr(), "")
	defer conn.Close()
	st, err := cl.Score(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	A, B := []int32{1, 2, 3, 4, 5}, []int32{6, 7, 8}
	if err := st.Send(&pb.ScoreRequest{Id: 0, Tokens: A, K: proto.Int32(3), Progress: asked}); err != nil {
		t.Fatal(err)
	}
	<-g.entered
	g.drainQueued() // A's own, reported before its forward began
	if err := st.Send(&pb.ScoreRequest{Id: 1, Tokens: B, K: proto.Int32(3), Progress: asked}); err != nil {
		t.Fatal(err)
	}
	g.waitQueued(1)
	g.step <- struct{}{} // A's forward returns; B's is the next, held
	results, progress := 0, 0
	for results < 2 {
		m, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		msgs = append(msgs, m)
		if m.GetProgress() != nil {
			progress++
			continue
		}
		results++
		if results == 1 && asked && progress == 0 {
			// A's result can come before the news that B waits: read on
			// until it, then let B's forward go.
			for {
				m, err := st.Recv()
				if err != nil {
					t.Fatal(err)
				}
				msgs = append(msgs, m)
				if m.GetProgress() != nil {
					break
				}
				t.Fatalf("a result (id %d) before B's forward was let go", m.GetId())
			}
		}
		if results == 1 {
			g.step <- struct{}{}
		}
	}
	st.CloseSend()
	if _, err := st.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("end of stream: %v", err)
	}
	return msgs
}

// TestScoreProgressWhileQueued: a sample that waits in the queue while
// the daemon completes a forward of other work gets a "queued" progress
// message, when its stream asked for progress; the results still come
// in order, one per sample.
func TestScoreProgressWhileQueued(t *testing.T) {
	msgs := scoreTwo(t, true)
	var ids []int64
	queued := 0
	for _, m := range msgs {
		if p := m.GetProgress(); p != nil {
			if p.GetState() != "queued" || m.GetId() != 0 || len(m.GetIds()) != 0 {
				t.Errorf("progress message %v: want state queued and no other field", m)
			}
			queued++
			continue
		}
		ids = append(ids, m.GetId())
	}
	if queued == 0 {
		t.Errorf("no progress message while B waited for A's forward: %v", msgs)
	}
	if len(ids) != 2 || ids[0] != 0 || ids[1] != 1 {
		t.Errorf("result ids %v, want [0 1]", ids)
	}
}

// TestScoreNoProgressUnasked: a client that does not ask for progress (a
// client older than progress messages) gets results only, however long
// its samples wait: it would read a progress message as a result.
func TestScoreNoProgressUnasked(t *testing.T) {
	msgs := scoreTwo(t, false)
	if len(msgs) != 2 {
		t.Fatalf("%d messages, want the 2 results: %v", len(msgs), msgs)
	}
	for i, m := range msgs {
		if m.GetProgress() != nil || m.GetId() != int64(i) || m.GetK() != 3 || len(m.GetIds()) == 0 {
			t.Errorf("message %d: %v, want result %d", i, m, i)
		}
	}
}

// TestFillProgressPerForward: a Fill that asked for progress gets a
// "computing" message after each forward group of its chunk returns,
// counting them, and then the chunk; one that did not gets the chunk
// only.
func TestFillProgressPerForward(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path, _ := writeIDsDataset(t, tmp, 8, 24, 512, 11)
	for _, asked := range []bool{true, false} {
		core, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: t.TempDir(), TokenBudget: 30, ProgressEvery: time.Nanosecond})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { core.Close() }) // after the gate opens (cleanups run last first)
		core.progEvery.Store(0)
		g := gateForwards(t, core)
		msgs := make(chan *pb.FillResponse, 100)
		done := make(chan error, 1)
		go func() {
			done <- core.Fill(context.Background(), &pb.FillRequest{Dataset: &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true},
				Start: 0, End: 8, ChunkSamples: 8, K: proto.Int32(4), Progress: asked}, func(m *pb.FillResponse) error { msgs <- m; return nil })
		}()
		// 8 samples of 4..24 tokens in forwards of at most 30: several.
		var got []*pb.FillResponse
		forwards := 0
	steps:
		for {
			select {
			case n := <-g.entered:
				forwards = n
				if asked && n > 1 {
					// The previous forward returned, this one holds: its
					// news must come now, counting n-1 done.
					// (The queue's news, "queued", may come too.)
					for {
						m := <-msgs
						got = append(got, m)
						p := m.GetProgress()
						if p == nil || m.GetStart() != 0 || m.GetEnd() != 0 || m.GetCacheDir() != "" || p.GetForwardsDone() > int32(n-1) {
							t.Fatalf("while forward %d holds: %v, want progress with at most %d done and no other field", n, m, n-1)
						}
						if p.GetForwardsDone() == int32(n-1) {
							if p.GetState() != "computing" {
								t.Errorf("forward %d returned: state %q, want computing", n-1, p.GetState())
							}
							break
						}
					}
				}
				g.step <- struct{}{}
			case err := <-done:
				if err != nil {
					t.Fatal(err)
				}
				break steps
			}
		}
		close(msgs)
		for m := range msgs {
			got = append(got, m)
		}
		if forwards < 3 {
			t.Fatalf("%d forwards: the test wants a chunk of several", forwards)
		}
		var chunks, progress int
		for _, m := range got {
			if m.GetProgress() != nil {
				progress++
			} else if m.GetEnd() == 8 {
				chunks++
			}
		}
		if chunks != 1 {
			t.Errorf("asked %v: %d chunk reports, want 1: %v", asked, chunks, got)
		}
		if asked && progress < forwards-1 || !asked && progress != 0 {
			t.Errorf("asked %v: %d progress messages over %d forwards", asked, progress, forwards)
		}
	}
}

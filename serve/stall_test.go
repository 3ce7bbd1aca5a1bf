package serve

import (
	"context"
	"errors"
	"io"
	"strings"
	"testing"
	"time"

	"google.golang.org/protobuf/proto"

	"distill/internal/stall"
	pb "distill/proto/distill/v1"
)

// stallPlan is a fill of path in chunks of 8 with a stall watchdog.
func stallPlan(path string, timeout time.Duration, out io.Writer) FillPlan {
	return FillPlan{Dataset: &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}, ChunkSamples: 8, K: 4, Encoding: "lossless",
		PerWorker: 1, StallTimeout: timeout, LogEvery: time.Hour, Out: out}
}

// TestFillStalledDaemon: a daemon whose forward pass hangs while gRPC
// still answers (keepalive cannot see it) stalls its chunk: with a
// second daemon the chunk goes there and the fill completes, saying
// which daemon stalled on which chunk; alone, the fill fails saying it
// stalled and what to do. Once the hung forward returns, the daemon
// shuts down cleanly: nothing of the stalled call is left running. The
// hung daemon's watchdog runs on the test's clock, moved past the
// timeout once its forward holds: what went before (opening the
// dataset, tokenizing), however slow the machine, is no stall.
func TestFillStalledDaemon(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path, samples := writeIDsDataset(t, tmp, 32, 24, 512, 12)
	const budget = 200
	const T = time.Minute

	// hang starts a fill whose worker a hangs in its first forward and
	// moves a's clock past the timeout once it does.
	hang := func(t *testing.T, g *gate, a Worker, workers []Worker, plan FillPlan, then func()) fillResult {
		clk := stall.NewManualClock()
		plan.stallClock = func(w Worker) stall.Clock {
			if w == a {
				return clk
			}
			return nil
		}
		done := startFill(workers, plan)
		select {
		case <-g.entered: // a holds a chunk, in a forward that never returns
		case r := <-done:
			t.Fatalf("the fill ended (%v) before the daemon held in its forward", r.err)
		}
		then()
		clk.Waiting(1)
		clk.Advance(T)
		return <-done
	}

	t.Run("two daemons", func(t *testing.T) {
		a := startDaemon(t, Config{Model: mdir, Cache: t.TempDir(), TokenBudget: budget, DataRoots: []string{tmp}})
		dB := t.TempDir()
		b := startDaemon(t, Config{Model: mdir, Cache: dB, TokenBudget: budget, DataRoots: []string{tmp}})
		ga, gb := gateForwards(t, a.Core()), gateForwards(t, b.Core())
		wa, _ := Dial(a.Addr(), DialOptions{})
		wb, _ := Dial(b.Addr(), DialOptions{})
		defer wa.Close()
		defer wb.Close()
		out := &syncBuf{}
		plan := stallPlan(path, T, out)
		plan.RetryFor = time.Minute
		r := hang(t, ga, wa, []Worker{wa, wb}, plan, gb.release) // B computes, on the real clock
		if r.err != nil {
			t.Fatalf("fill with a stalled daemon and a healthy one: %v\n%s", r.err, out)
		}
		want := "fill: teacher " + a.Addr() + " stalled: no result and no progress for chunk ["
		if !strings.Contains(out.String(), want) || !strings.Contains(out.String(), "raise --stall-timeout") {
			t.Errorf("the output does not say that A stalled (%q):\n%s", want, out)
		}
		if r.sum.Retries == 0 {
			t.Errorf("A's chunk was not handed out again: %+v", r.sum)
		}
		core, err := NewCore(CoreOptions{ModelDir: mdir})
		if err != nil {
			t.Fatal(err)
		}
		defer core.Close()
		checkAgainstForward(t, core.Model(), samples, 4, budget, dB)
		ga.release()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := a.Shutdown(ctx); err != nil {
			t.Errorf("A's shutdown once its forward returned: %v", err)
		}
	})

	t.Run("alone", func(t *testing.T) {
		a := startDaemon(t, Config{Model: mdir, Cache: t.TempDir(), TokenBudget: budget, DataRoots: []string{tmp}})
		ga := gateForwards(t, a.Core())
		wa, _ := Dial(a.Addr(), DialOptions{})
		defer wa.Close()
		out := &syncBuf{}
		plan := stallPlan(path, T, out)
		plan.RetryFor = 300 * time.Millisecond // A is asked again (its Status) until then: still stalled
		r := hang(t, ga, wa, []Worker{wa}, plan, func() {})
		err := r.err
		if err == nil || !errors.Is(err, ErrFill) {
			t.Fatalf("fill with its one daemon stalled: %v, want an ErrFill", err)
		}
		for _, want := range []string{a.Addr(), "stalled", "restart it", "--stall-timeout", "re-run the same command to resume"} {
			if !strings.Contains(err.Error(), want) {
				t.Errorf("error %q lacks %q", err, want)
			}
		}
		if !strings.Contains(out.String(), "teacher "+a.Addr()+" stalled") {
			t.Errorf("the output does not say that A stalled:\n%s", out)
		}
		ga.release()
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if err := a.Shutdown(ctx); err != nil {
			t.Errorf("shutdown once the forward returned: %v", err)
		}
	})
}

// oldDaemon is a worker whose daemon sends no progress: an older
// teacherd (the request's progress is dropped, as such a daemon ignores
// the field it does not know).
type oldDaemon struct{ Worker }

func (o oldDaemon) Fill(ctx context.Context, r *pb.FillRequest, on func(*pb.FillResponse) error) error {
	r = proto.Clone(r).(*pb.FillRequest)
	r.Progress = false
	return o.Worker.Fill(ctx, r, on)
}

// TestFillSlowDaemonNotStalled: a daemon whose chunk takes longer than
// the stall timeout in all, but whose forward passes each return within
// it, is not stalled: its progress feeds the watchdog. The watchdog's
// clock is the test's: each forward takes 0.6 of the timeout, stepped,
// so the chunk takes several timeouts whatever the machine's speed.
// Against an older daemon, which sends no progress, the same chunk
// stalls: the timeout then bounds each result (the test can fail).
func TestFillSlowDaemonNotStalled(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path, _ := writeIDsDataset(t, tmp, 8, 24, 512, 13)
	const T = time.Minute // on the test's clock
	for _, old := range []bool{false, true} {
		d := startDaemon(t, Config{Model: mdir, Cache: t.TempDir(), TokenBudget: 30, DataRoots: []string{tmp}})
		d.Core().progEvery.Store(0)
		g := gateForwards(t, d.Core())
		w, _ := Dial(d.Addr(), DialOptions{})
		defer w.Close()
		var worker Worker = w
		if old {
			worker = oldDaemon{w}
		}
		clk := stall.NewManualClock()
		heard := make(chan int32, 100)
		out := &syncBuf{}
		plan := stallPlan(path, T, out)
		plan.RetryFor = -1
		plan.stallClock = func(Worker) stall.Clock { return clk }
		plan.onProgress = func(_ Worker, p *pb.Progress) { heard <- p.GetForwardsDone() }
		done := startFill([]Worker{worker}, plan)
		var r fillResult
		forwards := 0
	steps:
		for {
			select {
			case n := <-g.entered:
				forwards = n
				if !old && n > 1 {
					// The client heard forward n-1 (the watchdog too)
					// before the clock moves on.
					for got := int32(0); got < int32(n-1); {
						got = <-heard
					}
				}
				clk.Advance(6 * T / 10)
				g.step <- struct{}{}
			case r = <-done:
				break steps
			}
		}
		switch {
		case !old && r.err != nil:
			t.Fatalf("a daemon slow in all (%d forwards of 0.6 timeout) but progressing: %v\n%s", forwards, r.err, out)
		case !old && forwards < 3:
			t.Fatalf("%d forwards: the chunk must take longer than the timeout", forwards)
		case old && (r.err == nil || !strings.Contains(r.err.Error(), "stalled")):
			t.Fatalf("an older daemon, silent for 1.2 timeouts: %v, want a stall\n%s", r.err, out)
		}
		g.release()
	}
}

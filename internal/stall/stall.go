// Package stall finds a teacher daemon whose work stopped moving while
// its connection stays healthy: a forward pass that hangs (a GPU hang, a
// deadlock) while gRPC still answers keepalive pings. Keepalive catches a
// daemon that is gone or stopped; only the stream's own messages tell a
// hung forward from a slow one. A client keeps a Watchdog per stream:
// every result or progress message (proto Progress) feeds it, and when
// nothing came for the timeout while work was owed, it fires, and the
// client treats the daemon as failed.
package stall

import (
	"context"
	"fmt"
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "distill/proto/distill/v1"
)

// DefaultTimeout is the stall timeout of cachectl fill --stall-timeout
// and distill.stall_timeout: long enough for a first forward that warms
// up and for a large teacher on a CPU, whose daemon sends progress after
// every forward pass; against an older daemon, which sends none, it
// bounds the wait for each result.
const DefaultTimeout = 10 * time.Minute

// Clock is the time a Watchdog reads: the real one, or a test's.
type Clock interface {
	Now() time.Time
	After(d time.Duration) <-chan time.Time
}

type realClock struct{}

func (realClock) Now() time.Time                         { return time.Now() }
func (realClock) After(d time.Duration) <-chan time.Time { return time.After(d) }

// Real is the real clock.
var Real Clock = realClock{}

// Watchdog fires once nothing was heard (Alive) for its timeout while
// work was owed (busy). A nil *Watchdog (timeout 0: disabled) does
// nothing.
type Watchdog struct {
	timeout time.Duration
	clk     Clock
	busy    func() bool
	onStall func(waited time.Duration)

	mu     sync.Mutex
	last   time.Time
	fired  bool
	waited time.Duration

	stopOnce sync.Once
	stop     chan struct{}
	done     chan struct{}
}

// Start watches a stream: onStall runs once, on the watchdog's
// goroutine, when nothing was heard for timeout while busy reports work
// owed (nil: always). busy is called without the watchdog's lock held,
// so it may take the caller's locks (that Alive may be called under).
// The clock is clk (nil: Real). A timeout <= 0 disables it: Start
// returns nil.
func Start(timeout time.Duration, clk Clock, busy func() bool, onStall func(waited time.Duration)) *Watchdog {
	if timeout <= 0 {
		return nil
	}
	if clk == nil {
		clk = Real
	}
	w := &Watchdog{timeout: timeout, clk: clk, busy: busy, onStall: onStall, last: clk.Now(), stop: make(chan struct{}), done: make(chan struct{})}
	go w.run()
	return w
}

// Alive says that the stream moved now: a result or a progress message
// came, or work became owed after none was (the wait starts there).
func (w *Watchdog) Alive() {
	if w == nil {
		return
	}
	w.mu.Lock()
	w.last = w.clk.Now()
	w.mu.Unlock()
}

func (w *Watchdog) run() {
	defer close(w.done)
	for {
		w.mu.Lock()
		last := w.last
		w.mu.Unlock()
		now := w.clk.Now()
		idle := now.Sub(last)
		if idle >= w.timeout {
			owed := w.busy == nil || w.busy()
			w.mu.Lock()
			switch {
			case w.last != last: // heard meanwhile
				w.mu.Unlock()
				continue
			case !owed: // nothing was owed: the wait starts afresh
				w.last = now
				w.mu.Unlock()
				idle = 0
			default:
				w.fired, w.waited = true, idle
				w.mu.Unlock()
				w.onStall(idle)
				return
			}
		}
		select {
		case <-w.clk.After(w.timeout - idle):
		case <-w.stop:
			return
		}
	}
}

// Stop ends the watch and reports whether it fired, and after how long
// a wait. It may be called more than once.
func (w *Watchdog) Stop() (waited time.Duration, stalled bool) {
	if w == nil {
		return 0, false
	}
	w.stopOnce.Do(func() { close(w.stop) })
	<-w.done
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.waited, w.fired
}

// Error is a stream a Watchdog found stalled. As a gRPC status it is
// Unavailable: clients treat the daemon as one that failed (its work
// goes to the others), as they treat one that died.
type Error struct {
	// Addr is the daemon's address; What the work that waited
	// ("chunk [0, 256)", "samples 3, 7 and 2 more"); Waited how long
	// nothing came; Flag the option that sets the timeout.
	Addr, What string
	Waited     time.Duration
	Flag       string
}

func (e *Error) Error() string {
	return fmt.Sprintf("teacher %s stalled: no result and no progress for %s in %s (%s): its forward pass seems hung (a GPU hang, a deadlock) while it still answers pings; restart it, or raise %s if its forward passes are that slow (an older teacherd sends no progress: the timeout then bounds each result)",
		e.Addr, e.What, round(e.Waited), e.Flag, e.Flag)
}

// GRPCStatus makes e an Unavailable status (package status).
func (e *Error) GRPCStatus() *status.Status { return status.New(codes.Unavailable, e.Error()) }

func round(d time.Duration) time.Duration {
	if d < time.Second {
		return d.Round(time.Millisecond)
	}
	return d.Round(time.Second)
}

// Mended reports whether a daemon that stalled works again, from its
// Status when it stalled (before) and now: a forward pass completed
// since, or it was restarted (its uptime went back). Its Info is no
// sign: a daemon whose forward hangs still answers Info and Status.
func Mended(before, now *pb.StatusResponse) bool {
	return now.GetForwardsTotal() != before.GetForwardsTotal() || now.GetUptimeSeconds() < before.GetUptimeSeconds()
}

// Recheck tells whether a daemon that stalled works again before it is
// given work: ask reads its Status now, and Recheck returns nil once it
// is Mended since before (its Status when it stalled), else ask's error,
// or an Unavailable (retryable) one saying that it is still stalled,
// with the option that set the timeout (flag, e.g. --stall-timeout) and
// its value.
func Recheck(ctx context.Context, ask func(context.Context) (*pb.StatusResponse, error), before *pb.StatusResponse, flag string, timeout time.Duration) error {
	now, err := ask(ctx)
	if err != nil {
		return err
	}
	if Mended(before, now) {
		return nil
	}
	return status.Errorf(codes.Unavailable, "stalled (nothing in %s %v), and still: no forward pass has completed on it since (%d in all): restart it, or raise %s if its forward passes are that slow", flag, timeout, now.GetForwardsTotal(), flag)
}

// ManualClock is a Clock that moves only when told (Advance): tests of
// what a watchdog does over long waits, without waiting.
type ManualClock struct {
	mu    sync.Mutex
	cond  *sync.Cond // broadcast when a wait is added
	t     time.Time
	waits []manualWait
}

type manualWait struct {
	at time.Time
	ch chan time.Time
}

// NewManualClock returns a clock at an arbitrary fixed time.
func NewManualClock() *ManualClock {
	c := &ManualClock{t: time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)}
	c.cond = sync.NewCond(&c.mu)
	return c
}

// Waiting blocks until n waits (After) are pending: a test advances the
// clock once the watchdog waits, not before (it would wait from then).
func (c *ManualClock) Waiting(n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for len(c.waits) < n {
		c.cond.Wait()
	}
}

// Now implements Clock.
func (c *ManualClock) Now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

// After implements Clock: the channel fires once Advance reaches d.
func (c *ManualClock) After(d time.Duration) <-chan time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	ch := make(chan time.Time, 1)
	if d <= 0 {
		ch <- c.t
		return ch
	}
	c.waits = append(c.waits, manualWait{at: c.t.Add(d), ch: ch})
	c.cond.Broadcast()
	return ch
}

// Advance moves the clock by d, firing the waits it reaches.
func (c *ManualClock) Advance(d time.Duration) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
	keep := c.waits[:0]
	for _, w := range c.waits {
		if !w.at.After(c.t) {
			w.ch <- c.t
			continue
		}
		keep = append(keep, w)
	}
	c.waits = keep
}

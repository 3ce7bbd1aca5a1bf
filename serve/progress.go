package serve

import (
	"sync/atomic"
	"time"

	pb "distill/proto/distill/v1"
)

// DefaultProgressEvery is the least time between two progress messages
// of one stream (CoreOptions.ProgressEvery): a client's stall timeout is
// minutes, and a message per forward pass of a fast GPU would be noise.
const DefaultProgressEvery = time.Second

// progress is the news that the work of one call (a Score stream, a
// Fill) moved, for the call's handler to pass on as Progress messages.
// It comes only from where the work really moves: the batcher, after a
// forward pass completed or a batch was taken, to the jobs still queued
// ("queued"); a fill, after each forward group of its chunks completed
// ("computing"). Never from a timer: when a forward pass hangs, the
// batcher's loop hangs in it (or, pipelined, takes no more batches), the
// news stops, and the client's stall watchdog sees a hung daemon, not a
// slow one.
type progress struct {
	c chan struct{} // buffered 1: news the handler has not looked at
	// done and total count the forward groups of a fill's chunks in
	// flight: completed, and submitted.
	done, total atomic.Int32
}

func newProgress() *progress { return &progress{c: make(chan struct{}, 1)} }

// poke says that the work moved. It never blocks (the batcher calls it
// with its lock held); news not looked at yet is merged. nil: the call
// did not ask for progress.
func (p *progress) poke() {
	if p == nil {
		return
	}
	select {
	case p.c <- struct{}{}:
	default:
	}
}

// pacer paces a call's progress messages: one at most every `every`,
// counted from the call's last message of any kind (a result says as
// much). News that comes sooner is dropped: the next forward pass brings
// more.
type pacer struct {
	every time.Duration
	last  time.Time
}

// due reports whether a progress message may go now, and if so counts
// it as sent.
func (p *pacer) due() bool {
	now := time.Now()
	if now.Sub(p.last) < p.every {
		return false
	}
	p.last = now
	return true
}

// sent records a message of the call (a result) sent now.
func (p *pacer) sent() { p.last = time.Now() }

// msg is the Progress message of p: "computing" when a forward
// group completed since the last message (lastDone), else "queued".
func (p *progress) msg(lastDone *int32, queued int) *pb.Progress {
	done := p.done.Load()
	state := "queued"
	if done > *lastDone {
		state = "computing"
	}
	*lastDone = done
	return &pb.Progress{State: state, ForwardsDone: done, ForwardsTotal: p.total.Load(), QueueDepth: int32(queued)}
}

// progressEvery is the pacing of the core's progress messages.
func (c *Core) progressEvery() time.Duration { return time.Duration(c.progEvery.Load()) }

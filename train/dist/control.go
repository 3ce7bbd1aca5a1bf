package dist

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"
)

// Operations of the loop (op.kind); barrier and broadcast are collectives
// (message.Op of an enter).
const (
	opBarrier   = "barrier"
	opBroadcast = "broadcast"
	opWelcome   = "welcome"
	opClose     = "close"
	opAbort     = "abort"
)

// op is a call into the loop; reply gets its one result.
type op struct {
	kind  string
	root  int
	data  []byte
	cause error // opAbort
	reply chan result
}

type result struct {
	data []byte
	err  error
}

// collective is one collective on rank 0, from the first rank that
// entered it to its release.
type collective struct {
	op      string
	root    int
	first   int // the first rank that entered
	entered int
	data    []byte
	local   *op // rank 0's own call, once it entered
}

func describeOp(kind string, root int) string {
	if kind == opBroadcast {
		return fmt.Sprintf("broadcast from rank %d", root)
	}
	return kind
}

// Barrier returns when every rank has called it, or with the error that
// ended the group. Cancelling ctx aborts the group: the ranks could no
// longer agree on which collective comes next.
func (g *Group) Barrier(ctx context.Context) error {
	_, err := g.do(ctx, &op{kind: opBarrier})
	return err
}

// Broadcast returns root's data on every rank (data is read on root
// only), when every rank has called it: it is a barrier too. It is for
// small messages (a few MiB at most: it travels through rank 0 as JSON).
func (g *Group) Broadcast(ctx context.Context, root int, data []byte) ([]byte, error) {
	if root < 0 || root >= g.world {
		return nil, fmt.Errorf("dist: broadcast root %d outside ranks 0 to %d", root, g.world-1)
	}
	if g.rank != root {
		data = nil
	}
	return g.do(ctx, &op{kind: opBroadcast, root: root, data: data})
}

// Abort fails the group for every rank with cause, naming this rank.
func (g *Group) Abort(cause error) {
	g.do(context.Background(), &op{kind: opAbort, cause: cause})
}

// Close leaves the group, saying goodbye so that no rank takes this one
// for dead. It returns nil, or the error the group had already failed
// with. Rank 0's Close ends the group for every rank.
func (g *Group) Close() error {
	g.do(context.Background(), &op{kind: opClose})
	if err := g.Err(); err != nil && !errors.Is(err, ErrClosed) {
		return err
	}
	return nil
}

// do runs o on the loop and waits for its result.
func (g *Group) do(ctx context.Context, o *op) ([]byte, error) {
	if g.world == 1 {
		switch o.kind {
		case opBroadcast:
			return o.data, nil
		case opAbort, opClose:
			g.end(o.cause)
		}
		return nil, g.Err()
	}
	o.reply = make(chan result, 1)
	cancelled := func() ([]byte, error) {
		g.Abort(fmt.Errorf("%s on rank %d: %w", o.kind, g.rank, ctx.Err()))
		return nil, ctx.Err()
	}
	if ctx.Err() != nil {
		return cancelled()
	}
	select {
	case g.ops <- o:
	case <-g.done:
		return nil, g.Err()
	case <-ctx.Done():
		return cancelled()
	}
	select {
	case r := <-o.reply:
		return r.data, r.err
	case <-ctx.Done():
		return cancelled()
	}
}

// loop owns the connections: it serves the ops, the peers' frames and the
// heartbeats until the group ends.
func (g *Group) loop() {
	interval := max(g.hb/heartbeatsPerTimeout, time.Millisecond)
	tick := time.NewTicker(interval)
	defer tick.Stop()
	for {
		select {
		case o := <-g.ops:
			if g.Err() != nil {
				o.reply <- result{err: g.Err()}
				continue
			}
			switch {
			case o.kind == opAbort:
				g.fail(&RankError{Rank: g.rank, Msg: fmt.Sprintf("rank %d failed: %v", g.rank, o.cause)})
				o.reply <- result{}
			case o.kind == opClose:
				g.end(nil)
				o.reply <- result{}
			case g.rank == 0:
				g.rootOp(o)
			default:
				g.memberOp(o)
			}
		case f := <-g.frames:
			if g.Err() != nil {
				continue
			}
			if g.rank == 0 {
				g.rootFrame(f)
			} else {
				g.memberFrame(f)
			}
		case <-tick.C:
			g.heartbeat()
		case <-g.done:
			return
		}
	}
}

// heartbeat declares dead a peer silent for longer than the timeout, and
// sends the others a heartbeat.
func (g *Group) heartbeat() {
	now := time.Now()
	for _, p := range g.peers {
		if p == nil || p.gone {
			continue
		}
		if silent := now.Sub(time.Unix(0, p.lastSeen.Load())); silent > g.hb {
			g.fail(&RankError{Rank: p.rank, Msg: fmt.Sprintf("%s sent nothing for %s (heartbeat timeout %s): it died, hung or lost the network", p.name(), silent.Round(time.Millisecond), g.hb)})
			return
		}
		if err := p.send(&message{Type: msgHeartbeat}); err != nil {
			g.died(p, err, "")
			return
		}
	}
}

// rootOp serves rank 0's own calls.
func (g *Group) rootOp(o *op) {
	switch o.kind {
	case opWelcome:
		w := &message{Type: msgWelcome, WorldSize: g.world, ConfigHash: g.configHash, UniqueID: g.id, Heartbeat: g.hb.Milliseconds()}
		for _, p := range g.peers[1:] {
			// The hello's nonce is needed for the server's proof; kept on
			// the peer by admit's caller.
			w.MAC = p.welcomeMAC
			if err := p.send(w); err != nil {
				g.died(p, err, ", during the rendezvous")
				o.reply <- result{err: g.Err()}
				return
			}
		}
		o.reply <- result{}
	case opBarrier, opBroadcast:
		g.seq++
		g.enter(0, g.seq, o.kind, o.root, o.data, o)
	}
}

// rootFrame serves a message from rank p.
func (g *Group) rootFrame(f frame) {
	p := f.p
	if f.err != nil {
		if !p.left && !p.gone {
			g.died(p, f.err, "")
		}
		return
	}
	switch m := f.m; m.Type {
	case msgEnter:
		if p.nextSeq++; m.Seq != p.nextSeq {
			g.fail(&RankError{Rank: p.rank, Msg: fmt.Sprintf("%s entered collective #%d, expected #%d: protocol error", p.name(), m.Seq, p.nextSeq)})
			return
		}
		g.enter(p.rank, m.Seq, m.Op, m.Root, m.Data, nil)
	case msgAbort:
		// The message names the rank that failed: this one, or rank 0
		// when this one took it for dead.
		if m.Rank < 0 || m.Rank >= g.world {
			m.Rank = p.rank
		}
		g.fail(&RankError{Rank: m.Rank, Msg: m.Error})
	case msgBye:
		p.left, p.gone = true, true
		p.conn.Close()
		g.logf("rank %d left the group", p.rank)
		for seq, c := range g.colls {
			g.fail(&RankError{Rank: p.rank, Msg: fmt.Sprintf("rank %d left the group (closed it) while collective #%d (%s) waited for it", p.rank, seq, describeOp(c.op, c.root))})
			return
		}
	default:
		g.fail(&RankError{Rank: p.rank, Msg: fmt.Sprintf("%s sent an unexpected %q message: protocol error (are all ranks the same build?)", p.name(), m.Type)})
	}
}

// enter records rank's entry into collective seq and releases it when
// every rank has entered.
func (g *Group) enter(rank int, seq uint64, kind string, root int, data []byte, local *op) {
	if kind != opBarrier && kind != opBroadcast || root < 0 || root >= g.world {
		g.failOp(local, &RankError{Rank: rank, Msg: fmt.Sprintf("rank %d entered an unknown collective %q (root %d): protocol error", rank, kind, root)})
		return
	}
	for _, p := range g.peers {
		if p != nil && p.left {
			g.failOp(local, &RankError{Rank: p.rank, Msg: fmt.Sprintf("rank %d left the group (closed it) before collective #%d (%s)", p.rank, seq, describeOp(kind, root))})
			return
		}
	}
	c := g.colls[seq]
	if c == nil {
		c = &collective{op: kind, root: root, first: rank}
		g.colls[seq] = c
	} else if c.op != kind || c.root != root {
		g.failOp(local, fmt.Errorf("%w: collective #%d: rank %d called %s, rank %d called %s: every rank must call the same collectives in the same order",
			ErrRankFailed, seq, c.first, describeOp(c.op, c.root), rank, describeOp(kind, root)))
		return
	}
	c.entered++
	if rank == root {
		c.data = data
	}
	if local != nil {
		c.local = local
	}
	if c.entered < g.world {
		return
	}
	delete(g.colls, seq)
	rel := &message{Type: msgRelease, Seq: seq, Data: c.data}
	for _, p := range g.peers[1:] {
		if err := p.send(rel); err != nil {
			g.failOp(c.local, g.deathOf(p, err, ""))
			return
		}
	}
	c.local.reply <- result{data: c.data}
}

// deathOf is the failure of peer p whose connection failed with err.
func (g *Group) deathOf(p *peer, err error, when string) error {
	return &RankError{Rank: p.rank, Msg: fmt.Sprintf("%s died: %s%s", p.name(), describeConnErr(err), when)}
}

// died fails the group with the death of peer p.
func (g *Group) died(p *peer, err error, when string) { g.fail(g.deathOf(p, err, when)) }

// failOp fails the group, and the local op that has not been recorded.
func (g *Group) failOp(local *op, err error) {
	g.fail(err)
	if local != nil {
		local.reply <- result{err: g.Err()}
	}
}

// memberOp serves this (non-zero) rank's calls.
func (g *Group) memberOp(o *op) {
	hub := g.peers[0]
	switch o.kind {
	case opBarrier, opBroadcast:
		g.seq++
		if err := hub.send(&message{Type: msgEnter, Seq: g.seq, Op: o.kind, Root: o.root, Data: o.data}); err != nil {
			g.failOp(o, g.deathOf(hub, err, ""))
			return
		}
		g.pending[g.seq] = o
	}
}

// memberFrame serves a message from rank 0.
func (g *Group) memberFrame(f frame) {
	hub := f.p
	if f.err != nil {
		if !hub.gone {
			g.died(hub, f.err, "")
		}
		return
	}
	switch m := f.m; m.Type {
	case msgRelease:
		o := g.pending[m.Seq]
		if o == nil {
			g.fail(&RankError{Rank: 0, Msg: fmt.Sprintf("%s released collective #%d, which this rank did not enter: protocol error", hub.name(), m.Seq)})
			return
		}
		delete(g.pending, m.Seq)
		o.reply <- result{data: m.Data}
	case msgAbort:
		if m.Rank >= 0 {
			g.fail(&RankError{Rank: m.Rank, Msg: m.Error + " (reported by rank 0)"})
		} else {
			g.fail(fmt.Errorf("%w: %s (reported by rank 0)", ErrRankFailed, m.Error))
		}
	case msgBye:
		hub.gone = true
		hub.conn.Close()
		g.end(fmt.Errorf("%w by rank 0", ErrClosed))
	default:
		g.fail(&RankError{Rank: 0, Msg: fmt.Sprintf("%s sent an unexpected %q message: protocol error (are all ranks the same build?)", hub.name(), m.Type)})
	}
}

// fail ends the group with err, telling the peers (rank 0 tells every
// rank; another rank has only rank 0 to tell, which tells the rest).
func (g *Group) fail(err error) { g.end(err) }

// end ends the group once: err nil is a Close. Each live peer gets an
// abort naming the failed rank (or a bye), and its connection is closed;
// then the pending calls get the group's error. Called on the loop, or on a
// world of 1.
func (g *Group) end(err error) {
	g.mu.Lock()
	if g.ended {
		g.mu.Unlock()
		return
	}
	g.ended = true
	last := &message{Type: msgBye}
	switch {
	case err == nil:
		err = ErrClosed
	case errors.Is(err, ErrClosed):
	default:
		last = &message{Type: msgAbort, Rank: -1, Error: err.Error()}
		var re *RankError
		if errors.As(err, &re) {
			last.Rank = re.Rank
			if g.report != nil {
				fmt.Fprintf(g.report, "%d\n", re.Rank)
			}
		}
		g.logf("the job failed: %v", err)
	}
	g.err = err
	g.mu.Unlock()
	var wg sync.WaitGroup
	for _, p := range g.peers {
		if p == nil || p.gone {
			continue
		}
		p.gone = true
		wg.Add(1)
		go func() {
			defer wg.Done()
			p.wmu.Lock()
			writeMsg(p.conn, last, time.Now().Add(goodbyeTimeout))
			p.wmu.Unlock()
			p.conn.Close()
		}()
	}
	wg.Wait()
	// The calls waiting learn of the end only now that the peers know:
	// a process that exits on their error has told them.
	for seq, c := range g.colls {
		if c.local != nil {
			c.local.reply <- result{err: err}
		}
		delete(g.colls, seq)
	}
	for seq, o := range g.pending {
		o.reply <- result{err: err}
		delete(g.pending, seq)
	}
	close(g.done)
}

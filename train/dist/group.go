package dist

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"strings"
	"sync"
	"sync/atomic"
	"time"
)

// Errors, to be tested with errors.Is.
var (
	// ErrEnv marks a launcher variable that is missing or malformed.
	ErrEnv = errors.New("dist: launcher environment")
	// ErrRendezvous marks a rendezvous that failed: refused, aborted or
	// timed out.
	ErrRendezvous = errors.New("dist: rendezvous")
	// ErrAuth marks a rank refused for its token (wrong, missing, or
	// present where rank 0 has none).
	ErrAuth = errors.New("dist: rendezvous token")
	// ErrInsecure marks a rank 0 that would listen beyond loopback with no
	// token.
	ErrInsecure = errors.New("dist: rendezvous without a token")
	// ErrRankFailed marks a job that failed because a rank did: it died,
	// hung, aborted or broke the protocol (a *RankError names which).
	ErrRankFailed = errors.New("dist: a rank failed")
	// ErrClosed marks a group that was closed.
	ErrClosed = errors.New("dist: group closed")
)

// RankError is the failure of the job caused by one rank.
type RankError struct {
	Rank int
	Msg  string
}

func (e *RankError) Error() string { return e.Msg }
func (e *RankError) Unwrap() error { return ErrRankFailed }

// Defaults of Options.
const (
	DefaultJoinTimeout      = 5 * time.Minute
	DefaultHeartbeatTimeout = 30 * time.Second
)

const (
	// handshakeTimeout bounds one connection's hello on rank 0, so that a
	// silent stranger holds nothing for long.
	handshakeTimeout = 30 * time.Second
	// goodbyeTimeout bounds the writes of the last message (bye, abort).
	goodbyeTimeout = 2 * time.Second
	// heartbeatsPerTimeout is how many heartbeats a timeout spans.
	heartbeatsPerTimeout = 5
)

// Options configure Join.
type Options struct {
	// Config is the resolved config, flattened (FlattenConfig): every rank
	// must have the same keys and values.
	Config map[string]string
	// UniqueID makes the blob rank 0 hands to every rank (the NCCL unique
	// id); called once, on rank 0 only. Nil: no blob.
	UniqueID func() ([]byte, error)
	// Token is the shared secret ranks prove they know (TokenFromEnv).
	// Rank 0 refuses to listen beyond loopback without one.
	Token string
	// JoinTimeout bounds the rendezvous (default 5 min).
	JoinTimeout time.Duration
	// HeartbeatTimeout is how long a peer may stay silent before it is
	// declared dead (default 30 s); rank 0's value holds for the group.
	HeartbeatTimeout time.Duration
	// Listener, on rank 0, is used instead of listening at the Env's
	// address (tests); Join closes it.
	Listener net.Listener
	// Log receives progress lines (nil: none).
	Log io.Writer
}

// Group is this process's membership of a job after the rendezvous: the
// control plane to the other ranks. Its collectives must be called by
// every rank in the same order, one at a time.
type Group struct {
	rank, world int
	addr        string // the rendezvous address
	id          []byte
	configHash  string
	hb          time.Duration
	log         io.Writer
	report      *os.File // the launcher's report pipe (Env.ReportFD), nil when none

	ops    chan *op
	frames chan frame
	done   chan struct{}

	mu    sync.Mutex
	ended bool
	err   error

	// The loop goroutine's own state.
	seq     uint64
	peers   []*peer                // rank 0: by rank (nil at 0); others: [0] is rank 0
	colls   map[uint64]*collective // rank 0: collectives some rank entered
	pending map[uint64]*op         // others: collectives waiting for rank 0
}

// Rank is this process's rank.
func (g *Group) Rank() int { return g.rank }

// WorldSize is the number of ranks.
func (g *Group) WorldSize() int { return g.world }

// UniqueID is the blob rank 0 handed out (Options.UniqueID).
func (g *Group) UniqueID() []byte { return g.id }

// ConfigHash is the SHA-256 (hex) of the resolved config every rank has.
func (g *Group) ConfigHash() string { return g.configHash }

// Done is closed when the group ends: a rank failed, or it was closed.
func (g *Group) Done() <-chan struct{} { return g.done }

// Err is nil while the group lives, then why it ended: a *RankError
// (errors.Is ErrRankFailed) when a rank failed, ErrClosed when closed.
func (g *Group) Err() error {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.err
}

func (g *Group) logf(format string, args ...any) {
	if g.log != nil {
		fmt.Fprintf(g.log, "rendezvous: "+format+"\n", args...)
	}
}

// Join makes this process a member of the job env describes: rank 0
// listens and waits for the others, every other rank connects to it. It
// returns when every rank has joined, with the same config, or with an
// error saying which rank or key is wrong. A world of 1 joins at once.
func Join(ctx context.Context, env Env, o Options) (*Group, error) {
	if o.JoinTimeout <= 0 {
		o.JoinTimeout = DefaultJoinTimeout
	}
	if o.HeartbeatTimeout <= 0 {
		o.HeartbeatTimeout = DefaultHeartbeatTimeout
	}
	if env.WorldSize < 1 {
		return nil, fmt.Errorf("%w: world size %d", ErrEnv, env.WorldSize)
	}
	digests, hash := digestConfig(o.Config)
	g := &Group{rank: env.Rank, world: env.WorldSize, addr: env.Addr(), configHash: hash, hb: o.HeartbeatTimeout, log: o.Log,
		ops: make(chan *op), frames: make(chan frame, 16), done: make(chan struct{})}
	if env.ReportFD > 0 {
		g.report = os.NewFile(uintptr(env.ReportFD), "launch report")
	}
	if env.WorldSize == 1 {
		if o.Listener != nil {
			o.Listener.Close()
		}
		var err error
		if o.UniqueID != nil {
			if g.id, err = o.UniqueID(); err != nil {
				return nil, fmt.Errorf("%w: unique id: %v", ErrRendezvous, err)
			}
		}
		return g, nil
	}
	if env.Rank == 0 {
		return g.joinAsRoot(ctx, env, o, digests)
	}
	return g.joinAsMember(ctx, o, digests)
}

// A peer is the other end of one control connection.
type peer struct {
	rank     int
	conn     net.Conn
	addr     string // its remote address, for messages
	hb       time.Duration
	wmu      sync.Mutex
	lastSeen atomic.Int64 // UnixNano of its last frame
	nextSeq  uint64       // rank 0: the seq of its last collective
	// welcomeMAC is rank 0's proof of the token for this peer's nonce.
	welcomeMAC []byte
	left       bool // rank 0: it said bye
	gone       bool // its connection is closed
}

func (p *peer) send(m *message) error {
	p.wmu.Lock()
	defer p.wmu.Unlock()
	return writeMsg(p.conn, m, time.Now().Add(p.hb))
}

func (p *peer) name() string { return fmt.Sprintf("rank %d (%s)", p.rank, p.addr) }

// frame is a message read from a peer, or the error that ended its
// connection.
type frame struct {
	p   *peer
	m   *message
	err error
}

// readFrom feeds p's frames to the loop; heartbeats only refresh lastSeen.
func (g *Group) readFrom(p *peer) {
	for {
		m, err := readMsg(p.conn, maxFrame)
		if err == nil {
			p.lastSeen.Store(time.Now().UnixNano())
			if m.Type == msgHeartbeat {
				continue
			}
		}
		select {
		case g.frames <- frame{p, m, err}:
		case <-g.done:
			return
		}
		if err != nil {
			return
		}
	}
}

// refuse answers a connection that is not admitted, then closes it.
func refuse(c net.Conn, cause, msg, key string) {
	writeMsg(c, &message{Type: msgRefuse, Error: msg, Key: key, Op: cause}, time.Now().Add(goodbyeTimeout))
	c.Close()
}

// Refusal causes (message.Op of a refuse).
const (
	causeToken  = "token"
	causeConfig = "config"
	causeJoin   = "rendezvous"
)

type arrival struct {
	conn  net.Conn
	hello *message
}

// joinAsRoot listens, admits world-1 ranks and welcomes them.
func (g *Group) joinAsRoot(ctx context.Context, env Env, o Options, digests map[string]string) (*Group, error) {
	lis, err := rootListener(env, o)
	if err != nil {
		return nil, err
	}
	// Judged on the bound address: a host name, or 0.0.0.0, is what the
	// socket really listens on.
	if ta, ok := lis.Addr().(*net.TCPAddr); (!ok || !ta.IP.IsLoopback()) && o.Token == "" {
		lis.Close()
		return nil, fmt.Errorf("%w: rank 0 would listen at %s (MASTER_ADDR %s), which other machines can reach, and no token is set: anyone who reaches it could join the run. "+
			"Set the same secret on every rank with %s=FILE (or %s), or use MASTER_ADDR=127.0.0.1 for a job on one node", ErrInsecure, lis.Addr(), env.MasterAddr, EnvTokenFile, EnvToken)
	}
	deadline := time.Now().Add(o.JoinTimeout)
	g.peers = make([]*peer, g.world)
	g.logf("rank 0 listening at %s for ranks 1 to %d (up to %s)", lis.Addr(), g.world-1, o.JoinTimeout)
	arrivals := make(chan arrival)
	stop := make(chan struct{})
	go func() {
		for {
			c, err := lis.Accept()
			if err != nil {
				return // closed
			}
			// A handshake left when the rendezvous ends finishes on its
			// own: refused, or at its deadline.
			go g.handshake(c, o.Token, deadline, arrivals, stop)
		}
	}()
	endJoin := func() {
		close(stop)
		lis.Close()
	}
	// abort refuses every admitted rank with err, and the offender (when
	// not nil) with its own message.
	abort := func(err error, offender net.Conn, msg, key string) (*Group, error) {
		endJoin()
		if offender != nil {
			refuse(offender, causeConfig, msg, key)
		}
		for _, p := range g.peers {
			if p != nil {
				refuse(p.conn, causeJoin, "rendezvous aborted by rank 0: "+err.Error(), "")
			}
		}
		close(g.done)
		return nil, err
	}
	timer := time.NewTimer(time.Until(deadline))
	defer timer.Stop()
	for joined := 1; joined < g.world; {
		select {
		case a := <-arrivals:
			if err, msg, key := g.admit(a, digests, o.Config); err != nil {
				return abort(err, a.conn, msg, key)
			}
			p := &peer{rank: a.hello.Rank, conn: a.conn, addr: a.conn.RemoteAddr().String(), hb: g.hb, welcomeMAC: mac(o.Token, "server", a.hello.Nonce)}
			g.peers[p.rank] = p
			joined++
			g.logf("rank %d joined from %s (%d of %d)", p.rank, p.addr, joined, g.world)
			go g.readFrom(p)
		case f := <-g.frames:
			why := "sent a message before the rendezvous ended"
			if f.err != nil {
				why = "died: " + describeConnErr(f.err)
			}
			return abort(&RankError{Rank: f.p.rank, Msg: fmt.Sprintf("rank %d (%s) %s, during the rendezvous", f.p.rank, f.p.addr, why)}, nil, "", "")
		case <-timer.C:
			var missing []string
			for r := 1; r < g.world; r++ {
				if g.peers[r] == nil {
					missing = append(missing, fmt.Sprint(r))
				}
			}
			return abort(fmt.Errorf("%w: %d of %d ranks joined within %s; missing: rank %s. Were all %d processes started (torchrun, srun, --nproc-per-node), with MASTER_ADDR:MASTER_PORT %s, and can they reach it?",
				ErrRendezvous, g.world-len(missing), g.world, o.JoinTimeout, strings.Join(missing, ", "), g.world, env.Addr()), nil, "", "")
		case <-ctx.Done():
			return abort(fmt.Errorf("%w: %w", ErrRendezvous, ctx.Err()), nil, "", "")
		}
	}
	endJoin()
	if o.UniqueID != nil {
		if g.id, err = o.UniqueID(); err != nil {
			return abort(fmt.Errorf("%w: unique id: %v", ErrRendezvous, err), nil, "", "")
		}
	}
	now := time.Now().UnixNano()
	for _, p := range g.peers[1:] {
		p.lastSeen.Store(now)
	}
	g.colls = map[uint64]*collective{}
	go g.loop()
	// The loop owns the peers from here; the welcomes go out through it,
	// so that a rank dying now fails the group like any other time.
	if _, err := g.do(ctx, &op{kind: opWelcome}); err != nil {
		return nil, err
	}
	g.logf("all %d ranks joined (config %s)", g.world, g.configHash[:12])
	return g, nil
}

func rootListener(env Env, o Options) (net.Listener, error) {
	if o.Listener != nil {
		return o.Listener, nil
	}
	if env.ListenFD > 0 {
		f := os.NewFile(uintptr(env.ListenFD), "rendezvous listener")
		defer f.Close()
		lis, err := net.FileListener(f)
		if err != nil {
			return nil, fmt.Errorf("%w: %s=%d: %v", ErrEnv, EnvListenFD, env.ListenFD, err)
		}
		return lis, nil
	}
	lis, err := net.Listen("tcp", env.Addr())
	if err != nil {
		return nil, fmt.Errorf("%w: rank 0 cannot listen at MASTER_ADDR:MASTER_PORT: %v", ErrRendezvous, err)
	}
	return lis, nil
}

// handshake challenges one connection and, when its token is right,
// passes its hello on to be admitted.
func (g *Group) handshake(c net.Conn, token string, deadline time.Time, arrivals chan<- arrival, stop <-chan struct{}) {
	if d := time.Now().Add(handshakeTimeout); d.Before(deadline) {
		deadline = d
	}
	c.SetDeadline(deadline)
	nonce := make([]byte, nonceBytes)
	rand.Read(nonce)
	if err := writeMsg(c, &message{Type: msgChallenge, Proto: protoVersion, Nonce: nonce}, deadline); err != nil {
		c.Close()
		return
	}
	m, err := readMsg(c, maxHelloFrame)
	if err != nil {
		g.logf("a connection from %s sent no hello: %s", c.RemoteAddr(), describeConnErr(err))
		c.Close()
		return
	}
	if m.Type != msgHello || m.Proto != protoVersion {
		refuse(c, causeJoin, fmt.Sprintf("rank 0 speaks %s and expected a hello, got %q (%q): are all ranks the same build?", protoVersion, m.Type, m.Proto), "")
		return
	}
	var why string
	switch want := mac(token, "client", nonce); {
	case token == "" && len(m.MAC) > 0:
		why = fmt.Sprintf("this rank has a rendezvous token and rank 0 has none: give every rank the same %s (or %s)", EnvTokenFile, EnvToken)
	case token != "" && len(m.MAC) == 0:
		why = fmt.Sprintf("rank 0 requires the rendezvous token, and this rank has none: set %s (or %s) on every rank", EnvTokenFile, EnvToken)
	case token != "" && !hmac.Equal(m.MAC, want): // constant time
		why = fmt.Sprintf("wrong rendezvous token: every rank needs the same %s (or %s)", EnvTokenFile, EnvToken)
	}
	if why != "" {
		g.logf("refused a connection from %s claiming rank %d: %s", c.RemoteAddr(), m.Rank, why)
		refuse(c, causeToken, why, "")
		return
	}
	c.SetDeadline(time.Time{})
	select {
	case arrivals <- arrival{c, m}:
	case <-stop:
		refuse(c, causeJoin, "the rendezvous is over: every rank had joined, or it was aborted", "")
	}
}

// admit checks an authenticated hello against the job: nil, or the error
// that aborts the rendezvous with the message for the offender (and the
// config key it concerns).
func (g *Group) admit(a arrival, digests, cfg map[string]string) (err error, msg, key string) {
	h, from := a.hello, a.conn.RemoteAddr()
	switch {
	case h.WorldSize != g.world:
		msg = fmt.Sprintf("rank %d at %s was started with world size %d, rank 0 with %d: start every rank with the same WORLD_SIZE (SLURM_NTASKS)", h.Rank, from, h.WorldSize, g.world)
	case h.Rank == 0:
		msg = fmt.Sprintf("duplicate rank 0: a process at %s claims rank 0, and rank 0 listens at %s: each process needs its own RANK (SLURM_PROCID)", from, a.conn.LocalAddr())
	case h.Rank < 0 || h.Rank >= g.world:
		msg = fmt.Sprintf("unknown rank %d from %s: ranks are 0 to %d (world size %d)", h.Rank, from, g.world-1, g.world)
	case g.peers[h.Rank] != nil:
		msg = fmt.Sprintf("duplicate rank %d: claimed from %s and from %s: each process needs its own RANK (SLURM_PROCID)", h.Rank, g.peers[h.Rank].addr, from)
	default:
		if key = firstDiff(digests, h.Config); key == "" {
			return nil, "", ""
		}
		msg = fmt.Sprintf("config differs from rank 0's at key %q (rank 0: %s): start every rank with the same config file and --set flags", key, describeValue(cfg, key))
		return fmt.Errorf("%w: rank %d's %s", ErrRendezvous, h.Rank, msg), msg, key
	}
	return fmt.Errorf("%w: %s", ErrRendezvous, msg), msg, ""
}

// joinAsMember connects to rank 0, retrying until the join deadline,
// proves the token and waits for the welcome.
func (g *Group) joinAsMember(ctx context.Context, o Options, digests map[string]string) (*Group, error) {
	deadline := time.Now().Add(o.JoinTimeout)
	c, err := g.dial(ctx, deadline, o.JoinTimeout)
	if err != nil {
		return nil, err
	}
	stopCancel := context.AfterFunc(ctx, func() { c.Close() })
	defer stopCancel()
	fail := func(err error) (*Group, error) {
		c.Close()
		if ctx.Err() != nil {
			err = fmt.Errorf("%w: %w", ErrRendezvous, ctx.Err())
		}
		return nil, err
	}
	c.SetReadDeadline(deadline)
	ch, err := readMsg(c, maxHelloFrame)
	if err != nil {
		return fail(fmt.Errorf("%w: rank 0 at %s gave no challenge: %s", ErrRendezvous, g.addr, describeConnErr(err)))
	}
	if ch.Type != msgChallenge || ch.Proto != protoVersion {
		return fail(fmt.Errorf("%w: the process at %s does not speak %s (got %q %q): is MASTER_PORT another service's?", ErrRendezvous, g.addr, protoVersion, ch.Type, ch.Proto))
	}
	nonce := make([]byte, nonceBytes)
	rand.Read(nonce)
	hello := &message{Type: msgHello, Proto: protoVersion, Rank: g.rank, WorldSize: g.world, Nonce: nonce, MAC: mac(o.Token, "client", ch.Nonce),
		ConfigHash: g.configHash, Config: digests}
	if err := writeMsg(c, hello, deadline); err != nil {
		return fail(fmt.Errorf("%w: hello to rank 0 at %s: %s", ErrRendezvous, g.addr, describeConnErr(err)))
	}
	g.logf("rank %d joined rank 0 at %s, waiting for the other ranks", g.rank, g.addr)
	m, err := readMsg(c, maxFrame)
	if err != nil {
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return fail(fmt.Errorf("%w: rank 0 at %s did not complete the rendezvous within %s: not every rank joined (rank 0's log says which)", ErrRendezvous, g.addr, o.JoinTimeout))
		}
		return fail(fmt.Errorf("%w: rank 0 at %s: %s, during the rendezvous", ErrRendezvous, g.addr, describeConnErr(err)))
	}
	switch {
	case m.Type == msgRefuse && m.Op == causeToken:
		return fail(fmt.Errorf("%w: refused by rank 0 at %s: %s", ErrAuth, g.addr, m.Error))
	case m.Type == msgRefuse && m.Key != "":
		return fail(fmt.Errorf("%w: refused by rank 0 at %s: %s; this rank (%d) has %s", ErrRendezvous, g.addr, m.Error, g.rank, describeValue(o.Config, m.Key)))
	case m.Type == msgRefuse:
		return fail(fmt.Errorf("%w: refused by rank 0 at %s: %s", ErrRendezvous, g.addr, m.Error))
	case m.Type != msgWelcome:
		return fail(fmt.Errorf("%w: rank 0 at %s answered the hello with %q: are all ranks the same build?", ErrRendezvous, g.addr, m.Type))
	case o.Token != "" && !hmac.Equal(m.MAC, mac(o.Token, "server", nonce)):
		return fail(fmt.Errorf("%w: the process at %s does not know the rendezvous token: another job's rank 0 on this port?", ErrAuth, g.addr))
	case m.ConfigHash != g.configHash || m.WorldSize != g.world:
		return fail(fmt.Errorf("%w: rank 0 at %s welcomed world size %d, config %.12s; this rank has %d, %.12s", ErrRendezvous, g.addr, m.WorldSize, m.ConfigHash, g.world, g.configHash))
	}
	c.SetDeadline(time.Time{})
	g.id = m.UniqueID
	if m.Heartbeat > 0 {
		g.hb = time.Duration(m.Heartbeat) * time.Millisecond
	}
	p := &peer{rank: 0, conn: c, addr: g.addr, hb: g.hb}
	p.lastSeen.Store(time.Now().UnixNano())
	g.peers = []*peer{p}
	g.pending = map[uint64]*op{}
	go g.readFrom(p)
	go g.loop()
	return g, nil
}

// dial connects to rank 0, retrying with backoff: rank 0 may start later.
func (g *Group) dial(ctx context.Context, deadline time.Time, timeout time.Duration) (net.Conn, error) {
	backoff := 50 * time.Millisecond
	for logged := false; ; {
		d := net.Dialer{Deadline: deadline}
		c, err := d.DialContext(ctx, "tcp", g.addr)
		if err == nil {
			return c, nil
		}
		if ctx.Err() != nil {
			return nil, fmt.Errorf("%w: %w", ErrRendezvous, ctx.Err())
		}
		if !time.Now().Add(backoff).Before(deadline) {
			return nil, fmt.Errorf("%w: rank 0 at %s did not answer within %s (last: %v): is rank 0 running, with the same MASTER_ADDR and MASTER_PORT as this rank?", ErrRendezvous, g.addr, timeout, err)
		}
		if !logged {
			g.logf("rank %d waiting for rank 0 at %s (%v)", g.rank, g.addr, err)
			logged = true
		}
		t := time.NewTimer(backoff)
		select {
		case <-t.C:
		case <-ctx.Done():
			t.Stop()
			return nil, fmt.Errorf("%w: %w", ErrRendezvous, ctx.Err())
		}
		backoff = min(2*backoff, 2*time.Second)
	}
}

// describeConnErr says what a connection's error means for its peer.
func describeConnErr(err error) string {
	switch {
	case errors.Is(err, io.EOF), errors.Is(err, io.ErrUnexpectedEOF):
		return "its connection closed without a goodbye"
	case errors.Is(err, os.ErrDeadlineExceeded):
		return "it did not answer in time"
	}
	return err.Error()
}

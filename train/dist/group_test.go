package dist

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// bound is the upper bound a test waits for anything: never reached when
// the code is right, it only turns a hang into a failure.
const bound = 60 * time.Second

var testConfig = map[string]string{"run_dir": "out/run", "optim.lr": "0.0003", "data.cache[0]": "/c"}

func copyConfig(kv ...string) map[string]string {
	c := map[string]string{}
	for k, v := range testConfig {
		c[k] = v
	}
	for i := 0; i+1 < len(kv); i += 2 {
		c[kv[i]] = kv[i+1]
	}
	return c
}

// loopback listens on 127.0.0.1 for a rank 0 and returns the Env of rank
// r in a world of n.
func loopback(t *testing.T) (net.Listener, func(r, n int) Env) {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { lis.Close() })
	port := lis.Addr().(*net.TCPAddr).Port
	return lis, func(r, n int) Env {
		return Env{Launcher: LauncherTorchrun, Rank: r, WorldSize: n, LocalRank: r, MasterAddr: "127.0.0.1", MasterPort: port}
	}
}

type joined struct {
	g   *Group
	err error
}

// joinRanks joins envs[i] with opts(i) concurrently; rank 0 (if among
// them) uses lis.
func joinRanks(lis net.Listener, envs []Env, opts func(i int) Options) []joined {
	out := make([]joined, len(envs))
	var wg sync.WaitGroup
	for i, e := range envs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := opts(i)
			if e.Rank == 0 {
				o.Listener = lis
			}
			ctx, cancel := context.WithTimeout(context.Background(), bound)
			defer cancel()
			out[i].g, out[i].err = Join(ctx, e, o)
		}()
	}
	wg.Wait()
	return out
}

func closeAll(js []joined) {
	for _, j := range js {
		if j.g != nil {
			j.g.Close()
		}
	}
}

func randomID() ([]byte, error) {
	b := make([]byte, 128)
	_, err := rand.Read(b)
	return b, err
}

// each runs f on every group concurrently and returns its errors.
func each(gs []*Group, f func(g *Group) error) []error {
	errs := make([]error, len(gs))
	var wg sync.WaitGroup
	for i, g := range gs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = f(g)
		}()
	}
	wg.Wait()
	return errs
}

func groups(t *testing.T, js []joined) []*Group {
	t.Helper()
	gs := make([]*Group, len(js))
	for i, j := range js {
		if j.err != nil {
			t.Fatalf("rank %d: %v", i, j.err)
		}
		gs[i] = j.g
	}
	return gs
}

// joinWorld joins n ranks with the same config and options.
func joinWorld(t *testing.T, n int, o Options) []*Group {
	t.Helper()
	lis, env := loopback(t)
	envs := make([]Env, n)
	for r := range n {
		envs[r] = env(r, n)
	}
	if o.Config == nil {
		o.Config = testConfig
	}
	js := joinRanks(lis, envs, func(int) Options { return o })
	t.Cleanup(func() { closeAll(js) })
	return groups(t, js)
}

func TestRendezvous(t *testing.T) {
	var ids [][]byte
	gs := joinWorld(t, 4, Options{UniqueID: func() ([]byte, error) {
		b, err := randomID()
		ids = append(ids, b)
		return b, err
	}})
	if len(ids) != 1 {
		t.Fatalf("UniqueID called %d times, want once (on rank 0)", len(ids))
	}
	_, hash := digestConfig(testConfig)
	for r, g := range gs {
		if g.Rank() != r || g.WorldSize() != 4 || !bytes.Equal(g.UniqueID(), ids[0]) || g.ConfigHash() != hash {
			t.Fatalf("rank %d: rank %d world %d id %x hash %s; want id %x hash %s", r, g.Rank(), g.WorldSize(), g.UniqueID(), g.ConfigHash(), ids[0], hash)
		}
	}
	ctx := context.Background()
	for _, err := range each(gs, func(g *Group) error { return g.Barrier(ctx) }) {
		if err != nil {
			t.Fatal(err)
		}
	}
	for root := range 4 {
		got := make([][]byte, 4)
		errs := each(gs, func(g *Group) error {
			var err error
			got[g.Rank()], err = g.Broadcast(ctx, root, []byte(fmt.Sprintf("from rank %d", g.Rank())))
			return err
		})
		for r := range 4 {
			if errs[r] != nil || string(got[r]) != fmt.Sprintf("from rank %d", root) {
				t.Fatalf("broadcast from %d: rank %d got %q, %v", root, r, got[r], errs[r])
			}
		}
	}
	// Close: every rank leaves; nobody is taken for dead.
	for _, err := range each(gs, func(g *Group) error { return g.Close() }) {
		if err != nil {
			t.Fatal(err)
		}
	}
	for r, g := range gs {
		<-g.Done()
		if err := g.Err(); !errors.Is(err, ErrClosed) {
			t.Errorf("rank %d after Close: %v", r, err)
		}
	}
}

func TestWorldOfOne(t *testing.T) {
	g, err := Join(context.Background(), Env{WorldSize: 1}, Options{UniqueID: randomID})
	if err != nil || len(g.UniqueID()) != 128 {
		t.Fatalf("%v, id %x", err, g.UniqueID())
	}
	if err := g.Barrier(context.Background()); err != nil {
		t.Fatal(err)
	}
	if b, err := g.Broadcast(context.Background(), 0, []byte("x")); err != nil || string(b) != "x" {
		t.Fatalf("%q, %v", b, err)
	}
	if err := g.Close(); err != nil {
		t.Fatal(err)
	}
	if err := g.Barrier(context.Background()); !errors.Is(err, ErrClosed) {
		t.Fatalf("barrier after close: %v", err)
	}
}

// TestConfigMismatch: the rank whose config differs is refused with the
// first differing key, and every rank fails: here rank 1 has joined when
// rank 2 comes. (A rank that comes after the rendezvous was aborted finds
// no listener and fails at its join timeout.)
func TestConfigMismatch(t *testing.T) {
	lis, env := loopback(t)
	log := newSyncBuffer("rank 1 joined")
	js := make([]joined, 3)
	var wg sync.WaitGroup
	for r := range 2 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			o := Options{Config: testConfig, JoinTimeout: bound}
			if r == 0 {
				o.Listener, o.Log = lis, log
			}
			js[r].g, js[r].err = Join(context.Background(), env(r, 3), o)
		}()
	}
	<-log.seen
	js[2].g, js[2].err = Join(context.Background(), env(2, 3), Options{Config: copyConfig("optim.lr", "0.001", "z.only_here", "1"), JoinTimeout: bound})
	wg.Wait()
	defer closeAll(js)
	for r, j := range js {
		if !errors.Is(j.err, ErrRendezvous) {
			t.Errorf("rank %d: %v, want ErrRendezvous", r, j.err)
		}
	}
	if e := js[0].err.Error(); !strings.Contains(e, `rank 2's config differs from rank 0's at key "optim.lr" (rank 0: "0.0003")`) {
		t.Errorf("rank 0: %s", e)
	}
	if e := js[2].err.Error(); !strings.Contains(e, `key "optim.lr" (rank 0: "0.0003")`) || !strings.Contains(e, `this rank (2) has "0.001"`) {
		t.Errorf("rank 2: %s", e)
	}
	if e := js[1].err.Error(); !strings.Contains(e, `rendezvous aborted by rank 0`) || !strings.Contains(e, `rank 2's config differs from rank 0's at key "optim.lr"`) {
		t.Errorf("rank 1: %s", e)
	}
}

// TestConfigMissingKey: a key one rank lacks is a difference too.
func TestConfigMissingKey(t *testing.T) {
	lis, env := loopback(t)
	cfg1 := copyConfig()
	delete(cfg1, "data.cache[0]")
	js := joinRanks(lis, []Env{env(0, 2), env(1, 2)}, func(i int) Options {
		return Options{Config: map[bool]map[string]string{true: testConfig, false: cfg1}[i == 0]}
	})
	defer closeAll(js)
	if js[0].err == nil || !strings.Contains(js[0].err.Error(), `"data.cache[0]"`) {
		t.Errorf("rank 0: %v", js[0].err)
	}
	if js[1].err == nil || !strings.Contains(js[1].err.Error(), `this rank (1) has (not set)`) {
		t.Errorf("rank 1: %v", js[1].err)
	}
}

// TestToken: a rank without the token, or with another, is refused and
// the job goes on; the rank with the token joins.
func TestToken(t *testing.T) {
	lis, env := loopback(t)
	type res struct {
		g   *Group
		err error
	}
	root := make(chan res, 1)
	go func() {
		ctx, cancel := context.WithTimeout(context.Background(), bound)
		defer cancel()
		g, err := Join(ctx, env(0, 2), Options{Config: testConfig, Token: "s3cret", Listener: lis})
		root <- res{g, err}
	}()
	ctx := context.Background()
	for _, c := range []struct{ token, want string }{{"wrong", "wrong rendezvous token"}, {"", "this rank has none"}} {
		_, err := Join(ctx, env(1, 2), Options{Config: testConfig, Token: c.token, JoinTimeout: bound})
		if !errors.Is(err, ErrAuth) || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), EnvTokenFile) {
			t.Errorf("token %q: %v, want ErrAuth saying %q", c.token, err, c.want)
		}
	}
	g1, err := Join(ctx, env(1, 2), Options{Config: testConfig, Token: "s3cret", JoinTimeout: bound})
	if err != nil {
		t.Fatal(err)
	}
	defer g1.Close()
	r := <-root
	if r.err != nil {
		t.Fatal(r.err)
	}
	defer r.g.Close()
	for _, err := range each([]*Group{r.g, g1}, func(g *Group) error { return g.Barrier(ctx) }) {
		if err != nil {
			t.Fatal(err)
		}
	}
}

// TestTokenOnlyOnMember: rank 0 has no token, a member has one: refused.
func TestTokenOnlyOnMember(t *testing.T) {
	lis, env := loopback(t)
	done := make(chan error, 1)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	go func() {
		_, err := Join(ctx, env(0, 2), Options{Config: testConfig, Listener: lis})
		done <- err
	}()
	_, err := Join(context.Background(), env(1, 2), Options{Config: testConfig, Token: "s3cret", JoinTimeout: bound})
	if !errors.Is(err, ErrAuth) || !strings.Contains(err.Error(), "rank 0 has none") {
		t.Errorf("%v", err)
	}
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Errorf("rank 0 after cancel: %v", err)
	}
}

// TestInsecureListen: rank 0 refuses to listen beyond loopback without a
// token, naming the fix; with one it listens.
func TestInsecureListen(t *testing.T) {
	e := Env{Launcher: LauncherTorchrun, WorldSize: 2, MasterAddr: "0.0.0.0", MasterPort: 0}
	_, err := Join(context.Background(), e, Options{})
	if !errors.Is(err, ErrInsecure) || !strings.Contains(err.Error(), EnvTokenFile) || !strings.Contains(err.Error(), "MASTER_ADDR=127.0.0.1") {
		t.Fatalf("%v", err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	buf := newSyncBuffer("listening")
	done := make(chan error, 1)
	go func() {
		_, err := Join(ctx, e, Options{Token: "t", Log: buf})
		done <- err
	}()
	<-buf.seen
	cancel()
	if err := <-done; !errors.Is(err, context.Canceled) {
		t.Fatalf("with a token: %v", err)
	}
}

// syncBuffer collects output and closes seen once it holds match count
// times.
type syncBuffer struct {
	mu     sync.Mutex
	b      bytes.Buffer
	match  string
	count  int
	seen   chan struct{}
	closed bool
}

func newSyncBuffer(match string) *syncBuffer { return newSyncBufferN(match, 1) }

func newSyncBufferN(match string, count int) *syncBuffer {
	return &syncBuffer{match: match, count: count, seen: make(chan struct{})}
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.b.Write(p)
	if !s.closed && s.match != "" && strings.Count(s.b.String(), s.match) >= s.count {
		close(s.seen)
		s.closed = true
	}
	return len(p), nil
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestRefusals: wrong world size, unknown rank and duplicate rank abort the
// rendezvous with a message that says so.
func TestRefusals(t *testing.T) {
	cases := []struct {
		name   string
		member []Env // rank 0 is env(0, 3)
		want   string
	}{
		{"world size", []Env{{Rank: 1, WorldSize: 4}}, "world size 4, rank 0 with 3"},
		{"unknown rank", []Env{{Rank: 5, WorldSize: 3}}, "unknown rank 5"},
		{"duplicate rank", []Env{{Rank: 1, WorldSize: 3}, {Rank: 1, WorldSize: 3}}, "duplicate rank 1"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			lis, env := loopback(t)
			envs := []Env{env(0, 3)}
			for _, m := range c.member {
				e := env(m.Rank, m.WorldSize)
				envs = append(envs, e)
			}
			js := joinRanks(lis, envs, func(int) Options { return Options{Config: testConfig} })
			defer closeAll(js)
			if !errors.Is(js[0].err, ErrRendezvous) || !strings.Contains(js[0].err.Error(), c.want) {
				t.Errorf("rank 0: %v, want %q", js[0].err, c.want)
			}
			saw := false
			for _, j := range js[1:] {
				if j.err == nil {
					t.Errorf("a member joined")
				} else {
					saw = saw || strings.Contains(j.err.Error(), c.want)
				}
			}
			if !saw {
				t.Errorf("no member was told %q: %v", c.want, js[1:])
			}
		})
	}
}

// rawMember speaks the member's side of the handshake by hand: it sends
// hello (its nonce and MAC filled in) and returns the connection and the
// answer.
func rawMember(t *testing.T, addr string, hello message, token string) (net.Conn, *message) {
	t.Helper()
	c, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	ch, err := readMsg(c, maxFrame)
	if err != nil || ch.Type != msgChallenge {
		t.Fatalf("challenge: %+v, %v", ch, err)
	}
	hello.Type, hello.Proto, hello.Nonce, hello.MAC = msgHello, protoVersion, make([]byte, nonceBytes), mac(token, "client", ch.Nonce)
	if err := writeMsg(c, &hello, time.Now().Add(bound)); err != nil {
		t.Fatal(err)
	}
	m, err := readMsg(c, maxFrame)
	if err != nil {
		t.Fatal(err)
	}
	return c, m
}

// TestSecondRankZero: a process claiming rank 0 is a duplicate.
func TestSecondRankZero(t *testing.T) {
	lis, env := loopback(t)
	done := make(chan error, 1)
	go func() {
		_, err := Join(context.Background(), env(0, 2), Options{Config: testConfig, Listener: lis, JoinTimeout: bound})
		done <- err
	}()
	digests, hash := digestConfig(testConfig)
	_, m := rawMember(t, lis.Addr().String(), message{Rank: 0, WorldSize: 2, Config: digests, ConfigHash: hash}, "")
	if m.Type != msgRefuse || !strings.Contains(m.Error, "duplicate rank 0") {
		t.Errorf("answer %+v", m)
	}
	if err := <-done; err == nil || !strings.Contains(err.Error(), "duplicate rank 0") {
		t.Errorf("rank 0: %v", err)
	}
}

// TestJoinTimeout: rank 0 names the ranks that never came; the others
// are told.
func TestJoinTimeout(t *testing.T) {
	lis, env := loopback(t)
	js := joinRanks(lis, []Env{env(0, 4), env(2, 4)}, func(i int) Options {
		if i == 1 {
			return Options{Config: testConfig, JoinTimeout: bound}
		}
		return Options{Config: testConfig, JoinTimeout: 300 * time.Millisecond}
	})
	if err := js[0].err; !errors.Is(err, ErrRendezvous) || !strings.Contains(err.Error(), "missing: rank 1, 3") {
		t.Errorf("rank 0: %v", err)
	}
	if js[1].err == nil {
		t.Errorf("rank 2 joined")
	}
}

// TestMemberWaitsForRoot: a member started before rank 0 retries until
// rank 0 listens.
func TestMemberWaitsForRoot(t *testing.T) {
	lis, env := loopback(t)
	addr := lis.Addr().String()
	lis.Close() // the port is free again: connecting is refused
	log := newSyncBuffer("waiting for rank 0")
	done := make(chan joined, 1)
	go func() {
		g, err := Join(context.Background(), env(1, 2), Options{Config: testConfig, JoinTimeout: bound, Log: log})
		done <- joined{g, err}
	}()
	<-log.seen
	lis2, err := net.Listen("tcp", addr)
	if err != nil {
		t.Skipf("the port was taken meanwhile: %v", err)
	}
	g0, err := Join(context.Background(), env(0, 2), Options{Config: testConfig, Listener: lis2})
	if err != nil {
		t.Fatal(err)
	}
	defer g0.Close()
	j := <-done
	if j.err != nil {
		t.Fatal(j.err)
	}
	defer j.g.Close()
}

// waitDone waits for g to end, up to bound.
func waitDone(t *testing.T, g *Group) error {
	t.Helper()
	select {
	case <-g.Done():
		return g.Err()
	case <-time.After(bound):
		t.Fatalf("rank %d: the group did not end within %s", g.Rank(), bound)
	}
	return nil
}

func wantRankError(t *testing.T, who string, err error, rank int, words ...string) {
	t.Helper()
	var re *RankError
	if !errors.As(err, &re) || re.Rank != rank || !errors.Is(err, ErrRankFailed) {
		t.Errorf("%s: %v, want a RankError naming rank %d", who, err, rank)
		return
	}
	for _, w := range words {
		if !strings.Contains(err.Error(), w) {
			t.Errorf("%s: %q does not say %q", who, err, w)
		}
	}
}

// TestMemberDies: a member whose connection drops without a goodbye (its
// process died) fails every other rank, naming it, at once: the
// heartbeat timeout (an hour here) plays no part.
func TestMemberDies(t *testing.T) {
	gs := joinWorld(t, 4, Options{HeartbeatTimeout: time.Hour})
	gs[2].peers[0].conn.Close() // a member has one connection: to rank 0
	alive := []*Group{gs[0], gs[1], gs[3]}
	errs := each(alive, func(g *Group) error { return g.Barrier(context.Background()) })
	for i, g := range alive {
		wantRankError(t, fmt.Sprintf("rank %d's barrier", g.Rank()), errs[i], 2, "rank 2", "died")
		wantRankError(t, fmt.Sprintf("rank %d's Err", g.Rank()), waitDone(t, g), 2)
	}
}

// fakeRoot plays rank 0 for n-1 members by hand: it welcomes them with
// heartbeat timeout hb, then runs then on their connections.
func fakeRoot(t *testing.T, lis net.Listener, n int, hb time.Duration, then func(cs []net.Conn)) {
	go func() {
		var cs []net.Conn
		for range n - 1 {
			c, err := lis.Accept()
			if err != nil {
				return
			}
			defer c.Close()
			writeMsg(c, &message{Type: msgChallenge, Proto: protoVersion, Nonce: make([]byte, nonceBytes)}, time.Now().Add(bound))
			if _, err := readMsg(c, maxFrame); err != nil {
				return
			}
			cs = append(cs, c)
		}
		_, hash := digestConfig(testConfig)
		for _, c := range cs {
			writeMsg(c, &message{Type: msgWelcome, WorldSize: n, ConfigHash: hash, Heartbeat: hb.Milliseconds()}, time.Now().Add(bound))
		}
		then(cs)
	}()
}

// joinMembers joins ranks 1 to n-1 of a world of n.
func joinMembers(t *testing.T, env func(r, n int) Env, n int) []*Group {
	var envs []Env
	for r := 1; r < n; r++ {
		envs = append(envs, env(r, n))
	}
	js := joinRanks(nil, envs, func(int) Options { return Options{Config: testConfig, JoinTimeout: bound} })
	t.Cleanup(func() { closeAll(js) })
	return groups(t, js)
}

// TestRootDies: rank 0's connections dropping fails every member, naming
// rank 0, at once.
func TestRootDies(t *testing.T) {
	lis, env := loopback(t)
	fakeRoot(t, lis, 3, time.Hour, func(cs []net.Conn) {
		for _, c := range cs {
			c.Close()
		}
	})
	gs := joinMembers(t, env, 3)
	errs := each(gs, func(g *Group) error { return g.Barrier(context.Background()) })
	for i, g := range gs {
		wantRankError(t, fmt.Sprintf("rank %d's barrier", g.Rank()), errs[i], 0, "rank 0", "died")
	}
}

// TestSilentMember: a member that stops sending (hung, or its network
// gone) fails the job after the heartbeat timeout.
func TestSilentMember(t *testing.T) {
	lis, env := loopback(t)
	done := make(chan joined, 1)
	go func() {
		g, err := Join(context.Background(), env(0, 2), Options{Config: testConfig, Listener: lis, HeartbeatTimeout: 300 * time.Millisecond})
		done <- joined{g, err}
	}()
	digests, hash := digestConfig(testConfig)
	_, m := rawMember(t, lis.Addr().String(), message{Rank: 1, WorldSize: 2, Config: digests, ConfigHash: hash}, "")
	if m.Type != msgWelcome || m.Heartbeat != 300 {
		t.Fatalf("answer %+v", m)
	}
	j := <-done
	if j.err != nil {
		t.Fatal(j.err)
	}
	// The raw member never sends a heartbeat.
	wantRankError(t, "rank 0", waitDone(t, j.g), 1, "rank 1", "sent nothing for", "heartbeat timeout 300ms")
}

// TestSilentRoot: a rank 0 that stops sending fails the members after
// the heartbeat timeout it gave them.
func TestSilentRoot(t *testing.T) {
	lis, env := loopback(t)
	fakeRoot(t, lis, 2, 300*time.Millisecond, func(cs []net.Conn) {
		// Silence, reading what comes until the member hangs up.
		for {
			if _, err := readMsg(cs[0], maxFrame); err != nil {
				return
			}
		}
	})
	g := joinMembers(t, env, 2)[0]
	wantRankError(t, "rank 1", waitDone(t, g), 0, "rank 0", "sent nothing for", "heartbeat timeout 300ms")
	if err := g.Barrier(context.Background()); !errors.Is(err, ErrRankFailed) {
		t.Errorf("barrier after the failure: %v", err)
	}
}

// TestAbort: a rank's Abort fails every rank with its cause.
func TestAbort(t *testing.T) {
	for _, failing := range []int{1, 0} {
		gs := joinWorld(t, 3, Options{})
		gs[failing].Abort(errors.New("out of memory"))
		for _, g := range gs {
			wantRankError(t, fmt.Sprintf("rank %d", g.Rank()), waitDone(t, g), failing, fmt.Sprintf("rank %d failed: out of memory", failing))
		}
	}
}

// TestCollectiveMismatch: ranks calling different collectives fail.
func TestCollectiveMismatch(t *testing.T) {
	gs := joinWorld(t, 2, Options{})
	errs := each(gs, func(g *Group) error {
		if g.Rank() == 0 {
			return g.Barrier(context.Background())
		}
		_, err := g.Broadcast(context.Background(), 1, []byte("x"))
		return err
	})
	for r, err := range errs {
		if !errors.Is(err, ErrRankFailed) || !strings.Contains(err.Error(), "same collectives in the same order") {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// TestLeftRank: a collective waiting for a rank that closed the group
// fails, naming it.
func TestLeftRank(t *testing.T) {
	gs := joinWorld(t, 3, Options{})
	if err := gs[2].Close(); err != nil {
		t.Fatal(err)
	}
	errs := each(gs[:2], func(g *Group) error { return g.Barrier(context.Background()) })
	for r, err := range errs {
		wantRankError(t, fmt.Sprintf("rank %d", r), err, 2, "rank 2 left the group")
	}
}

// TestCancelAborts: a cancelled collective fails the group.
func TestCancelAborts(t *testing.T) {
	gs := joinWorld(t, 2, Options{})
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := gs[1].Barrier(ctx); !errors.Is(err, context.Canceled) {
		t.Fatalf("%v", err)
	}
	wantRankError(t, "rank 0", waitDone(t, gs[0]), 1, "context canceled")
}

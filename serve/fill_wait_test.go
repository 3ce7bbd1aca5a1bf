package serve

import (
	"context"
	"net"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	pb "distill/proto/distill/v1"
)

// fakeClock is a fill's clock (FillPlan.now, .after) whose waits end at
// once, moving its time on by the wait: a fill's waits for its teachers
// are tested without sleeping.
type fakeClock struct {
	mu    sync.Mutex
	t     time.Time
	waits int
}

func newFakeClock() *fakeClock {
	return &fakeClock{t: time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)}
}

func (c *fakeClock) use(p *FillPlan) { p.now, p.after = c.now, c.after }

func (c *fakeClock) now() time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.t
}

func (c *fakeClock) after(d time.Duration) <-chan time.Time {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.t = c.t.Add(d)
	c.waits++
	ch := make(chan time.Time, 1)
	ch <- c.t
	return ch
}

// downTeacher is a fake whose Info fails with err for its first calls
// (-1: every call).
type downTeacher struct {
	*fakeTeacher
	err   error
	mu    sync.Mutex
	calls int
	down  int
}

func (d *downTeacher) Info(ctx context.Context) (*pb.InfoResponse, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.calls++
	if d.down < 0 || d.calls <= d.down {
		return nil, d.err
	}
	return d.fakeTeacher.Info(ctx)
}

var (
	refused = status.Error(codes.Unavailable, "connection refused")
	loading = status.Error(codes.Unavailable, "teacher model still loading: retry when the health check reports SERVING")
)

// TestFillWaitsForAnUnreachableTeacher: a fill started before its
// daemon listens waits for it (it failed at once), says so at once and
// again every LogEvery with what the daemon last answered, and starts
// when it answers.
func TestFillWaitsForAnUnreachableTeacher(t *testing.T) {
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: "data.jsonl"}}, Pretokenized: true}
	a := &downTeacher{fakeTeacher: newFake("a:7070", "/a", nil), err: refused, down: 5}
	var out strings.Builder
	p := FillPlan{Dataset: ds, ChunkSamples: 8, PerWorker: 1, LogEvery: time.Second, Out: &out}
	newFakeClock().use(&p)
	sum, err := RunFill(context.Background(), []Worker{a}, p)
	if err != nil {
		t.Fatalf("fill: %v\n%s", err, out.String())
	}
	// Asked at 0, 0.5, ..., 2.5 s: said at 0, 1 and 2 s; answers at 2.5.
	want := "fill: waiting for the teachers to answer (for up to 2m0s, --retry-for): a:7070: Info: connection refused\n" +
		"fill: still waiting for the teachers (1s of 2m0s, --retry-for): a:7070: Info: connection refused\n" +
		"fill: still waiting for the teachers (2s of 2m0s, --retry-for): a:7070: Info: connection refused\n" +
		"fill: teacher a:7070 answers (after 3s of waiting)\n"
	if !strings.HasPrefix(out.String(), want) || sum.Samples != 40 {
		t.Errorf("output:\n%s\nwant it to begin with:\n%s", out.String(), want)
	}
}

// TestFillGivesUpWaitingPastRetryFor: with no teacher answering in
// RetryFor, the fill fails naming every teacher, what it last answered
// and what to check.
func TestFillGivesUpWaitingPastRetryFor(t *testing.T) {
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: "data.jsonl"}}, Pretokenized: true}
	a := &downTeacher{fakeTeacher: newFake("a:7070", "/a", nil), err: refused, down: -1}
	b := &downTeacher{fakeTeacher: newFake("b:7070", "/b", nil), err: loading, down: -1}
	var out strings.Builder
	p := FillPlan{Dataset: ds, ChunkSamples: 8, RetryFor: 2 * time.Second, LogEvery: time.Hour, Out: &out}
	clock := newFakeClock()
	clock.use(&p)
	_, err := RunFill(context.Background(), []Worker{a, b}, p)
	want := "no teacher answered in 2s (--retry-for): teacher a:7070: Info: connection refused (is it running? check the address, --token and TLS); " +
		"teacher b:7070: Info: teacher model still loading: retry when the health check reports SERVING (still loading its model: give a longer --retry-for)"
	if err == nil || err.Error() != want || clock.waits != 4 {
		t.Errorf("fill: %v after %d waits\nwant %q after 4\n%s", err, clock.waits, want, out.String())
	}
}

// TestFillRefusalIsNotWaitedFor: a daemon that answers and refuses (a
// token, TLS) fails the fill at once, even while another one is waited
// for: no wait can fix it.
func TestFillRefusalIsNotWaitedFor(t *testing.T) {
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: "data.jsonl"}}, Pretokenized: true}
	for _, c := range []struct {
		err  error
		want string
	}{
		{status.Error(codes.Unauthenticated, "missing or wrong bearer token"), "teacher b:7070: Info: missing or wrong bearer token (give the daemon's bearer token with --token-file"},
		{status.Error(codes.Unavailable, `connection error: desc = "transport: authentication handshake failed: tls: first record does not look like a TLS handshake"`),
			"teacher b:7070: Info: authentication handshake failed: tls: first record does not look like a TLS handshake (is it running? check the address, --token and TLS)"},
	} {
		a := &downTeacher{fakeTeacher: newFake("a:7070", "/a", nil), err: refused, down: -1}
		b := &downTeacher{fakeTeacher: newFake("b:7070", "/b", nil), err: c.err, down: -1}
		p := FillPlan{Dataset: ds, ChunkSamples: 8}
		clock := newFakeClock()
		clock.use(&p)
		_, err := RunFill(context.Background(), []Worker{a, b}, p)
		if err == nil || !strings.HasPrefix(err.Error(), c.want) || clock.waits != 0 {
			t.Errorf("fill: %v after %d waits\nwant %q at once", err, clock.waits, c.want)
		}
	}
}

// TestFillLateTeacherJoins: of two teachers, the fill starts with the
// one that answers, and the other joins the fill (its cache directory
// too) when it answers. a's first chunk is held until b has taken one.
func TestFillLateTeacherJoins(t *testing.T) {
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: "data.jsonl"}}, Pretokenized: true}
	a := newFake("a:7070", "/a", nil)
	b := &downTeacher{fakeTeacher: newFake("b:7070", "/b", nil), err: refused, down: 3}
	joined := make(chan struct{})
	a.fill = func(f *fakeTeacher, call int, r *pb.FillRequest) error {
		if call == 1 {
			<-joined
		}
		return nil
	}
	b.fill = func(f *fakeTeacher, call int, r *pb.FillRequest) error {
		if call == 1 {
			close(joined)
		}
		return nil
	}
	var out syncWriter
	p := FillPlan{Dataset: ds, ChunkSamples: 8, PerWorker: 1, LogEvery: time.Hour, Out: &out}
	newFakeClock().use(&p)
	sum, err := RunFill(context.Background(), []Worker{a, b}, p)
	if err != nil {
		t.Fatalf("fill: %v\n%s", err, out.String())
	}
	got := out.String()
	start := strings.Index(got, "fill: starting without b:7070: Info: connection refused; each joins the fill when it answers (until 2m0s since the start, --retry-for)\n")
	join := strings.Index(got, "fill: teacher b:7070 answers (after 1s): it joins the fill\n")
	if start < 0 || join < start || len(sum.Dirs) != 2 || !strings.Contains(got, "fill: cache directory /b (written by b:7070)") {
		t.Errorf("output:\n%s", got)
	}
}

// TestFillWaitsForALoadingDaemon: a daemon that listens and loads its
// model (health NOT_SERVING, Info Unavailable) is waited for, and the
// fill goes on once it serves. The core is set only after the fill
// says that it waits.
func TestFillWaitsForALoadingDaemon(t *testing.T) {
	mdir := tinyModel(t)
	dir := t.TempDir()
	path, _ := writeIDsDataset(t, dir, 8, 10, 512, 3)
	roots, err := NewDataRoots([]string{dir}, "--data-root")
	if err != nil {
		t.Fatal(err)
	}
	gs, srv := NewGRPCServer(ServerOptions{DataRoots: roots})
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	go gs.Serve(lis)
	defer gs.Stop()
	w, err := Dial(lis.Addr().String(), DialOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	out := newLineWatch()
	p := FillPlan{Dataset: &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}, ChunkSamples: 4, K: 4, Out: out, LogEvery: time.Hour}
	done := make(chan error, 1)
	go func() {
		_, err := RunFill(context.Background(), []Worker{w}, p)
		done <- err
	}()
	if err := out.waitFor(done, "fill: waiting for the teachers to answer (for up to 2m0s, --retry-for): "+w.Name()+": Info: teacher model still loading"); err != nil {
		t.Fatal(err)
	}
	c, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: t.TempDir()})
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	srv.SetCore(c)
	if err := <-done; err != nil {
		t.Fatalf("fill: %v\n%s", err, out.String())
	}
	if !strings.Contains(out.String(), "fill: teacher "+w.Name()+" answers (after ") || !strings.Contains(out.String(), "fill: 8 samples") {
		t.Errorf("output:\n%s", out.String())
	}
}

// TestFillProgressWhileWaiting: while no teacher answers, the progress
// says since when the fill waits for them; it extrapolated a rate that
// decayed and an ETA that grew. The teacher fails its second chunk and
// holds every call after until the second progress line since (the
// first may have been made before the failure).
func TestFillProgressWhileWaiting(t *testing.T) {
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: "data.jsonl"}}, Pretokenized: true}
	release := make(chan struct{})
	a := newFake("a:7070", "/a", nil)
	a.fill = func(f *fakeTeacher, call int, r *pb.FillRequest) error {
		switch {
		case call == 2:
			return refused
		case call > 2:
			<-release
		}
		return nil
	}
	out := newLineWatch()
	p := FillPlan{Dataset: ds, ChunkSamples: 8, PerWorker: 1, LogEvery: time.Millisecond, Out: out}
	done := make(chan error, 1)
	go func() {
		_, err := RunFill(context.Background(), []Worker{a}, p)
		done <- err
	}()
	failed := "fill: teacher a:7070 failed (Unavailable: connection refused)"
	var lines []string
	err := out.until(done, func(s string) bool {
		i := strings.Index(s, failed)
		if i < 0 {
			return false
		}
		lines = nil
		for _, l := range strings.Split(s[i:], "\n")[1:] {
			if strings.HasPrefix(l, "fill: 8/40 samples") {
				lines = append(lines, l)
			}
		}
		return len(lines) >= 2
	})
	close(release)
	if err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("fill: %v\n%s", err, out.String())
	}
	if l := lines[1]; !strings.HasPrefix(l, "fill: 8/40 samples (20.0%), waiting for the teachers since ") || !strings.HasSuffix(l, "): none answers") || strings.Contains(l, "tokens/s") {
		t.Errorf("progress while the teacher is down: %q", l)
	}
}

// lineWatch is a fill's output that a test reads as it is written.
type lineWatch struct {
	syncWriter
	wrote chan struct{}
}

func newLineWatch() *lineWatch { return &lineWatch{wrote: make(chan struct{}, 1)} }

func (w *lineWatch) Write(p []byte) (int, error) {
	n, err := w.syncWriter.Write(p)
	select {
	case w.wrote <- struct{}{}:
	default:
	}
	return n, err
}

// until returns once ok holds of the output, or an error when the fill
// (done) ends first.
func (w *lineWatch) until(done chan error, ok func(string) bool) error {
	for !ok(w.String()) {
		select {
		case <-w.wrote:
		case err := <-done:
			done <- err
			if ok(w.String()) {
				return nil
			}
			return &fillEnded{err, w.String()}
		}
	}
	return nil
}

// waitFor is until the output holds s.
func (w *lineWatch) waitFor(done chan error, s string) error {
	return w.until(done, func(out string) bool { return strings.Contains(out, s) })
}

// fillEnded is a fill that ended before the output a test waited for.
type fillEnded struct {
	err error
	out string
}

func (e *fillEnded) Error() string {
	return "the fill ended (" + errString(e.err) + ") before the output waited for:\n" + e.out
}

func errString(err error) string {
	if err == nil {
		return "no error"
	}
	return err.Error()
}

package serve

import (
	"context"
	"fmt"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"distill/cache"
	pb "distill/proto/distill/v1"
)

// signalWriter is a fill's output that closes seen when a line holding
// want is written.
type signalWriter struct {
	mu   sync.Mutex
	b    strings.Builder
	want string
	seen chan struct{}
	once sync.Once
}

func (w *signalWriter) Write(p []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.b.Write(p)
	if strings.Contains(w.b.String(), w.want) {
		w.once.Do(func() { close(w.seen) })
	}
	return len(p), nil
}

func (w *signalWriter) String() string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return w.b.String()
}

// TestConcurrentFillsSplitChunks: two fills of one range into one cache
// directory (two in-process teachers, as two cachectl processes; or one
// and a daemon on the same directory) compute every chunk once between
// them. Fill A holds chunk 0 until fill B has found it busy; B says so,
// does its other chunks, comes back to chunk 0 and finds it committed.
func TestConcurrentFillsSplitChunks(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path, _ := writeIDsDataset(t, tmp, 24, 20, 512, 3)
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	const chunk, chunks = 4, 6
	for _, bRemote := range []bool{false, true} {
		name := map[bool]string{false: "in-process", true: "daemon"}[bRemote]
		t.Run(name, func(t *testing.T) {
			dir := t.TempDir()
			coreA, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: dir, TokenBudget: 300, InProcess: true})
			if err != nil {
				t.Fatal(err)
			}
			a := Local(coreA)
			defer a.Close()
			var b Worker
			if bRemote {
				daemon := startDaemon(t, Config{Model: mdir, Cache: dir, TokenBudget: 300, DataRoots: []string{tmp}})
				if b, err = Dial(daemon.Addr(), DialOptions{}); err != nil {
					t.Fatal(err)
				}
			} else {
				coreB, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: dir, TokenBudget: 300, InProcess: true})
				if err != nil {
					t.Fatal(err)
				}
				b = Local(coreB)
			}
			defer b.Close()

			aHolds := make(chan struct{})
			outB := &signalWriter{want: "is being computed by another writer", seen: make(chan struct{})}
			var once sync.Once
			testHookChunkBegun = func(c *Core, r cache.Range) {
				if c == coreA && r.Start == 0 {
					once.Do(func() { close(aHolds) })
					<-outB.seen // B found chunk 0 busy
				}
			}
			defer func() { testHookChunkBegun = nil }()

			plan := func(out *signalWriter) FillPlan {
				return FillPlan{Dataset: ds, ChunkSamples: chunk, K: 4, PerWorker: 1, BusyPoll: time.Millisecond, Out: out}
			}
			outA := &signalWriter{want: "\x00", seen: make(chan struct{})}
			var sumA *FillSummary
			var errA error
			done := make(chan struct{})
			go func() {
				defer close(done)
				sumA, errA = RunFill(context.Background(), []Worker{a}, plan(outA))
			}()
			<-aHolds
			sumB, errB := RunFill(context.Background(), []Worker{b}, plan(outB))
			<-done
			if errA != nil || errB != nil {
				t.Fatalf("fills: %v; %v\nA:\n%s\nB:\n%s", errA, errB, outA, outB)
			}
			if sumA.Chunks+sumB.Chunks != chunks || sumB.ByOthers < 1 {
				t.Fatalf("A computed %d chunks, B %d (%d computed by A meanwhile), want %d in all\nA:\n%s\nB:\n%s",
					sumA.Chunks, sumB.Chunks, sumB.ByOthers, chunks, outA, outB)
			}
			if !strings.Contains(outB.String(), "chunk [0, 4) is being computed by another writer of the cache (pid ") ||
				!strings.Contains(outB.String(), "computed by another writer of the cache meanwhile") {
				t.Fatalf("B's output does not say chunk 0 was busy, then done by another writer:\n%s", outB)
			}
			t.Logf("B's output:\n%s", outB)
			rep, err := cache.Check(dir, nil)
			if err != nil {
				t.Fatal(err)
			}
			if rep.Chunks != chunks || rep.Samples != 24 {
				t.Fatalf("cache: %d chunks, %d samples", rep.Chunks, rep.Samples)
			}
			if cl, err := cache.Claims(dir); err != nil || len(cl) != 0 {
				t.Fatalf("claims left after the fills: %v %v", cl, err)
			}
		})
	}
}

// TestFillReplansAroundAnotherWritersChunk: another writer commits a
// chunk of other bounds inside a range this fill planned, between the
// plan and the range's claim (two fills with different --chunk). The
// fill plans that range again and fills the parts still missing; it
// stopped with "fill ranges must follow the committed chunk boundaries".
func TestFillReplansAroundAnotherWritersChunk(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path, _ := writeIDsDataset(t, tmp, 12, 20, 512, 4)
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	dir := t.TempDir()
	core, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: dir, TokenBudget: 300, InProcess: true})
	if err != nil {
		t.Fatal(err)
	}
	w := Local(core)
	defer w.Close()
	const k = 4
	var once sync.Once
	var otherErr error
	testHookBeforeChunk = func(c *Core, r cache.Range) {
		if r != (cache.Range{Start: 0, End: 6}) {
			return
		}
		once.Do(func() { otherErr = commitOther(dir, 4, 8, k) })
	}
	defer func() { testHookBeforeChunk = nil }()
	var out strings.Builder
	sum, err := RunFill(context.Background(), []Worker{w}, FillPlan{Dataset: ds, ChunkSamples: 6, K: k, PerWorker: 1, Out: &out})
	if otherErr != nil {
		t.Fatalf("the other writer: %v", otherErr)
	}
	if err != nil {
		t.Fatalf("fill: %v\n%s", err, out.String())
	}
	if sum.Samples != 8 || sum.Chunks != 2 {
		t.Fatalf("filled %d samples in %d chunks, want 8 in 2 ([0, 4) and [8, 12))\n%s", sum.Samples, sum.Chunks, out.String())
	}
	rep, err := cache.Check(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	if rep.Chunks != 3 || rep.Samples != 12 {
		t.Fatalf("cache: %d chunks, %d samples; want 3, 12", rep.Chunks, rep.Samples)
	}
}

// commitOther commits samples [a, b) into the cache in dir as another
// writer would, with made-up (valid) top-k of k entries.
func commitOther(dir string, a, b int64, k int) error {
	c, err := cache.Open(dir, nil)
	if err != nil {
		return err
	}
	defer c.Close()
	w, err := c.BeginChunk(a, b)
	if err != nil {
		return err
	}
	for i := a; i < b; i++ {
		s := cache.Sample{Index: i, Tokens: []int32{1, 2, 3}, Mask: []uint8{0, 1, 1}}
		for t := 0; t < 3; t++ {
			for j := 0; j < k; j++ {
				s.TopKIDs = append(s.TopKIDs, int32(j))
				s.TopKLogProbs = append(s.TopKLogProbs, -float32(j+1))
			}
		}
		if err := w.Add(s); err != nil {
			w.Abort()
			return err
		}
	}
	return w.Commit()
}

// TestBusyChunkSaidAgain: a chunk found busy is said once with what the
// fill does about it, then "still waiting" once BusyRepeat has passed
// since it was last said (a clock of the test's own), and it goes back to
// the queue each time.
func TestBusyChunkSaidAgain(t *testing.T) {
	var out strings.Builder
	p := FillPlan{Out: &out, BusyPoll: time.Second, BusyRepeat: time.Minute}
	r := cache.Range{Start: 0, End: 4}
	d := newFillDispatch(&p, &fillDirs{}, "", &FillSummary{}, []cache.Range{r, {Start: 4, End: 8}, {Start: 8, End: 12}})
	for range 3 {
		<-d.queue
	}
	t0 := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	clock := []time.Time{t0, t0.Add(30 * time.Second), t0.Add(61 * time.Second)}
	d.now = func() time.Time { c := clock[0]; clock = clock[1:]; return c }
	err := &cache.BusyError{Want: r, Holder: cache.Claim{Range: r, PID: 42, Host: "h", Since: t0, Writer: "tmp/42-x"}}
	d.busy(r, err) // said
	d.busy(r, err) // 30 s later: not again
	d.busy(r, err) // 61 s after it was said: again
	lines := strings.Split(strings.TrimSpace(out.String()), "\n")
	if len(lines) != 2 || !strings.Contains(lines[0], "chunk [0, 4) is being computed by another writer of the cache (pid 42 on h since ") ||
		!strings.Contains(lines[0], "comes back to it every 1s") || !strings.HasPrefix(lines[1], "fill: still waiting for chunk [0, 4), which another writer of the cache is computing (pid 42 on h") {
		t.Fatalf("output:\n%s", out.String())
	}
	if len(d.queue) != 3 {
		t.Fatalf("%d chunks queued, want the busy one each time", len(d.queue))
	}
}

// TestFillReportsChunkCommittedMeanwhile: a chunk another writer commits
// after a Fill has read what is done is reported skipped. The Fill read
// the index twice, what was done and then what was missing, so a chunk
// committed in between was in neither and the Fill answered nothing of
// it: a client that had found it busy never counted it done
// (TestConcurrentFillsSplitChunks failed so, now and then).
func TestFillReportsChunkCommittedMeanwhile(t *testing.T) {
	tmp := t.TempDir()
	path, _ := writeIDsDataset(t, tmp, 8, 20, 512, 5)
	dir := t.TempDir()
	core, err := NewCore(CoreOptions{ModelDir: tinyModel(t), CacheDir: dir, TokenBudget: 300, InProcess: true})
	if err != nil {
		t.Fatal(err)
	}
	defer core.Close()
	const k = 4
	var otherErr error
	testHookFillRead = func(*Core) { otherErr = commitOther(dir, 0, 4, k) }
	defer func() { testHookFillRead = nil }()
	kk := int32(k)
	req := &pb.FillRequest{Dataset: &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}, Start: 0, End: 8, ChunkSamples: 4, K: &kk}
	var got []string
	err = core.Fill(context.Background(), req, func(m *pb.FillResponse) error {
		got = append(got, fmt.Sprintf("[%d, %d) skipped=%v", m.GetStart(), m.GetEnd(), m.GetSkipped()))
		return nil
	})
	if err != nil || otherErr != nil {
		t.Fatalf("fill: %v; the other writer: %v", err, otherErr)
	}
	sort.Strings(got)
	if want := "[[0, 4) skipped=true [4, 8) skipped=false]"; fmt.Sprint(got) != want {
		t.Fatalf("responses %v, want %s", got, want)
	}
}

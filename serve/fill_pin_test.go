package serve

import (
	"context"
	"flag"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"distill/cache"
	pb "distill/proto/distill/v1"
)

var updatePinned = flag.Bool("update", false, "rewrite testdata/fill_pinned.golden from this run")

// fakeTeacher is a Worker over an in-memory cache: its chunks' counts are
// functions of their samples, so a fill's summary and output are the same
// on every run whichever teacher takes which chunk.
type fakeTeacher struct {
	name, dir string
	info      *pb.InfoResponse
	desc      *pb.DescribeDatasetResponse
	// fill, when set, answers a Fill before the fake does (nil: go on).
	fill func(f *fakeTeacher, call int, r *pb.FillRequest) error
	// afterReport, when set, is the error of a Fill that reported its chunk.
	afterReport func(call int) error
	forget      bool // Fill reports chunks without keeping them
	statusDown  bool // Status fails once a chunk is computed
	log         *fillLog

	mu       sync.Mutex
	calls    int
	done     []cache.Range
	computed bool
}

// fillLog collects the Fill requests of every teacher of a fill.
type fillLog struct {
	mu   sync.Mutex
	reqs []string
}

func (l *fillLog) add(s string) {
	l.mu.Lock()
	l.reqs = append(l.reqs, s)
	l.mu.Unlock()
}

func newFake(name, dir string, log *fillLog) *fakeTeacher {
	return &fakeTeacher{name: name, dir: dir, log: log,
		info: &pb.InfoResponse{TeacherFingerprint: "teacher-fp", VocabSize: 512, KDefault: 8, CacheDir: dir},
		desc: &pb.DescribeDatasetResponse{Samples: 40, Fingerprint: "dataset-fp", TokenizerFingerprint: "tokenizer-fp"}}
}

func (f *fakeTeacher) Name() string { return f.name }
func (f *fakeTeacher) Close() error { return nil }
func (f *fakeTeacher) Info(ctx context.Context) (*pb.InfoResponse, error) {
	if f.info == nil {
		return nil, status.Error(codes.Unavailable, "connection refused")
	}
	return f.info, nil
}
func (f *fakeTeacher) Describe(ctx context.Context, d *pb.Dataset) (*pb.DescribeDatasetResponse, error) {
	return f.desc, nil
}

func (f *fakeTeacher) Status(ctx context.Context, r *pb.StatusRequest) (*pb.StatusResponse, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.statusDown && f.computed {
		return nil, status.Error(codes.Unavailable, "connection refused")
	}
	st := &pb.StatusResponse{DatasetKnown: len(f.done) > 0}
	for _, d := range f.done {
		st.Done = append(st.Done, &pb.Range{Start: d.Start, End: d.End})
	}
	return st, nil
}

func (f *fakeTeacher) Fill(ctx context.Context, r *pb.FillRequest, onChunk func(*pb.FillResponse) error) error {
	f.mu.Lock()
	f.calls++
	call := f.calls
	f.mu.Unlock()
	if f.log != nil {
		f.log.add(fmt.Sprintf("[%d, %d) chunk %d k %d T %g enc %q expect %q", r.GetStart(), r.GetEnd(), r.GetChunkSamples(),
			r.GetK(), r.GetTemperature(), r.GetEncoding(), r.GetExpectDatasetFingerprint()))
	}
	if f.fill != nil {
		if err := f.fill(f, call, r); err != nil {
			return err
		}
	}
	cr := cache.Range{Start: r.GetStart(), End: r.GetEnd()}
	f.mu.Lock()
	skipped := false
	for _, d := range f.done {
		skipped = skipped || d == cr
	}
	if !skipped && !f.forget {
		f.done = append(f.done, cr)
		sort.Slice(f.done, func(i, j int) bool { return f.done[i].Start < f.done[j].Start })
	}
	f.computed = f.computed || !skipped
	f.mu.Unlock()
	m := &pb.FillResponse{Start: cr.Start, End: cr.End, Skipped: skipped, CacheDir: f.dir}
	if !skipped {
		fakeCounts(m)
	}
	if err := onChunk(m); err != nil {
		return err
	}
	if f.afterReport != nil {
		return f.afterReport(call)
	}
	return nil
}

// fakeCounts sets a computed chunk's counts from its samples: sample s has
// 3 + s%5 tokens and 2 targets fewer; every 7th is truncated; s%11 == 5 is
// dropped as too long and sample 17 skipped as bad, each with a message.
func fakeCounts(m *pb.FillResponse) {
	m.Reasons = map[string]int64{}
	for s := m.Start; s < m.End; s++ {
		n := 3 + s%5
		m.Tokens += n
		switch {
		case s == 17:
			m.BadSkipped++
			m.Reasons["bad record"]++
			m.Examples = append(m.Examples, fmt.Sprintf("data.jsonl:%d: input_ids: not a list", s+1))
		case s%11 == 5:
			m.Dropped++
			m.Reasons["longer than --max-len"]++
			m.Examples = append(m.Examples, fmt.Sprintf("data.jsonl:%d: %d tokens", s+1, n))
		default:
			m.Targets += n - 2
			if s%7 == 0 {
				m.Truncated++
			}
		}
	}
}

// pinnedFill is one fixed fill: its teachers, its plan and what it does
// to the context.
type pinnedFill struct {
	name  string
	setup func(log *fillLog) ([]Worker, FillPlan)
}

func pinnedFills() []pinnedFill {
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: "data.jsonl"}}, Pretokenized: true}
	plan := func() FillPlan {
		return FillPlan{Dataset: ds, ChunkSamples: 8, PerWorker: 1, LogEvery: time.Hour}
	}
	unavailable := status.Error(codes.Unavailable, "connection reset")
	return []pinnedFill{
		{"two teachers, one chunk done", func(log *fillLog) ([]Worker, FillPlan) {
			a, b := newFake("a:7070", "/a", log), newFake("b:7070", "/b", log)
			a.done = []cache.Range{{Start: 0, End: 8}}
			p := plan()
			p.Temperature, p.Encoding, p.PerWorker = 1.5, "lossless", 2
			return []Worker{a, b}, p
		}},
		{"terminal bar, a range", func(log *fillLog) ([]Worker, FillPlan) {
			p := plan()
			p.Start, p.End, p.K, p.Terminal = 4, 30, 4, true
			return []Worker{newFake("a:7070", "/cache", log)}, p
		}},
		{"redone chunk", func(log *fillLog) ([]Worker, FillPlan) {
			// Which chunk a takes first is the scheduler's choice: its
			// requests are not logged, and the chunk is not named.
			a, b := newFake("a:7070", "/a", nil), newFake("b:7070", "/b", nil)
			first := make(chan struct{})
			a.afterReport = func(call int) error {
				if call == 1 {
					close(first)
				}
				return unavailable
			}
			a.fill = func(f *fakeTeacher, call int, r *pb.FillRequest) error {
				if call > 1 {
					return unavailable
				}
				return nil
			}
			b.fill = func(f *fakeTeacher, call int, r *pb.FillRequest) error { <-first; return nil }
			return []Worker{a, b}, plan()
		}},
		{"no teacher", func(log *fillLog) ([]Worker, FillPlan) { return nil, plan() }},
		{"bad chunk size", func(log *fillLog) ([]Worker, FillPlan) {
			p := plan()
			p.ChunkSamples = -1
			return []Worker{newFake("a:7070", "/a", log)}, p
		}},
		{"bad dataset", func(log *fillLog) ([]Worker, FillPlan) {
			p := plan()
			p.Dataset = &pb.Dataset{}
			return []Worker{newFake("a:7070", "/a", log)}, p
		}},
		{"teacher down", func(log *fillLog) ([]Worker, FillPlan) {
			a := newFake("a:7070", "/a", log)
			a.info = nil
			p := plan()
			newFakeClock().use(&p) // waited for RetryFor, without sleeping
			return []Worker{a}, p
		}},
		{"no cache directory", func(log *fillLog) ([]Worker, FillPlan) {
			return []Worker{newFake("a:7070", "", log)}, plan()
		}},
		{"vocab disagrees", func(log *fillLog) ([]Worker, FillPlan) {
			a, b := newFake("a:7070", "/a", log), newFake("b:7070", "/b", log)
			b.info = &pb.InfoResponse{TeacherFingerprint: "teacher-fp", VocabSize: 1024, KDefault: 8, CacheDir: "/b"}
			return []Worker{a, b}, plan()
		}},
		{"k default disagrees", func(log *fillLog) ([]Worker, FillPlan) {
			a, b := newFake("a:7070", "/a", log), newFake("b:7070", "/b", log)
			b.info = &pb.InfoResponse{TeacherFingerprint: "teacher-fp", VocabSize: 512, KDefault: 16, CacheDir: "/b"}
			return []Worker{a, b}, plan()
		}},
		{"tokenizer mismatch", func(log *fillLog) ([]Worker, FillPlan) {
			p := plan()
			p.Dataset = &pb.Dataset{Sources: []*pb.DataSource{{Path: "data.jsonl"}}}
			p.TokenizerFingerprint = "another-tokenizer"
			return []Worker{newFake("a:7070", "/a", log)}, p
		}},
		{"range beyond the dataset", func(log *fillLog) ([]Worker, FillPlan) {
			p := plan()
			p.End = 41
			return []Worker{newFake("a:7070", "/a", log)}, p
		}},
		{"empty range", func(log *fillLog) ([]Worker, FillPlan) {
			p := plan()
			p.Start, p.End = 9, 9
			return []Worker{newFake("a:7070", "/a", log)}, p
		}},
		{"chunk boundaries differ", func(log *fillLog) ([]Worker, FillPlan) {
			a, b := newFake("a:7070", "/a", log), newFake("b:7070", "/b", log)
			a.done, b.done = []cache.Range{{Start: 0, End: 8}}, []cache.Range{{Start: 4, End: 12}}
			return []Worker{a, b}, plan()
		}},
		{"probe refused", func(log *fillLog) ([]Worker, FillPlan) {
			a := newFake("a:7070", "/a", log)
			a.done = []cache.Range{{Start: 0, End: 8}}
			a.fill = func(f *fakeTeacher, call int, r *pb.FillRequest) error {
				return status.Error(codes.FailedPrecondition, "the cache holds k 4, the request asks for k 8")
			}
			return []Worker{a}, plan()
		}},
		{"permanent chunk error", func(log *fillLog) ([]Worker, FillPlan) {
			a := newFake("a:7070", "/a", log)
			a.fill = func(f *fakeTeacher, call int, r *pb.FillRequest) error {
				return status.Error(codes.InvalidArgument, "bad request")
			}
			p := plan()
			p.End = 8
			return []Worker{a}, p
		}},
		{"chunk fails too often", func(log *fillLog) ([]Worker, FillPlan) {
			a := newFake("a:7070", "/a", log)
			a.fill = func(f *fakeTeacher, call int, r *pb.FillRequest) error { return status.Error(codes.Internal, "boom") }
			p := plan()
			p.End, p.MaxChunkFailures = 8, 2
			return []Worker{a}, p
		}},
		{"every teacher gone", func(log *fillLog) ([]Worker, FillPlan) {
			a := newFake("a:7070", "/a", log)
			a.fill = func(f *fakeTeacher, call int, r *pb.FillRequest) error { return unavailable }
			p := plan()
			p.End, p.RetryFor = 16, time.Millisecond
			return []Worker{a}, p
		}},
		{"still missing after the fill", func(log *fillLog) ([]Worker, FillPlan) {
			a := newFake("a:7070", "/a", log)
			a.forget = true
			return []Worker{a}, plan()
		}},
		{"teacher gone before the check", func(log *fillLog) ([]Worker, FillPlan) {
			a := newFake("a:7070", "/a", log)
			a.statusDown = true
			return []Worker{a}, plan()
		}},
		{"every sample empty", func(log *fillLog) ([]Worker, FillPlan) {
			p := plan()
			p.Start, p.End = 16, 18 // sample 16 is dropped, 17 bad
			return []Worker{newFake("a:7070", "/a", log)}, p
		}},
	}
}

// interrupted is the fill whose caller's context ends while a chunk is
// being computed.
func interruptedFill(log *fillLog, cancel context.CancelFunc) ([]Worker, FillPlan) {
	a := newFake("a:7070", "/a", log)
	a.fill = func(f *fakeTeacher, call int, r *pb.FillRequest) error {
		cancel()
		return status.Error(codes.Canceled, "context canceled")
	}
	return []Worker{a}, FillPlan{Dataset: &pb.Dataset{Sources: []*pb.DataSource{{Path: "data.jsonl"}}}, End: 8, LogEvery: time.Hour}
}

var (
	// rates are the output's numbers that depend on the wall time.
	rates = regexp.MustCompile(`\d+ tokens/s|ETA [^ ,\n]+| in [^ ]+ \(`)
	// ticks are progress lines drawn before the last one.
	ticks = regexp.MustCompile(`(\r[^\r\n]*)+(\r[^\r\n]*\n)`)
	// redone names the chunk that two directories hold.
	redone = regexp.MustCompile(`fill: chunk \[\d+, \d+\) in`)
)

// describeFill is everything a fill returned and wrote, in a form that is
// the same on every run: wall-time numbers and intermediate progress
// lines are replaced, and the requests are sorted.
func describeFill(name string, sum *FillSummary, err error, out string, log *fillLog) string {
	var b strings.Builder
	fmt.Fprintf(&b, "== %s\n", name)
	out = rates.ReplaceAllStringFunc(out, func(s string) string {
		switch {
		case strings.HasSuffix(s, "tokens/s"):
			return "R tokens/s"
		case strings.HasPrefix(s, "ETA"):
			return "ETA E"
		}
		return " in T ("
	})
	out = ticks.ReplaceAllString(out, "$2")
	out = redone.ReplaceAllString(out, "fill: chunk [S, E) in")
	fmt.Fprintf(&b, "error: %v\n", err)
	if sum != nil {
		fmt.Fprintf(&b, "summary: samples %d tokens %d targets %d truncated %d dropped %d bad %d reasons %v chunks %d skipped %d retries %d dirs %v dataset %s/%d\n",
			sum.Samples, sum.Tokens, sum.Targets, sum.Truncated, sum.Dropped, sum.BadSkipped, sum.Reasons,
			sum.Chunks, sum.Skipped, sum.Retries, sum.Dirs, sum.DatasetFingerprint, sum.DatasetSamples)
		for _, e := range sum.Examples {
			fmt.Fprintf(&b, "example: %s\n", e)
		}
	}
	sort.Strings(log.reqs)
	for _, r := range log.reqs {
		fmt.Fprintf(&b, "request: %s\n", r)
	}
	fmt.Fprintf(&b, "output:\n%s", out)
	return b.String()
}

// TestFillPinned: fixed fills through fake teachers (one and two, a done
// chunk, a range, a redone chunk, every error RunFill returns) give the
// summary, error, requests and output of testdata/fill_pinned.golden, as
// RunFill gave them before it was split into parts (issue 24). A change of
// a message updates the file: go test ./serve -run TestFillPinned -update.
func TestFillPinned(t *testing.T) {
	var got strings.Builder
	for _, f := range pinnedFills() {
		log := &fillLog{}
		ws, p := f.setup(log)
		var out strings.Builder
		p.Out = &out
		sum, err := RunFill(context.Background(), ws, p)
		got.WriteString(describeFill(f.name, sum, err, out.String(), log))
	}
	log := &fillLog{}
	ctx, cancel := context.WithCancel(context.Background())
	ws, p := interruptedFill(log, cancel)
	var out strings.Builder
	p.Out = &out
	sum, err := RunFill(ctx, ws, p)
	cancel()
	got.WriteString(describeFill("interrupted", sum, err, out.String(), log))

	golden := filepath.Join("testdata", "fill_pinned.golden")
	if *updatePinned {
		os.MkdirAll("testdata", 0o755)
		if err := os.WriteFile(golden, []byte(got.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(golden)
	if err != nil {
		t.Fatal(err)
	}
	if got.String() != string(want) {
		t.Errorf("the fills differ from %s (-update rewrites it):\n%s", golden, lineDiff(string(want), got.String()))
	}
}

// lineDiff lists the lines of want and got that differ, by line number.
func lineDiff(want, got string) string {
	w, g := strings.Split(want, "\n"), strings.Split(got, "\n")
	var b strings.Builder
	for i := 0; i < max(len(w), len(g)); i++ {
		var x, y string
		if i < len(w) {
			x = w[i]
		}
		if i < len(g) {
			y = g[i]
		}
		if x != y {
			fmt.Fprintf(&b, "line %d:\n  want %q\n  got  %q\n", i+1, x, y)
		}
	}
	return b.String()
}

package serve

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"distill/data"
	pb "distill/proto/distill/v1"
)

// TestDatasetSpecRoundTrip: a dataset sent by DatasetSpec is the dataset
// package data opens from the same sources and options: the fingerprints
// agree with every option set (columns, roles and skip_bad did not reach
// the core before, so a fill read other fields than `cachectl tokenize`).
func TestDatasetSpecRoundTrip(t *testing.T) {
	tmp := t.TempDir()
	a := filepath.Join(tmp, "a.txt")
	b := filepath.Join(tmp, "b.txt")
	os.WriteFile(a, []byte(`{"ids":[1,2,3,4,5],"lm":[0,0,1,1,1]}`+"\n"+`{"ids":[7,8]}`+"\n"+`{"ids":"bad"}`+"\n"), 0o644)
	os.WriteFile(b, []byte(`{"ids":[9,9,9]}`+"\n"), 0o644)
	cols := data.ColumnMap{InputIDs: "ids", LossMask: "lm", Roles: map[string]string{"human": "user"}}
	srcs := []data.Source{{Path: a, Format: "jsonl", Weight: 3, Columns: cols}, {Path: b, Format: "jsonl", Weight: 1, Columns: cols}}
	opts := data.Options{MaxLen: 4, Policy: data.Drop, SkipBad: true, NumSamples: 11, Shuffle: true, Seed: 5, NoEOS: true,
		ChatTemplate: "{{ messages }}", TemplateVars: map[string]any{"enable_thinking": false, "n": 2.0}}
	spec, err := DatasetSpec(srcs, opts, true)
	if err != nil {
		t.Fatal(err)
	}
	if err := ValidateDataset(spec); err != nil {
		t.Fatal(err)
	}
	core, err := NewCore(CoreOptions{ModelDir: tinyModel(t), TokenBudget: 300})
	if err != nil {
		t.Fatal(err)
	}
	defer core.Close()
	got, err := core.DescribeDataset(spec)
	if err != nil {
		t.Fatal(err)
	}
	d, err := data.Open(srcs, idsOnly(core.Model().Cfg.VocabSize), opts)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()
	if got.GetFingerprint() != d.Fingerprint() || got.GetSamples() != d.Len() {
		t.Fatalf("the core reads the spec as %d samples, fingerprint %.16s; package data opens it as %d, %.16s",
			got.GetSamples(), got.GetFingerprint(), d.Len(), d.Fingerprint())
	}
	// A role mapping no record can satisfy is refused up front.
	spec.Sources[0].Columns.Roles = map[string]string{"human": "usr"}
	if err := ValidateDataset(spec); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), `"usr"`) {
		t.Errorf("bad role mapping: %v", err)
	}
}

// countsDataset writes pre-tokenized records whose targets start at
// position 4: with max_len 6, lengths 4..5 fit, 7.. are truncated (or
// dropped), and one record is bad.
func countsDataset(t *testing.T, dir string) string {
	var lines []string
	for i := 0; i < 30; i++ {
		if i == 13 {
			lines = append(lines, `{"input_ids":"not a list"}`)
			continue
		}
		n := 5 + i%6
		ids, mask := make([]int, n), make([]int, n)
		for j := range ids {
			ids[j] = 1 + (i*13+j*5)%500
			if j >= 4 {
				mask[j] = 1
			}
		}
		b, _ := json.Marshal(map[string]any{"input_ids": ids, "loss_mask": mask})
		lines = append(lines, string(b))
	}
	p := filepath.Join(dir, "counts.jsonl")
	if err := os.WriteFile(p, []byte(strings.Join(lines, "\n")+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return p
}

// TestFillCountsReachTheClient: the truncated, dropped and skipped counts
// and the targets of every chunk reach RunFill's summary, over gRPC and
// in-process alike, and equal what package data counts for the dataset.
func TestFillCountsReachTheClient(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path := countsDataset(t, tmp)
	for _, policy := range []string{"truncate", "drop"} {
		ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true, MaxLen: 6, Policy: policy, SkipBad: true}
		d, err := data.Open([]data.Source{{Path: path}}, idsOnly(512), data.Options{MaxLen: 6, Policy: data.Policy(policy), SkipBad: true})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := d.Range(context.Background(), 0, d.Len()); err != nil {
			t.Fatal(err)
		}
		want := d.Stats()
		d.Close()
		if want.Truncated+want.Dropped == 0 || want.Skipped != 1 || want.Targets == 0 {
			t.Fatalf("test setup: %+v", want)
		}

		daemon := startDaemon(t, Config{Model: mdir, Cache: t.TempDir(), TokenBudget: 300, DataRoots: []string{tmp}})
		remote, err := Dial(daemon.Addr(), DialOptions{})
		if err != nil {
			t.Fatal(err)
		}
		core, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: t.TempDir(), TokenBudget: 300, InProcess: true})
		if err != nil {
			t.Fatal(err)
		}
		for _, w := range []Worker{remote, Local(core)} {
			var out strings.Builder
			sum, err := RunFill(context.Background(), []Worker{w}, FillPlan{Dataset: ds, ChunkSamples: 7, K: 4, Out: &out})
			w.Close()
			if err != nil {
				t.Fatalf("%s, %s: %v", policy, w.Name(), err)
			}
			if sum.Samples != 30 || sum.Tokens != want.Tokens || sum.Targets != want.Targets || sum.Truncated != want.Truncated ||
				sum.Dropped != want.Dropped || sum.BadSkipped != want.Skipped || fmt.Sprint(sum.Reasons) != fmt.Sprint(want.Reasons) {
				t.Errorf("%s, %s: summary %+v; package data counts %+v", policy, w.Name(), sum, want)
			}
			line := fmt.Sprintf("fill: %d truncated to --max-len, %d dropped, 1 bad records skipped", want.Truncated, want.Dropped)
			// The examples are the first messages in sample order: under
			// truncate the bad record (line 14) comes first, under drop
			// the first over-long record (line 3).
			first := map[string]string{"truncate": "counts.jsonl:14", "drop": "counts.jsonl:3:"}[policy]
			if !strings.Contains(out.String(), line) || !strings.Contains(out.String(), first) {
				t.Errorf("%s, %s: output lacks %q or the first message's line %q:\n%s", policy, w.Name(), line, first, out.String())
			}
		}
	}

	// Every sample empty: an error, over gRPC too.
	daemon := startDaemon(t, Config{Model: mdir, Cache: t.TempDir(), TokenBudget: 300, DataRoots: []string{tmp}})
	remote, err := Dial(daemon.Addr(), DialOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer remote.Close()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true, MaxLen: 4, SkipBad: true}
	sum, err := RunFill(context.Background(), []Worker{remote}, FillPlan{Dataset: ds, K: 4})
	if err == nil || !strings.Contains(err.Error(), "every one of the 30 samples filled is empty") || sum == nil || sum.Dropped != 29 {
		t.Fatalf("all empty: %v, %+v", err, sum)
	}
}

// TestInProcessErrorsNotRetried: an error of the in-process teacher is
// reported once, with its own text (a cache whose chunks/ is a file is
// not an "internal error (see the daemon log)" retried five times).
func TestInProcessErrorsNotRetried(t *testing.T) {
	tmp := t.TempDir()
	path, _ := writeIDsDataset(t, tmp, 10, 20, 512, 1)
	// A cache directory whose chunks/ is a file: the first commit fails.
	notDir := filepath.Join(tmp, "cache")
	os.MkdirAll(notDir, 0o755)
	os.WriteFile(filepath.Join(notDir, "chunks"), nil, 0o644)
	core, err := NewCore(CoreOptions{ModelDir: tinyModel(t), CacheDir: notDir, TokenBudget: 300, InProcess: true})
	if err != nil {
		t.Fatal(err)
	}
	lw := Local(core)
	defer lw.Close()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	sum, err := RunFill(context.Background(), []Worker{lw}, FillPlan{Dataset: ds, ChunkSamples: 4, PerWorker: 1})
	if err == nil || !strings.Contains(err.Error(), "not a directory") || strings.Contains(err.Error(), "daemon") || strings.Contains(err.Error(), "times") {
		t.Fatalf("fill into a file: %v", err)
	}
	if sum == nil || sum.Retries != 0 {
		t.Fatalf("the in-process error was retried: %+v", sum)
	}
}

// TestPermanentErrors: a daemon's request errors are permanent and its
// health errors are not; every in-process error is permanent.
func TestPermanentErrors(t *testing.T) {
	remote, err := Dial("127.0.0.1:1", DialOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer remote.Close()
	lw := &local{}
	for c, perm := range map[codes.Code]bool{
		codes.InvalidArgument: true, codes.FailedPrecondition: true, codes.NotFound: true, codes.OutOfRange: true,
		codes.PermissionDenied: true, codes.Unauthenticated: true, codes.Unimplemented: true,
		codes.Unavailable: false, codes.ResourceExhausted: false, codes.Internal: false, codes.Unknown: false, codes.Aborted: false,
	} {
		err := status.Error(c, "x")
		if permanent(remote, err) != perm {
			t.Errorf("daemon %s: permanent %v, want %v", c, !perm, perm)
		}
		if !permanent(lw, err) {
			t.Errorf("in-process %s: not permanent", c)
		}
	}
}

// reportThenFail is a teacher whose first Fill commits its chunk and
// reports it, then fails as a dropped connection does (Unavailable), and
// whose later Fills fail without doing anything: the chunk goes back to
// the queue and another teacher redoes it. first is closed after that
// first Fill.
type reportThenFail struct {
	named
	calls int
	first chan struct{}
}

func (f *reportThenFail) Fill(ctx context.Context, r *pb.FillRequest, onChunk func(*pb.FillResponse) error) error {
	f.calls++ // one goroutine (PerWorker 1)
	if f.calls > 1 {
		return status.Error(codes.Unavailable, "connection refused")
	}
	defer close(f.first)
	if err := f.named.Fill(ctx, r, onChunk); err != nil {
		return err
	}
	return status.Error(codes.Unavailable, "connection reset after the chunk was reported")
}

// named is a teacher under another name (so not taken for the
// in-process one, whose errors are not retried).
type named struct {
	Worker
	name string
}

func (n named) Name() string { return n.name }

// waitFor is a teacher whose Fills wait until ready is closed, so that
// the other teacher surely takes a chunk first.
type waitFor struct {
	named
	ready chan struct{}
}

func (w waitFor) Fill(ctx context.Context, r *pb.FillRequest, onChunk func(*pb.FillResponse) error) error {
	<-w.ready
	return w.named.Fill(ctx, r, onChunk)
}

// TestFillSummaryCountsRedoneChunkOnce: a chunk that a teacher committed
// and reported, and that was redone by another teacher after the first
// one's Fill failed, counts once in the summary: its samples, tokens,
// targets and chunk are those of the range, not more (before the fix the
// redone chunk was added twice).
func TestFillSummaryCountsRedoneChunkOnce(t *testing.T) {
	mdir := tinyModel(t)
	path, samples := writeIDsDataset(t, t.TempDir(), 16, 10, 512, 8)
	var ws []Worker
	for i := 0; i < 2; i++ {
		c, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: t.TempDir(), TokenBudget: 100})
		if err != nil {
			t.Fatal(err)
		}
		ws = append(ws, named{Local(c), fmt.Sprintf("node%d:7070", i)})
		defer ws[i].Close()
	}
	flaky := &reportThenFail{named: ws[0].(named), first: make(chan struct{})}
	ws[0], ws[1] = flaky, waitFor{ws[1].(named), flaky.first}
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	var out strings.Builder
	sum, err := RunFill(context.Background(), ws, FillPlan{Dataset: ds, ChunkSamples: 4, K: 4, Encoding: "lossless", PerWorker: 1, Out: &out})
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out.String(), "was redone") || sum.Retries < 1 {
		t.Fatalf("test setup: no chunk was redone (retries %d):\n%s", sum.Retries, out.String())
	}
	var tokens int64
	for _, s := range samples {
		tokens += int64(len(s))
	}
	if sum.Samples != 16 || sum.Chunks != 4 || sum.Tokens != tokens || sum.Targets != tokens {
		t.Errorf("summary: %d samples, %d chunks, %d tokens, %d targets; want 16, 4, %d, %d (each chunk once)",
			sum.Samples, sum.Chunks, sum.Tokens, sum.Targets, tokens, tokens)
	}
	if want := fmt.Sprintf("fill: 16 samples, %d tokens, %d targets in 4 chunks", tokens, tokens); !strings.Contains(out.String(), want) {
		t.Errorf("summary line: want %q in\n%s", want, out.String())
	}
}

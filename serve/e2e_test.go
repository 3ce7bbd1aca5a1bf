package serve

import (
	"context"
	"math"
	"strings"
	"sync"
	"testing"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"distill/cache"
	"distill/compute/device"
	"distill/infer"
	pb "distill/proto/distill/v1"
	"google.golang.org/protobuf/proto"
)

// checkAgainstForward opens dirs as one cache, checks that it covers
// exactly [0, n) and that every chunk holds bit for bit what the
// in-process infer.Model.TopK gives for that chunk's samples (lossless
// encoding): the daemon path adds nothing and loses nothing.
func checkAgainstForward(t *testing.T, m *infer.Model, samples [][]int32, k, budget int, dirs ...string) {
	t.Helper()
	for _, d := range dirs {
		rep, err := cache.Check(d, nil)
		if err != nil {
			t.Fatalf("check %s: %v", d, err)
		}
		if !rep.OK() {
			t.Fatalf("check %s: %v", d, rep.Problems)
		}
	}
	r, err := cache.OpenReader(dirs...)
	if err != nil {
		t.Fatal(err)
	}
	if miss := r.Missing(); len(miss) > 0 {
		t.Fatalf("missing ranges %v", miss)
	}
	var covered int64
	for _, ch := range r.Chunks() {
		covered += ch.Len()
		want, err := m.TopK(samples[ch.Start:ch.End], infer.Options{K: k, TokenBudget: budget})
		if err != nil {
			t.Fatal(err)
		}
		for i := ch.Start; i < ch.End; i++ {
			got, err := r.Get(i)
			if err != nil {
				t.Fatal(err)
			}
			w := want[i-ch.Start]
			if len(got.Tokens) != len(samples[i]) {
				t.Fatalf("sample %d: %d tokens, want %d", i, len(got.Tokens), len(samples[i]))
			}
			for j := range w.IDs {
				if got.TopKIDs[j] != w.IDs[j] || math.Float32bits(got.TopKLogProbs[j]) != math.Float32bits(w.LogProbs[j]) {
					t.Fatalf("sample %d entry %d: cache (%d, %v), in-process forward (%d, %v)", i, j, got.TopKIDs[j], got.TopKLogProbs[j], w.IDs[j], w.LogProbs[j])
				}
			}
		}
	}
	if covered != int64(len(samples)) {
		t.Fatalf("chunks cover %d samples, want %d (each exactly once)", covered, len(samples))
	}
}

func TestFillTwoDaemonsMatchesInProcess(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path, samples := writeIDsDataset(t, tmp, 90, 40, 512, 1)
	const budget = 300
	dA, dB := t.TempDir(), t.TempDir()
	a := startDaemon(t, Config{Model: mdir, Cache: dA, TokenBudget: budget, DataRoots: []string{tmp}})
	b := startDaemon(t, Config{Model: mdir, Cache: dB, TokenBudget: budget, DataRoots: []string{tmp}})
	var ws []Worker
	for _, d := range []*Daemon{a, b} {
		w, err := Dial(d.Addr(), DialOptions{})
		if err != nil {
			t.Fatal(err)
		}
		defer w.Close()
		ws = append(ws, w)
	}
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true}
	var out strings.Builder
	perDaemon := map[string]int{}
	var mu sync.Mutex
	plan := FillPlan{Dataset: ds, ChunkSamples: 16, K: 8, Encoding: "lossless", Out: &out,
		onChunk: func(w Worker, r *pb.FillResponse) { mu.Lock(); perDaemon[r.GetCacheDir()]++; mu.Unlock() }}
	sum, err := RunFill(context.Background(), ws, plan)
	if err != nil {
		t.Fatal(err)
	}
	if sum.Samples != 90 || sum.Chunks != 6 || len(sum.Dirs) != 2 {
		t.Fatalf("summary %+v", sum)
	}
	if perDaemon[dA] == 0 || perDaemon[dB] == 0 {
		t.Errorf("both daemons should have worked: %v", perDaemon)
	}
	m := a.Core().Model()
	checkAgainstForward(t, m, samples, 8, budget, dA, dB)
	if !strings.Contains(out.String(), dA) || !strings.Contains(out.String(), "90 samples") {
		t.Errorf("summary does not say where: %s", out.String())
	}

	// Re-running is a no-op: every chunk is found done.
	sum, err = RunFill(context.Background(), ws, plan)
	if err != nil || sum.Chunks != 0 || sum.Samples != 0 {
		t.Fatalf("re-run: %+v, %v", sum, err)
	}

	// The in-process teacher (cachectl fill --model) writes the same bytes
	// of top-k when the chunks are the same.
	dC := t.TempDir()
	core, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: dC, TokenBudget: budget})
	if err != nil {
		t.Fatal(err)
	}
	lw := Local(core)
	defer lw.Close()
	if _, err := RunFill(context.Background(), []Worker{lw}, plan); err != nil {
		t.Fatal(err)
	}
	checkAgainstForward(t, m, samples, 8, budget, dC)
}

func TestScoreMatchesForward(t *testing.T) {
	mdir := tinyModel(t)
	d := startDaemon(t, Config{Model: mdir})
	cl, conn := dialTeacher(t, d.Addr(), "")
	defer conn.Close()
	st, err := cl.Score(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	m, err := infer.Load(mdir, device.CPU(0))
	if err != nil {
		t.Fatal(err)
	}
	_, samples := writeIDsDataset(t, t.TempDir(), 5, 30, 512, 3)
	for i, s := range samples {
		// One sample at a time on an idle daemon: a forward of that sample
		// alone, so bit-identical to the in-process forward.
		if err := st.Send(&pb.ScoreRequest{Id: int64(100 + i), Tokens: s, K: proto.Int32(5)}); err != nil {
			t.Fatal(err)
		}
		r, err := st.Recv()
		if err != nil {
			t.Fatal(err)
		}
		want, _ := m.TopK([][]int32{s}, infer.Options{K: 5})
		if r.GetId() != int64(100+i) || r.GetK() != 5 || len(r.GetIds()) != len(s)*5 {
			t.Fatalf("response id %d k %d len %d", r.GetId(), r.GetK(), len(r.GetIds()))
		}
		for j := range want[0].IDs {
			if r.GetIds()[j] != want[0].IDs[j] || r.GetLogprobs()[j] != want[0].LogProbs[j] {
				t.Fatalf("sample %d entry %d: got (%d,%v) want (%d,%v)", i, j, r.GetIds()[j], r.GetLogprobs()[j], want[0].IDs[j], want[0].LogProbs[j])
			}
		}
	}
	st.CloseSend()
	if _, err := st.Recv(); status.Code(err) != codes.OK && err.Error() != "EOF" {
		t.Fatalf("end of stream: %v", err)
	}
}

// TestFillKeepsDroppedRecordsEmpty: with max_len and policy drop, the
// records the data layer drops become empty rows at their own indexes, and
// every other sample holds what the forward gives for the chunk's remaining
// samples packed the same way.
func TestFillKeepsDroppedRecordsEmpty(t *testing.T) {
	mdir := tinyModel(t)
	tmp := t.TempDir()
	path, samples := writeIDsDataset(t, tmp, 40, 40, 512, 3)
	const budget, maxLen = 300, 20
	dir := t.TempDir()
	core, err := NewCore(CoreOptions{ModelDir: mdir, CacheDir: dir, TokenBudget: budget})
	if err != nil {
		t.Fatal(err)
	}
	lw := Local(core)
	defer lw.Close()
	ds := &pb.Dataset{Sources: []*pb.DataSource{{Path: path}}, Pretokenized: true, MaxLen: maxLen, Policy: "drop"}
	var out strings.Builder
	if _, err := RunFill(context.Background(), []Worker{lw}, FillPlan{Dataset: ds, ChunkSamples: 16, K: 8, Encoding: "lossless", Out: &out}); err != nil {
		t.Fatal(err)
	}
	r, err := cache.OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	m := core.Model()
	dropped := 0
	for _, ch := range r.Chunks() {
		var live [][]int32
		for i := ch.Start; i < ch.End; i++ {
			if len(samples[i]) <= maxLen {
				live = append(live, samples[i])
			}
		}
		want, err := m.TopK(live, infer.Options{K: 8, TokenBudget: budget})
		if err != nil {
			t.Fatal(err)
		}
		li := 0
		for i := ch.Start; i < ch.End; i++ {
			got, err := r.Get(i)
			if err != nil {
				t.Fatal(err)
			}
			if len(samples[i]) > maxLen {
				dropped++
				if len(got.Tokens) != 0 {
					t.Fatalf("sample %d (%d tokens > max_len %d) should be an empty row, has %d tokens", i, len(samples[i]), maxLen, len(got.Tokens))
				}
				continue
			}
			w := want[li]
			li++
			if len(got.Tokens) != len(samples[i]) {
				t.Fatalf("sample %d: %d tokens, want %d", i, len(got.Tokens), len(samples[i]))
			}
			for j := range w.IDs {
				if got.TopKIDs[j] != w.IDs[j] || math.Float32bits(got.TopKLogProbs[j]) != math.Float32bits(w.LogProbs[j]) {
					t.Fatalf("sample %d entry %d: cache (%d, %v), forward (%d, %v)", i, j, got.TopKIDs[j], got.TopKLogProbs[j], w.IDs[j], w.LogProbs[j])
				}
			}
		}
	}
	if dropped == 0 {
		t.Fatal("test setup: no sample exceeds max_len")
	}
}

// TestCombineDuplicates: the same range in two directories (a chunk
// committed by a teacher that died before reporting it, then redone) is
// reported, not fatal, and counted once; a partial overlap is an error.
func TestCombineDuplicates(t *testing.T) {
	done, dups, err := combine(map[string][]cache.Range{
		"/a": {{Start: 0, End: 16}, {Start: 16, End: 32}},
		"/b": {{Start: 16, End: 32}, {Start: 32, End: 40}},
	}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(done) != 3 || done[1] != (cache.Range{Start: 16, End: 32}) || done[2] != (cache.Range{Start: 32, End: 40}) {
		t.Fatalf("done = %v", done)
	}
	if len(dups) != 1 || !strings.Contains(dups[0], "[16, 32) in /a and /b") {
		t.Fatalf("dups = %v", dups)
	}
	if miss := cache.MissingOf(done, cache.Range{Start: 0, End: 40}); len(miss) != 0 {
		t.Fatalf("missing %v", miss)
	}
	_, _, err = combine(map[string][]cache.Range{"/a": {{Start: 0, End: 16}}, "/b": {{Start: 8, End: 24}}}, nil)
	if err == nil || !strings.Contains(err.Error(), "different chunk boundaries") || !strings.Contains(err.Error(), "[8, 16)") {
		t.Fatalf("partial overlap: err = %v", err)
	}
}

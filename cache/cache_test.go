package cache

import (
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"distill/cache/cachetest"

	badger "github.com/dgraph-io/badger/v4"
)

// Small caches for the behaviour tests: deterministic content per index so
// that a reopened cache can be compared with what was written.
const (
	tV = 3000
	tK = 8
)

func testManifest(samples int64, enc Encoding) Manifest {
	return Manifest{TeacherFingerprint: "teacher-A", TokenizerFingerprint: "tok-A", DatasetFingerprint: "data-A",
		VocabSize: tV, K: tK, Temperature: 1, Samples: samples, Encoding: enc}
}

func testSample(i int64) Sample {
	g := cachetest.New(tV, tK, "bpe", uint64(i)+100)
	g.Exact = 600 // fast; the tail still enters the log-sum-exp
	gs := g.Sample(3 + int(i%11))
	return Sample{Index: i, Tokens: gs.Tokens, Mask: gs.Mask, TopKIDs: gs.TopKIDs, TopKLogProbs: gs.TopKLogProbs}
}

func fillRange(t testing.TB, c *Cache, a, b int64) {
	t.Helper()
	w, err := c.BeginChunk(a, b)
	if err != nil {
		t.Fatal(err)
	}
	for i := a; i < b; i++ {
		if err := w.Add(testSample(i)); err != nil {
			t.Fatal(err)
		}
	}
	if err := w.Commit(); err != nil {
		t.Fatal(err)
	}
}

func sameSample(t testing.TB, got, want Sample) {
	t.Helper()
	if got.Index != want.Index || len(got.Tokens) != len(want.Tokens) || len(got.TopKIDs) != len(want.TopKIDs) {
		t.Fatalf("sample %d: got index %d, %d tokens, %d entries; want %d tokens, %d entries", want.Index, got.Index, len(got.Tokens), len(got.TopKIDs), len(want.Tokens), len(want.TopKIDs))
	}
	for p := range want.Tokens {
		if got.Tokens[p] != want.Tokens[p] || got.Mask[p] != want.Mask[p] {
			t.Fatalf("sample %d position %d: token/mask (%d,%d), want (%d,%d)", want.Index, p, got.Tokens[p], got.Mask[p], want.Tokens[p], want.Mask[p])
		}
	}
	for e := range want.TopKIDs {
		if got.TopKIDs[e] != want.TopKIDs[e] || math.Float32bits(got.TopKLogProbs[e]) != math.Float32bits(want.TopKLogProbs[e]) {
			t.Fatalf("sample %d entry %d: (%d, %v), want (%d, %v)", want.Index, e, got.TopKIDs[e], got.TopKLogProbs[e], want.TopKIDs[e], want.TopKLogProbs[e])
		}
	}
}

func mustCheck(t testing.TB, dir string) *CheckReport {
	t.Helper()
	rep, err := Check(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !rep.OK() {
		t.Fatalf("check %s: %d problems:\n%s", dir, len(rep.Problems), strings.Join(rep.Problems, "\n"))
	}
	return rep
}

func TestWriteReadMissingRefill(t *testing.T) {
	dir := t.TempDir()
	c, err := Create(dir, testManifest(50, EncodingLossless), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fillRange(t, c, 0, 10)
	fillRange(t, c, 10, 25)
	fillRange(t, c, 30, 40)
	miss, err := c.Missing(0, 50)
	if err != nil {
		t.Fatal(err)
	}
	if want := []Range{{25, 30}, {40, 50}}; len(miss) != 2 || miss[0] != want[0] || miss[1] != want[1] {
		t.Fatalf("Missing = %v, want %v", miss, want)
	}
	if _, err := c.BeginChunk(10, 25); !errors.Is(err, ErrRangeDone) {
		t.Fatalf("re-filling a done range: err %v, want ErrRangeDone", err)
	}
	if _, err := c.BeginChunk(20, 30); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "[10, 25)") {
		t.Fatalf("partly overlapping range: err %v, want ErrInvalid naming [10, 25)", err)
	}
	if _, err := c.BeginChunk(45, 51); !errors.Is(err, ErrInvalid) {
		t.Fatalf("range past samples: err %v", err)
	}
	// A second writer that races for the same range is refused while the
	// first claims it (TestClaims). One that claims nothing (a writer of
	// an older build: here a ChunkWriter made without BeginChunk) finds
	// its later commit a no-op, and the range exists once.
	w1, err := c.BeginChunk(25, 30)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.BeginChunk(25, 30); !errors.Is(err, ErrRangeBusy) {
		t.Fatalf("a range claimed by another ChunkWriter: %v, want ErrRangeBusy", err)
	}
	w2 := &ChunkWriter{c: c, r: Range{25, 30}, release: func() {}}
	for i := int64(25); i < 30; i++ {
		w1.Add(testSample(i))
		w2.Add(testSample(i))
	}
	if err := w1.Commit(); err != nil {
		t.Fatal(err)
	}
	if err := w2.Commit(); err != nil {
		t.Fatalf("second commit of the same range: %v, want a no-op", err)
	}
	rep := mustCheck(t, dir)
	if rep.Chunks != 4 || rep.Samples != 40 {
		t.Fatalf("check: %d chunks %d samples, want 4 and 40", rep.Chunks, rep.Samples)
	}
	r, err := OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	for i := int64(0); i < 50; i++ {
		s, err := r.Get(i)
		if (i >= 30 && i < 40) || i < 30 {
			if err != nil {
				t.Fatal(err)
			}
			sameSample(t, s, testSample(i))
		} else if !errors.Is(err, ErrNotFound) {
			t.Fatalf("Get(%d) of a missing sample: %v, want ErrNotFound", i, err)
		}
	}
}

// TestMissingOf: the gaps of want between sorted chunks, with chunks that
// overlap one another or reach beyond want, and the same gaps whether
// the chunks are Ranges, ChunkInfos or ReaderChunks.
func TestMissingOf(t *testing.T) {
	for _, tc := range []struct {
		chunks []Range
		want   Range
		miss   []Range
	}{
		{nil, Range{0, 10}, []Range{{0, 10}}},
		{[]Range{{0, 10}}, Range{0, 10}, nil},
		{[]Range{{2, 4}, {6, 8}}, Range{0, 10}, []Range{{0, 2}, {4, 6}, {8, 10}}},
		{[]Range{{0, 5}, {8, 20}}, Range{3, 12}, []Range{{5, 8}}},         // chunks beyond want
		{[]Range{{0, 6}, {2, 4}, {5, 9}}, Range{0, 12}, []Range{{9, 12}}}, // overlapping chunks
		{[]Range{{0, 3}, {20, 30}}, Range{5, 10}, []Range{{5, 10}}},       // none inside want
		{[]Range{{0, 3}}, Range{5, 5}, nil},                               // empty want
	} {
		infos := make([]ChunkInfo, len(tc.chunks))
		rcs := make([]ReaderChunk, len(tc.chunks))
		for i, r := range tc.chunks {
			infos[i] = ChunkInfo{Range: r, File: fmt.Sprint(i)}
			rcs[i] = ReaderChunk{ChunkInfo: infos[i], Dir: "d"}
		}
		for what, got := range map[string][]Range{"Range": MissingOf(tc.chunks, tc.want), "ChunkInfo": MissingOf(infos, tc.want), "ReaderChunk": MissingOf(rcs, tc.want)} {
			if !slices.Equal(got, tc.miss) || (got == nil) != (tc.miss == nil) {
				t.Errorf("MissingOf(%s %v, %v) = %v, want %v", what, tc.chunks, tc.want, got, tc.miss)
			}
		}
	}
}

func TestAddRejectsBadSamples(t *testing.T) {
	c, err := Create(t.TempDir(), testManifest(10, EncodingCompact), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	cases := []struct {
		name string
		edit func(s *Sample)
		want string
	}{
		{"index", func(s *Sample) { s.Index = 3 }, "want 0"},
		{"mask", func(s *Sample) { s.Mask = s.Mask[1:] }, "loss mask has"},
		{"ids", func(s *Sample) { s.TopKIDs = s.TopKIDs[1:] }, "want T*K"},
		{"vocab", func(s *Sample) { s.TopKIDs[5] = tV }, "outside vocab"},
		{"token", func(s *Sample) { s.Tokens[1] = -1 }, "token -1 at position 1"},
		{"dup", func(s *Sample) { s.TopKIDs[1] = s.TopKIDs[0] }, "appears in slots 0 and 1"},
		{"nan", func(s *Sample) { s.TopKLogProbs[2] = float32(math.NaN()) }, "NaN"},
		{"order", func(s *Sample) { s.TopKLogProbs[0], s.TopKLogProbs[1] = s.TopKLogProbs[1], s.TopKLogProbs[0] }, "not sorted"},
		{"mass", func(s *Sample) {
			for j := 0; j < tK; j++ {
				s.TopKLogProbs[j] = -0.5
			}
		}, "sum to"},
	}
	for _, tc := range cases {
		w, err := c.BeginChunk(0, 1)
		if err != nil {
			t.Fatal(err)
		}
		s := testSample(0)
		tc.edit(&s)
		err = w.Add(s)
		if !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "sample") {
			t.Errorf("%s: err %v, want ErrInvalid containing %q", tc.name, err, tc.want)
		}
		w.Abort()
	}
}

func TestManifestMismatchAndMultiDir(t *testing.T) {
	a, b, bad := t.TempDir(), t.TempDir(), t.TempDir()
	ca, err := Create(a, testManifest(40, EncodingLossless), nil)
	if err != nil {
		t.Fatal(err)
	}
	fillRange(t, ca, 0, 10)
	ca.Close()
	cb, err := Create(b, testManifest(40, EncodingLossless), nil)
	if err != nil {
		t.Fatal(err)
	}
	fillRange(t, cb, 10, 20)
	fillRange(t, cb, 0, 10) // the same range in both directories: allowed
	cb.Close()
	for _, tc := range []struct {
		edit  func(m *Manifest)
		field string
	}{
		{func(m *Manifest) { m.K = 16 }, "field k "},
		{func(m *Manifest) { m.TokenizerFingerprint = "tok-B" }, "field tokenizer_fingerprint"},
		{func(m *Manifest) { m.VocabSize = 5000 }, "field vocab_size"},
	} {
		m := testManifest(40, EncodingLossless)
		tc.edit(&m)
		_, err := Create(a, m, nil)
		if !errors.Is(err, ErrManifestMismatch) || !strings.Contains(err.Error(), tc.field) {
			t.Errorf("Create on a cache with another manifest: %v, want ErrManifestMismatch naming %q", err, tc.field)
		}
		m2 := testManifest(40, EncodingLossless)
		tc.edit(&m2)
		d := filepath.Join(bad, m2.TokenizerFingerprint+"-"+string(rune('a'+m2.K)))
		cx, err := Create(d, m2, nil)
		if err != nil {
			t.Fatal(err)
		}
		cx.Close()
		_, err = OpenReader(a, d)
		if !errors.Is(err, ErrManifestMismatch) || !strings.Contains(err.Error(), tc.field) || !strings.Contains(err.Error(), d) {
			t.Errorf("OpenReader of disagreeing dirs: %v, want ErrManifestMismatch naming %q and %s", err, tc.field, d)
		}
	}
	r, err := OpenReader(a, b)
	if err != nil {
		t.Fatal(err)
	}
	if r.Samples() != 20 || len(r.Chunks()) != 2 {
		t.Fatalf("two dirs as one: %d samples in %d chunks, want 20 in 2", r.Samples(), len(r.Chunks()))
	}
	for i := int64(0); i < 20; i++ {
		s, err := r.Get(i)
		if err != nil {
			t.Fatal(err)
		}
		sameSample(t, s, testSample(i))
	}
	if miss := r.Missing(); len(miss) != 1 || miss[0] != (Range{20, 40}) {
		t.Fatalf("Missing = %v", miss)
	}
}

func TestIterShardedShuffled(t *testing.T) {
	dir := t.TempDir()
	c, err := Create(dir, testManifest(64, EncodingCompact), nil)
	if err != nil {
		t.Fatal(err)
	}
	for a := int64(0); a < 61; a += 7 {
		fillRange(t, c, a, min(a+7, 61))
	}
	c.Close()
	r, err := OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	order := func(seed uint64, rank, world int) []int64 {
		it, err := r.Iter(IterOptions{Seed: seed, Rank: rank, World: world, Window: 2, ReadAhead: 1})
		if err != nil {
			t.Fatal(err)
		}
		defer it.Close()
		var out []int64
		for it.Next() {
			s := it.Sample()
			if len(s.TopKIDs) != len(s.Tokens)*tK {
				t.Fatalf("sample %d: %d entries for %d tokens", s.Index, len(s.TopKIDs), len(s.Tokens))
			}
			out = append(out, s.Index)
		}
		if it.Err() != nil {
			t.Fatal(it.Err())
		}
		return out
	}
	seen := map[int64]int{}
	for rank := 0; rank < 3; rank++ {
		o := order(5, rank, 3)
		if len(o) != 61/3 {
			t.Fatalf("rank %d got %d samples, want %d", rank, len(o), 61/3)
		}
		for _, i := range o {
			seen[i]++
		}
	}
	if len(seen) != 60 {
		t.Fatalf("3 ranks saw %d distinct samples, want 60 (61 minus the remainder)", len(seen))
	}
	for i, n := range seen {
		if n != 1 || i < 0 || i >= 61 {
			t.Fatalf("sample %d seen %d times", i, n)
		}
	}
	all1, all2, other := order(5, 0, 1), order(5, 0, 1), order(6, 0, 1)
	if len(all1) != 61 || strings.Join(fmtInts(all1), ",") != strings.Join(fmtInts(all2), ",") {
		t.Fatal("same seed gave a different order")
	}
	if strings.Join(fmtInts(all1), ",") == strings.Join(fmtInts(other), ",") {
		t.Fatal("another seed gave the same order")
	}
	inOrder := 0
	for i := 1; i < len(all1); i++ {
		if all1[i] == all1[i-1]+1 {
			inOrder++
		}
	}
	if inOrder > len(all1)/3 {
		t.Fatalf("order barely shuffled: %v", all1)
	}
	seq, err := r.Iter(IterOptions{Sequential: true})
	if err != nil {
		t.Fatal(err)
	}
	for i := int64(0); seq.Next(); i++ {
		if seq.Sample().Index != i {
			t.Fatalf("sequential: got %d at %d", seq.Sample().Index, i)
		}
	}
	seq.Close()
}

func fmtInts(v []int64) []string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = string(rune('0' + x%64))
	}
	return s
}

func TestCorruptionIsReported(t *testing.T) {
	for _, kind := range []string{"flip", "truncate", "missing"} {
		t.Run(kind, func(t *testing.T) {
			dir := t.TempDir()
			c, err := Create(dir, testManifest(20, EncodingCompact), nil)
			if err != nil {
				t.Fatal(err)
			}
			fillRange(t, c, 0, 10)
			fillRange(t, c, 10, 20)
			c.Close()
			path := filepath.Join(dir, chunksDir, chunkFileName(Range{10, 20}))
			data, _ := os.ReadFile(path)
			switch kind {
			case "flip":
				data[len(data)/2] ^= 0x10
				os.WriteFile(path, data, 0o644)
			case "truncate":
				os.WriteFile(path, data[:len(data)-100], 0o644)
			case "missing":
				os.Remove(path)
			}
			r, err := OpenReader(dir)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := r.Get(3); err != nil {
				t.Fatalf("the intact chunk must stay readable: %v", err)
			}
			_, err = r.Get(15)
			if !errors.Is(err, ErrCorrupt) || !strings.Contains(err.Error(), chunkFileName(Range{10, 20})) || !strings.Contains(err.Error(), "[10, 20)") {
				t.Fatalf("Get from a %s chunk: %v, want ErrCorrupt naming the chunk and its samples", kind, err)
			}
			it, _ := r.Iter(IterOptions{Seed: 1})
			for it.Next() {
			}
			if !errors.Is(it.Err(), ErrCorrupt) {
				t.Fatalf("Iter over a %s chunk: %v, want ErrCorrupt", kind, it.Err())
			}
			it.Close()
			rep, err := Check(dir, nil)
			if err != nil {
				t.Fatal(err)
			}
			if rep.OK() || !strings.Contains(strings.Join(rep.Problems, "\n"), chunkFileName(Range{10, 20})) {
				t.Fatalf("Check of a %s chunk: problems %q", kind, rep.Problems)
			}
		})
	}
}

// TestConcurrentWritersInProcess: goroutines fill ranges of one Cache at
// once (two of them race for every range) while readers open and iterate;
// every range ends up committed exactly once: the loser of a race sees
// the range done or claimed (ErrRangeBusy). Run with -race.
func TestConcurrentWritersInProcess(t *testing.T) {
	dir := t.TempDir()
	const n, chunk = 24, 3
	c, err := Create(dir, testManifest(n, EncodingCompact), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	var wg sync.WaitGroup
	errs := make(chan error, 100)
	for g := 0; g < 4; g++ {
		wg.Add(1)
		go func(g int) {
			defer wg.Done()
			for a := int64(g%2) * chunk; a < n; a += 2 * chunk { // goroutines g and g+2 race
				w, err := c.BeginChunk(a, a+chunk)
				if errors.Is(err, ErrRangeDone) || errors.Is(err, ErrRangeBusy) {
					continue // done, or the other goroutine's claim: it commits it
				}
				if err != nil {
					errs <- err
					return
				}
				for i := a; i < a+chunk; i++ {
					if err := w.Add(testSample(i)); err != nil {
						errs <- err
						return
					}
				}
				if err := w.Commit(); err != nil {
					errs <- err
					return
				}
			}
		}(g)
	}
	wg.Add(1)
	go func() {
		defer wg.Done()
		for k := 0; k < 5; k++ {
			r, err := OpenReader(dir)
			if err != nil {
				errs <- err
				return
			}
			it, err := r.Iter(IterOptions{Seed: uint64(k)})
			if err != nil {
				errs <- err
				return
			}
			for it.Next() {
			}
			if it.Err() != nil {
				errs <- it.Err()
			}
			it.Close()
		}
	}()
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	rep := mustCheck(t, dir)
	if rep.Chunks != n/chunk || rep.Samples != n {
		t.Fatalf("%d chunks, %d samples; want %d, %d", rep.Chunks, rep.Samples, n/chunk, n)
	}
}

func TestOpenNonCache(t *testing.T) {
	dir := t.TempDir()
	if _, err := OpenReader(dir); !errors.Is(err, ErrNotCache) || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), "has no index/") {
		t.Fatalf("OpenReader of an empty dir: %v, want ErrNotCache naming it and its missing index", err)
	}
	if _, err := Open(filepath.Join(dir, "nope"), nil); !errors.Is(err, ErrNotCache) || !strings.Contains(err.Error(), "nope does not exist") {
		t.Fatalf("Open of a missing dir: %v, want ErrNotCache saying that it does not exist", err)
	}
	if _, err := Check(dir, nil); !errors.Is(err, ErrNotCache) {
		t.Fatalf("Check of an empty dir: %v, want ErrNotCache", err)
	}
	m := testManifest(10, "fancy")
	if _, err := Create(dir, m, nil); !errors.Is(err, ErrInvalid) || !strings.Contains(err.Error(), "encoding") {
		t.Fatalf("Create with a bad encoding: %v", err)
	}
}

// TestEmptySamplesRoundTrip: a sample with no tokens (a record the data
// layer dropped or skipped) is stored as an empty row, anywhere in a chunk,
// in both encodings, and reads back empty; verify accepts it.
func TestEmptySamplesRoundTrip(t *testing.T) {
	for _, enc := range []Encoding{EncodingCompact, EncodingLossless} {
		dir := t.TempDir()
		c, err := Create(dir, testManifest(7, enc), nil)
		if err != nil {
			t.Fatal(err)
		}
		empty := map[int64]bool{0: true, 3: true, 4: true, 6: true}
		w, err := c.BeginChunk(0, 7)
		if err != nil {
			t.Fatal(err)
		}
		for i := int64(0); i < 7; i++ {
			s := testSample(i)
			if empty[i] {
				s = Sample{Index: i}
			}
			if err := w.Add(s); err != nil {
				t.Fatalf("%s: add sample %d: %v", enc, i, err)
			}
		}
		if err := w.Commit(); err != nil {
			t.Fatal(err)
		}
		c.Close()
		mustCheck(t, dir)
		r, err := OpenReader(dir)
		if err != nil {
			t.Fatal(err)
		}
		for i := int64(0); i < 7; i++ {
			got, err := r.Get(i)
			if err != nil {
				t.Fatal(err)
			}
			if empty[i] {
				if len(got.Tokens)+len(got.Mask)+len(got.TopKIDs)+len(got.TopKLogProbs) != 0 || got.Index != i {
					t.Fatalf("%s: sample %d should be empty, got %+v", enc, i, got)
				}
				continue
			}
			want := testSample(i)
			if len(got.Tokens) != len(want.Tokens) || got.Tokens[0] != want.Tokens[0] || got.TopKIDs[len(got.TopKIDs)-1] != want.TopKIDs[len(want.TopKIDs)-1] {
				t.Fatalf("%s: sample %d differs after empty neighbours", enc, i)
			}
		}
	}
}

// commitDuringReadDir is an FS for Check whose ReadDir of chunks/ first lets
// a writer commit a chunk: a commit that lands between Check's index read
// and its directory listing. ReadDir goes on once the commit is done (Check
// did not keep it out) or once it waits for the lock (testHookLockBusy:
// Check holds it), whichever comes first; no time decides which.
type commitDuringReadDir struct {
	FS
	commit func() error
	errs   chan error
	busy   chan struct{} // closed when the commit finds the lock held
}

func (f *commitDuringReadDir) ReadDir(d string) ([]string, error) {
	if f.commit != nil && filepath.Base(d) == chunksDir {
		commit := f.commit
		f.commit = nil
		done := make(chan error, 1)
		go func() { done <- commit() }()
		select {
		case err := <-done:
			f.errs <- err
		case <-f.busy: // blocked on the lock Check holds
			go func() { f.errs <- <-done }()
		}
	}
	return f.FS.ReadDir(d)
}

// TestCheckWhileFilling: verify run while a fill commits must not report the
// newly committed chunk as an unreferenced file.
func TestCheckWhileFilling(t *testing.T) {
	dir := t.TempDir()
	c, err := Create(dir, testManifest(10, EncodingCompact), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fillRange(t, c, 0, 5)
	busy := make(chan struct{})
	var once sync.Once
	testHookLockBusy = func(exclusive bool) {
		if exclusive {
			once.Do(func() { close(busy) })
		}
	}
	defer func() { testHookLockBusy = nil }()
	fs := &commitDuringReadDir{FS: OSFS, errs: make(chan error, 1), busy: busy, commit: func() error {
		w, err := c.BeginChunk(5, 10)
		if err != nil {
			return err
		}
		for i := int64(5); i < 10; i++ {
			if err := w.Add(testSample(i)); err != nil {
				return err
			}
		}
		return w.Commit()
	}}
	rep, err := Check(dir, &Options{FS: fs, LockTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	if err := <-fs.errs; err != nil {
		t.Fatal(err)
	}
	if !rep.OK() {
		t.Fatalf("check during a fill reported:\n%s", strings.Join(rep.Problems, "\n"))
	}
	mustCheck(t, dir)
}

// TestEmptyMemtableDebris: a writer killed while Badger created a memtable
// leaves a 0-byte .mem file; a reader's read-only open then fails inside
// Badger ("truncate ...: invalid argument"). Readers and writers must
// recover (the file holds no data) and see every committed range.
func TestEmptyMemtableDebris(t *testing.T) {
	dir := t.TempDir()
	c, err := Create(dir, testManifest(32, EncodingCompact), nil)
	if err != nil {
		t.Fatal(err)
	}
	fillRange(t, c, 0, 16)
	c.Close()
	for _, name := range []string{"00007.mem", "000099.vlog"} {
		if err := os.WriteFile(filepath.Join(dir, "index", name), nil, 0o644); err != nil {
			t.Fatal(err)
		}
		r, err := OpenReader(dir)
		if err != nil {
			t.Fatalf("reader after an empty %s: %v", name, err)
		}
		if got, err := r.Get(15); err != nil || got.Index != 15 {
			t.Fatalf("sample 15 after recovery: %v, %v", got.Index, err)
		}
	}
	c, err = Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	fillRange(t, c, 16, 32)
	c.Close()
	mustCheck(t, dir)
}

// TestChunkEntriesBounded: a chunk whose positions x k would pass the
// int32 offsets of its Arrow list columns is refused at the Add that
// crosses the limit (lowered here), with an error naming the sample and
// the fix; nothing is committed, and smaller chunks of the same range fill.
func TestChunkEntriesBounded(t *testing.T) {
	defer func(v int64) { MaxChunkEntries = v }(MaxChunkEntries)
	MaxChunkEntries = 45 * tK // samples 0..6 have 3..9 tokens: 42 positions; sample 7 (10) brings 52
	dir := t.TempDir()
	c, err := Create(dir, testManifest(10, EncodingLossless), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	w, err := c.BeginChunk(0, 10)
	if err != nil {
		t.Fatal(err)
	}
	var addErr error
	for i := int64(0); i < 10 && addErr == nil; i++ {
		addErr = w.Add(testSample(i))
	}
	if !errors.Is(addErr, ErrInvalid) || !strings.Contains(addErr.Error(), "sample 7") || !strings.Contains(addErr.Error(), "--chunk") {
		t.Fatalf("Add past the entry limit: %v, want ErrInvalid naming sample 7 and --chunk", addErr)
	}
	w.Abort()
	var samples []Sample
	for i := int64(0); i < 10; i++ {
		samples = append(samples, testSample(i))
	}
	m := c.Manifest()
	if _, err := encodeChunk(&m, Range{0, 10}, samples); !errors.Is(err, ErrInvalid) {
		t.Fatalf("encodeChunk past the entry limit: %v, want ErrInvalid", err)
	}
	if rs, _ := c.Chunks(); len(rs) != 0 {
		t.Fatalf("committed after a refused chunk: %v", rs)
	}
	fillRange(t, c, 0, 5)
	fillRange(t, c, 5, 8)
	fillRange(t, c, 8, 10)
	mustCheck(t, dir)
	r, err := OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	for i := int64(0); i < 10; i++ {
		s, err := r.Get(i)
		if err != nil {
			t.Fatal(err)
		}
		sameSample(t, s, testSample(i))
	}
}

// TestFailedFirstFillDoesNotBindManifest: a fill that fails before its
// first commit leaves the directory free for a fill of another dataset
// (before the fix: "manifest mismatch: dataset_fingerprint" forever, with
// 0 chunks written). From the first committed chunk on, the manifest is
// fixed, and of two writers racing on an empty cache the first to commit
// wins.
func TestFailedFirstFillDoesNotBindManifest(t *testing.T) {
	mA := testManifest(12, EncodingLossless)
	mB := testManifest(20, EncodingLossless)
	mB.DatasetFingerprint, mB.K = "data-B", tK
	dir := t.TempDir()
	c, err := Create(dir, mA, nil)
	if err != nil {
		t.Fatal(err)
	}
	w, err := c.BeginChunk(0, 4)
	if err != nil {
		t.Fatal(err)
	}
	w.Add(testSample(0))
	w.Abort() // the fill failed on a bad record
	c.Close()

	c, err = Create(dir, mB, nil) // the fixed dataset: another fingerprint
	if err != nil {
		t.Fatalf("Create after a fill that committed nothing: %v (the empty cache must take the new manifest)", err)
	}
	fillRange(t, c, 0, 4)
	c.Close()
	if r, err := OpenReader(dir); err != nil || r.Manifest() != withVersion(mB) {
		t.Fatalf("reader after the second fill: %v, manifest %+v", err, r.Manifest())
	}
	_, err = Create(dir, mA, nil)
	if !errors.Is(err, ErrManifestMismatch) || !strings.Contains(err.Error(), "dataset_fingerprint") || !strings.Contains(err.Error(), "1 committed chunks") {
		t.Fatalf("Create with another dataset after a commit: %v, want ErrManifestMismatch naming dataset_fingerprint and the committed chunk", err)
	}

	// Two writers on an empty cache: both open, the first commit wins.
	dir = t.TempDir()
	cA, err := Create(dir, mA, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cA.Close()
	cB, err := Create(dir, mB, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer cB.Close()
	wA, err := cA.BeginChunk(0, 2)
	if err != nil {
		t.Fatal(err)
	}
	wB, err := cB.BeginChunk(2, 4)
	if err != nil {
		t.Fatal(err)
	}
	for i := int64(0); i < 2; i++ {
		wA.Add(testSample(i))
		wB.Add(testSample(i + 2))
	}
	if err := wA.Commit(); err != nil {
		t.Fatalf("first commit, under a manifest another writer replaced since: %v", err)
	}
	if err := wB.Commit(); !errors.Is(err, ErrManifestMismatch) {
		t.Fatalf("commit under a manifest the first commit overruled: %v, want ErrManifestMismatch", err)
	}
	if _, err := cB.BeginChunk(4, 6); !errors.Is(err, ErrManifestMismatch) {
		t.Fatalf("BeginChunk under an overruled manifest: %v, want ErrManifestMismatch before any work", err)
	}
	r, err := OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	if r.Manifest() != withVersion(mA) || r.Samples() != 2 {
		t.Fatalf("after the race: manifest %+v, %d samples; want A's, 2", r.Manifest(), r.Samples())
	}
	mustCheck(t, dir)
}

// TestUseSwitchesEmptyCache: a daemon keeps one Cache open and calls Use
// per request; a request that failed before committing does not lock the
// directory to its manifest.
func TestUseSwitchesEmptyCache(t *testing.T) {
	mA := testManifest(12, EncodingLossless)
	mB := testManifest(20, EncodingLossless)
	mB.DatasetFingerprint = "data-B"
	dir := t.TempDir()
	root, err := Create(dir, mA, nil)
	if err != nil {
		t.Fatal(err)
	}
	if h, err := root.Use(mA); err != nil || h != root {
		t.Fatalf("Use of the same manifest: %v, %p want the root %p", err, h, root)
	}
	hB, err := root.Use(mB) // request A failed: B may take the directory
	if err != nil {
		t.Fatal(err)
	}
	if m, _, err := root.Current(); err != nil || m.DatasetFingerprint != "data-B" {
		t.Fatalf("Current after Use(B): %+v, %v", m, err)
	}
	fillRange(t, hB, 0, 3)
	hB.Close() // a no-op: the root owns the temporary directory
	if _, err := root.Use(mA); !errors.Is(err, ErrManifestMismatch) || !strings.Contains(err.Error(), "dataset_fingerprint") {
		t.Fatalf("Use of A after B committed: %v, want ErrManifestMismatch naming dataset_fingerprint", err)
	}
	fillRange(t, hB, 3, 6)
	tmp := root.ws.tmp
	if err := root.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(tmp); !os.IsNotExist(err) {
		t.Fatalf("root Close left its temporary directory: %v", err)
	}
	r, err := OpenReader(dir)
	if err != nil || r.Samples() != 6 || r.Manifest().DatasetFingerprint != "data-B" {
		t.Fatalf("reader: %v", err)
	}
	mustCheck(t, dir)
}

func withVersion(m Manifest) Manifest {
	m.FormatVersion = FormatVersion
	return m
}

// TestReset: an empty cache resets and takes any manifest after; a cache
// with committed chunks is refused unless forced, and nothing of it is
// lost; a cache open by a writer is refused.
func TestReset(t *testing.T) {
	if _, err := Reset(t.TempDir(), false, nil); !errors.Is(err, ErrNotCache) {
		t.Fatalf("Reset of a plain directory: %v, want ErrNotCache", err)
	}
	dir := t.TempDir()
	c, err := Create(dir, testManifest(12, EncodingLossless), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Reset(dir, true, nil); !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), "in use by another process") {
		t.Fatalf("Reset while a writer has the cache open: %v, want ErrLocked", err)
	}
	c.Close()
	rep, err := Reset(dir, false, nil)
	if err != nil || rep.Manifest.DatasetFingerprint != "data-A" || rep.Chunks != 0 {
		t.Fatalf("Reset of an empty cache: %+v, %v", rep, err)
	}
	if _, err := OpenReader(dir); !errors.Is(err, ErrNotCache) {
		t.Fatalf("OpenReader after Reset: %v, want ErrNotCache", err)
	}

	m := testManifest(12, EncodingLossless)
	m.DatasetFingerprint = "data-B"
	c, err = Create(dir, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	fillRange(t, c, 0, 4)
	c.Close()
	_, err = Reset(dir, false, nil)
	if !errors.Is(err, ErrCommitted) || !strings.Contains(err.Error(), "1 committed chunks (4 samples") || !strings.Contains(err.Error(), "--force") {
		t.Fatalf("Reset of a cache with chunks: %v, want ErrCommitted naming them and --force", err)
	}
	if rep := mustCheck(t, dir); rep.Samples != 4 {
		t.Fatalf("after a refused Reset: %d samples, want 4", rep.Samples)
	}
	rep, err = Reset(dir, true, nil)
	if err != nil || rep.Chunks != 1 || rep.Samples != 4 || len(rep.Files) != 2 {
		t.Fatalf("forced Reset: %+v, %v", rep, err)
	}
	for _, sub := range []string{indexDir, chunksDir, tmpDir} {
		ents, _ := os.ReadDir(filepath.Join(dir, sub))
		if len(ents) != 0 {
			t.Fatalf("%s/ after a forced Reset: %d entries", sub, len(ents))
		}
	}
}

// TestResetInUseWithChunks: a cache with committed chunks that a writer
// has open is refused, without --force as with it, because it is in use,
// not because of its chunks: before, the first refusal said to pass
// --force, and --force was then refused for the writer.
func TestResetInUseWithChunks(t *testing.T) {
	dir := t.TempDir()
	c, err := Create(dir, testManifest(12, EncodingLossless), nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	fillRange(t, c, 0, 4)
	for _, force := range []bool{false, true} {
		_, err := Reset(dir, force, nil)
		if !errors.Is(err, ErrLocked) || errors.Is(err, ErrCommitted) || !strings.Contains(err.Error(), "in use by another process") ||
			!strings.Contains(err.Error(), "stop that fill") || strings.Contains(err.Error(), "--force") {
			t.Fatalf("Reset(force=%v) of a cache with chunks open by a writer: %v, want ErrLocked saying it is in use and to stop the fill, not --force", force, err)
		}
	}
	if rep := mustCheck(t, dir); rep.Samples != 4 {
		t.Fatalf("after the refused resets: %d samples, want 4", rep.Samples)
	}
}

// TestResetStoppedLeavesIndexLost: a reset that stops after moving the
// index away (a crash, here an injected error) leaves chunk files and no
// index. The next Create took the directory for a new cache and its GC
// removed the files; it now refuses it (ErrIndexLost), as it does a
// directory whose index/ was deleted, and only a forced Reset finishes
// removing them.
func TestResetStoppedLeavesIndexLost(t *testing.T) {
	dir := t.TempDir()
	m := testManifest(12, EncodingLossless)
	c, err := Create(dir, m, nil)
	if err != nil {
		t.Fatal(err)
	}
	fillRange(t, c, 0, 4)
	fillRange(t, c, 4, 8)
	c.Close()
	ffs := &faultFS{}
	ffs.arm(1, errInjected) // the sync after the index's rename
	if _, err := Reset(dir, true, &Options{FS: ffs}); !errors.Is(err, errInjected) {
		t.Fatalf("Reset with a failing sync: %v", err)
	}
	files := func() int { ents, _ := os.ReadDir(filepath.Join(dir, chunksDir)); return len(ents) }
	if n := files(); n != 2 {
		t.Fatalf("the stopped reset left %d chunk files, want 2", n)
	}
	for name, f := range map[string]func() error{
		"Create": func() error {
			c, err := Create(dir, m, nil)
			if err == nil {
				c.Close()
			}
			return err
		},
		"Open":       func() error { _, err := Open(dir, nil); return err },
		"OpenReader": func() error { _, err := OpenReader(dir); return err },
		"Repair":     func() error { _, err := Repair(dir, nil); return err },
		"Reset":      func() error { _, err := Reset(dir, false, nil); return err },
	} {
		if err := f(); !errors.Is(err, ErrIndexLost) || !strings.Contains(err.Error(), "chunks/ holds 2 files") {
			t.Errorf("%s after the stopped reset: %v, want ErrIndexLost naming the 2 files", name, err)
		}
		if n := files(); n != 2 {
			t.Fatalf("%s after the stopped reset left %d chunk files, want 2", name, n)
		}
	}
	rep, err := Reset(dir, true, nil)
	if err != nil || !rep.IndexLost || len(rep.Files) < 2 || files() != 0 {
		t.Fatalf("forced Reset of the lost index: %+v, %v; %d chunk files left", rep, err, files())
	}
	c, err = Create(dir, m, nil)
	if err != nil {
		t.Fatalf("Create after the forced Reset: %v", err)
	}
	c.Close()
}

// TestRepair: Check finds a damaged chunk, a missing one, missing sample
// keys and a stray one; a fill cannot redo the bad ranges (they are
// "done"); Repair drops exactly the bad chunks and fixes the keys; Check
// is clean; a fill recomputes exactly the dropped ranges; the content is
// the original one. An unreadable (not corrupt) chunk stops Repair with
// nothing dropped.
func TestRepair(t *testing.T) {
	dir := t.TempDir()
	c, err := Create(dir, testManifest(40, EncodingLossless), nil)
	if err != nil {
		t.Fatal(err)
	}
	for a := int64(0); a < 20; a += 5 {
		fillRange(t, c, a, a+5)
	}
	c.Close()
	flip := filepath.Join(dir, chunksDir, chunkFileName(Range{5, 10}))
	data, _ := os.ReadFile(flip)
	data[len(data)/2] ^= 0x10
	os.WriteFile(flip, data, 0o644)
	os.Remove(filepath.Join(dir, chunksDir, chunkFileName(Range{15, 20})))
	s, err := openIndex(dir, true, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	err = s.db.Update(func(txn *badger.Txn) error {
		if err := txn.Delete(sampleKey(2)); err != nil {
			return err
		}
		return txn.Set(sampleKey(30), sampleValue(30, 0))
	})
	s.close()
	if err != nil {
		t.Fatal(err)
	}
	if rep, err := Check(dir, nil); err != nil || len(rep.Problems) != 4 {
		t.Fatalf("Check of the damaged cache: %v, problems %q; want 4", err, rep.Problems)
	}
	c, err = Open(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := c.BeginChunk(5, 10); !errors.Is(err, ErrRangeDone) {
		t.Fatalf("BeginChunk of a damaged range before repair: %v (the bug: fill skips it as done)", err)
	}

	// A read error that is not corruption drops nothing.
	ffs := &faultFS{}
	ffs.arm(0, errInjected)
	if _, err := Repair(dir, &Options{FS: ffs}); !errors.Is(err, errInjected) || !strings.Contains(err.Error(), "nothing was changed") {
		t.Fatalf("Repair with an unreadable chunk: %v, want the read error and nothing changed", err)
	}
	if rs, _ := c.Chunks(); len(rs) != 4 {
		t.Fatalf("a failed Repair dropped records: %d left, want 4", len(rs))
	}

	rep, err := Repair(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	var dropped []Range
	for _, d := range rep.Dropped {
		dropped = append(dropped, d.Range)
	}
	if fmt.Sprint(dropped) != "[[5, 10) [15, 20)]" || rep.Rekeyed != 1 || rep.StrayKeys != 1 || rep.Checked != 4 {
		t.Fatalf("Repair: dropped %v, rekeyed %d, stray %d, checked %d; want [5,10) [15,20), 1, 1, 4", dropped, rep.Rekeyed, rep.StrayKeys, rep.Checked)
	}
	if !strings.Contains(strings.Join(rep.Problems, "\n"), "checksum") || !strings.Contains(strings.Join(rep.Problems, "\n"), "missing") {
		t.Fatalf("Repair problems %q: want the checksum and the missing file", rep.Problems)
	}
	if fmt.Sprint(rep.Files) != "["+filepath.Join(chunksDir, chunkFileName(Range{5, 10}))+"]" {
		t.Fatalf("Repair removed %q, want the damaged chunk's file", rep.Files)
	}
	mustCheck(t, dir)
	miss, err := c.Missing(0, 40)
	if err != nil || fmt.Sprint(miss) != "[[5, 10) [15, 40)]" {
		t.Fatalf("Missing after repair: %v, %v", miss, err)
	}
	fillRange(t, c, 5, 10)
	fillRange(t, c, 15, 20)
	if rep := mustCheck(t, dir); rep.Samples != 20 {
		t.Fatalf("after refill: %d samples, want 20", rep.Samples)
	}
	r, err := OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	for i := int64(0); i < 20; i++ {
		got, err := r.Get(i)
		if err != nil {
			t.Fatal(err)
		}
		sameSample(t, got, testSample(i))
	}
}

// TestLockHeldSaysWhat: a lock held past the timeout (a fill, teacherd or
// reset stopped mid-commit) names the lock file, what holds it and how to
// find it, not only the API's Options.LockTimeout.
func TestLockHeldSaysWhat(t *testing.T) {
	dir := t.TempDir()
	held, err := lockDir(dir, true, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer held.unlock()
	_, err = lockDir(dir, false, time.Millisecond)
	lock := filepath.Join(dir, lockName)
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), lock+" held by another process") ||
		!strings.Contains(err.Error(), "a fill, teacherd or reset of this cache") || !strings.Contains(err.Error(), "lsof "+lock) {
		t.Fatalf("a held lock: %v", err)
	}
}

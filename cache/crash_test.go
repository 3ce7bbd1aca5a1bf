package cache

import (
	"bufio"
	"errors"
	"fmt"
	badger "github.com/dgraph-io/badger/v4"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// TestMain doubles as the helper process of the multi-process tests: when
// CACHE_TEST_HELPER is set, the test binary fills a cache instead of
// running tests (re-exec of os.Args[0], the usual Go pattern); when
// CACHE_TEST_READONLY is set, it runs readOnlyChecks on that directory.
func TestMain(m *testing.M) {
	if dir := os.Getenv("CACHE_TEST_READONLY"); dir != "" {
		if err := readOnlyChecks(dir); err != nil {
			fmt.Fprintln(os.Stderr, "read-only helper:", err)
			os.Exit(3)
		}
		os.Exit(0)
	}
	if spec := os.Getenv("CACHE_TEST_HELPER"); spec != "" {
		if err := helperFill(spec); err != nil {
			fmt.Fprintln(os.Stderr, "helper:", err)
			os.Exit(3)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// helperFill: spec is "dir samples chunk gated". It fills every missing
// chunk-aligned range, printing "committed A B" after each commit; gated
// ("1"), it then waits for a line on stdin before it goes on, so that the
// parent acts while the writer is alive between two commits.
func helperFill(spec string) error {
	f := strings.Fields(spec)
	if f[0] == "hold" { // commit [0,2), then die inside an index session
		c, err := Create(f[1], testManifest(10, EncodingCompact), nil)
		if err != nil {
			return err
		}
		w, _ := c.BeginChunk(0, 2)
		w.Add(testSample(0))
		w.Add(testSample(1))
		if err := w.Commit(); err != nil {
			return err
		}
		s, err := openIndex(f[1], true, time.Minute)
		if err != nil {
			return err
		}
		s.db.Update(func(txn *badger.Txn) error { return txn.Set([]byte("x"), []byte("y")) })
		fmt.Println("committed 0 2")
		time.Sleep(time.Hour)
	}
	dir := f[0]
	n, _ := strconv.ParseInt(f[1], 10, 64)
	chunk, _ := strconv.ParseInt(f[2], 10, 64)
	var stdin *bufio.Reader
	if f[3] == "1" {
		stdin = bufio.NewReader(os.Stdin)
	}
	c, err := Create(dir, testManifest(n, EncodingCompact), nil)
	if err != nil {
		return err
	}
	defer c.Close()
	for a := int64(0); a < n; a += chunk {
		b := min(a+chunk, n)
		w, err := c.BeginChunk(a, b)
		if errors.Is(err, ErrRangeDone) {
			continue
		}
		if err != nil {
			return err
		}
		for i := a; i < b; i++ {
			if err := w.Add(testSample(i)); err != nil {
				return err
			}
		}
		if err := w.Commit(); err != nil {
			return err
		}
		fmt.Printf("committed %d %d\n", a, b)
		if stdin != nil {
			if _, err := stdin.ReadString('\n'); err != nil {
				return fmt.Errorf("waiting for the go-ahead after [%d, %d): %w", a, b, err)
			}
		}
	}
	return nil
}

type helper struct {
	cmd  *exec.Cmd
	in   io.WriteCloser // gated helpers: a line lets it commit the next chunk
	mu   sync.Mutex
	done []Range
	line chan Range
	wait chan error
}

func startHelper(t *testing.T, dir string, n, chunk int64, gated bool) *helper {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	g := 0
	if gated {
		g = 1
	}
	cmd.Env = append(os.Environ(), fmt.Sprintf("CACHE_TEST_HELPER=%s %d %d %d", dir, n, chunk, g))
	cmd.Stderr = os.Stderr
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	h := &helper{cmd: cmd, in: in, line: make(chan Range, 1000), wait: make(chan error, 1)}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			var r Range
			if _, err := fmt.Sscanf(sc.Text(), "committed %d %d", &r.Start, &r.End); err == nil {
				h.mu.Lock()
				h.done = append(h.done, r)
				h.mu.Unlock()
				h.line <- r
			}
		}
		close(h.line)
		h.wait <- cmd.Wait()
	}()
	return h
}

// next lets a gated helper commit its next chunk.
func (h *helper) next(t *testing.T) {
	if _, err := fmt.Fprintln(h.in); err != nil {
		t.Fatalf("letting the writer go on: %v", err)
	}
}

func (h *helper) committed() []Range {
	h.mu.Lock()
	defer h.mu.Unlock()
	return append([]Range(nil), h.done...)
}

// TestCrashKill kills a filling process with SIGKILL at random instants,
// reopens the cache each time and checks that verify passes, that no
// partial chunk is visible and that every range the process reported as
// committed is there; then a last run completes the cache and every range
// exists exactly once with the right content. CACHE_CRASH_KILLS raises the
// number of kills (default 20).
func TestCrashKill(t *testing.T) {
	kills := 20
	if v, err := strconv.Atoi(os.Getenv("CACHE_CRASH_KILLS")); err == nil {
		kills = v
	}
	const n, chunk = 150, 3
	dir := t.TempDir()
	rng := rand.New(rand.NewPCG(42, 0))
	var before int
	gcRemoved, tmpLeft := 0, 0
	for k := 0; k < kills; k++ {
		// Kill after a random number of commits (0-2) plus a random delay,
		// so kills land in open, GC, encoding, the tmp write, the rename
		// and the index update alike.
		h := startHelper(t, dir, n, chunk, false)
		for w := rng.IntN(3); w > 0; w-- {
			if _, ok := <-h.line; !ok {
				break
			}
		}
		time.Sleep(time.Duration(rng.IntN(120)) * time.Millisecond)
		h.cmd.Process.Signal(syscall.SIGKILL)
		for range h.line {
		}
		<-h.wait
		if m, _ := filepath.Glob(filepath.Join(dir, tmpDir, "*", "*"+tmpFileExt)); len(m) > 0 {
			tmpLeft++ // killed while writing or publishing a chunk
		}
		if k%2 == 1 {
			// A reader first: its read-only open meets the crashed
			// writer's torn log and must recover the index itself.
			if r, err := OpenReader(dir); err == nil {
				for _, c := range h.committed() {
					if !r.Has(c.Start) {
						t.Fatalf("kill %d: reader does not see committed %v", k, c)
					}
				}
			} else if !errors.Is(err, ErrNotCache) {
				t.Fatalf("kill %d: reader after a crash: %v\n%s", k, err, lsIndex(dir))
			}
		}
		c, err := Open(dir, nil)
		if errors.Is(err, ErrNotCache) {
			continue // killed before the index was created
		}
		if err != nil {
			t.Fatalf("kill %d: reopen: %v", k, err)
		}
		rep, _ := c.GC() // Open already ran GC: nothing may be left
		gcRemoved += len(rep.Files)
		chunks, err := c.Chunks()
		c.Close()
		if err != nil {
			t.Fatal(err)
		}
		mustCheck(t, dir)
		have := map[Range]bool{}
		for _, ci := range chunks {
			if ci.Start%chunk != 0 || ci.End != min(ci.Start+chunk, n) {
				t.Fatalf("kill %d: chunk %v is not a whole fill range", k, ci.Range)
			}
			have[ci.Range] = true
		}
		for _, r := range h.committed() {
			if !have[r] {
				t.Fatalf("kill %d: range %v was reported committed but is not in the cache", k, r)
			}
		}
		if len(chunks) < before {
			t.Fatalf("kill %d: %d chunks, had %d before", k, len(chunks), before)
		}
		full := before < n/chunk && len(chunks) == n/chunk
		before = len(chunks)
		if full {
			t.Logf("cache complete after %d kills; later kills only hit open/GC", k+1)
		}
	}
	t.Logf("%d of %d ranges committed across %d kills (%d kills left a half-written chunk file, readers recovered a torn index %d times); a second GC found %d leftovers", before, n/chunk, kills, tmpLeft, indexRecoveries.Load(), gcRemoved)
	if gcRemoved != 0 {
		t.Errorf("GC after reopen still found %d leftover files", gcRemoved)
	}
	h := startHelper(t, dir, n, chunk, false)
	if err := <-h.wait; err != nil {
		t.Fatalf("resume: %v", err)
	}
	rep := mustCheck(t, dir)
	if rep.Chunks != n/chunk || rep.Samples != n {
		t.Fatalf("after resume: %d chunks, %d samples; want %d, %d", rep.Chunks, rep.Samples, n/chunk, n)
	}
	r, err := OpenReader(dir)
	if err != nil {
		t.Fatal(err)
	}
	for i := int64(0); i < n; i++ {
		s, err := r.Get(i)
		if err != nil {
			t.Fatal(err)
		}
		w := testSample(i)
		if len(s.Tokens) != len(w.Tokens) || s.Tokens[len(w.Tokens)-1] != w.Tokens[len(w.Tokens)-1] || s.TopKIDs[5] != w.TopKIDs[5] {
			t.Fatalf("sample %d content differs after crashes and resume", i)
		}
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, tmpDir)); len(ents) != 0 {
		t.Fatalf("tmp/ not cleaned: %d entries", len(ents))
	}
}

// TestReaderAfterWriterDiedInIndex: a writer killed while it holds the
// index open leaves Badger's log torn, which Badger's read-only mode
// refuses; the reader recovers it and sees the committed range.
func TestReaderAfterWriterDiedInIndex(t *testing.T) {
	dir := t.TempDir()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "CACHE_TEST_HELPER=hold "+dir)
	out, _ := cmd.StdoutPipe()
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	line, _ := bufio.NewReader(out).ReadString('\n')
	if line != "committed 0 2\n" {
		t.Fatalf("helper said %q", line)
	}
	cmd.Process.Signal(syscall.SIGKILL)
	cmd.Wait()
	before := indexRecoveries.Load()
	r, err := OpenReader(dir)
	if err != nil {
		t.Fatalf("reader after a writer died inside the index: %v", err)
	}
	if indexRecoveries.Load() != before+1 {
		t.Errorf("the reader did not go through index recovery (%d recoveries)", indexRecoveries.Load()-before)
	}
	if _, err := r.Get(1); err != nil {
		t.Fatal(err)
	}
	mustCheck(t, dir)
}

// TestConcurrentReaderProcess: one process fills while this one opens
// readers; every reader sees every range committed before it opened, with
// the right content, and verify passes while the writer runs. The writer
// waits after each commit: verify runs while it is alive with its cache
// open, then it is let go and each reader's open races its next commit.
func TestConcurrentReaderProcess(t *testing.T) {
	const n, chunk = 40, 4
	dir := t.TempDir()
	h := startHelper(t, dir, n, chunk, true)
	seen := 0
	for r := range h.line {
		if seen == 3 {
			mustCheck(t, dir)
		}
		// Taken before the open: a range committed after it may be
		// missing from the reader, one committed before may not.
		before := h.committed()
		h.next(t)
		rd, err := OpenReader(dir)
		if err != nil {
			t.Fatalf("reader opened while the writer runs: %v", err)
		}
		for _, c := range before {
			if !rd.Has(c.Start) || !rd.Has(c.End-1) {
				t.Fatalf("reader opened after %v was committed does not see it", c)
			}
		}
		s, err := rd.Get(r.Start)
		if err != nil {
			t.Fatal(err)
		}
		sameSampleCompact(t, s, testSample(r.Start))
		seen++
	}
	if err := <-h.wait; err != nil {
		t.Fatal(err)
	}
	if seen != n/chunk {
		t.Fatalf("saw %d commits, want %d", seen, n/chunk)
	}
}

func sameSampleCompact(t *testing.T, got, want Sample) {
	t.Helper()
	if len(got.TopKIDs) != len(want.TopKIDs) {
		t.Fatalf("sample %d: %d entries, want %d", want.Index, len(got.TopKIDs), len(want.TopKIDs))
	}
	for e := range want.TopKIDs {
		d := got.TopKLogProbs[e] - want.TopKLogProbs[e]
		if got.TopKIDs[e] != want.TopKIDs[e] || d > 1.0/128+1e-5 || d < -1.0/128-1e-5 {
			t.Fatalf("sample %d entry %d: (%d, %v), want (%d, %v)", want.Index, e, got.TopKIDs[e], got.TopKLogProbs[e], want.TopKIDs[e], want.TopKLogProbs[e])
		}
	}
}

// faultFS fails the failAt-th operation (counting from 0 after arm) with
// err, once; every other operation goes to the OS.
type faultFS struct {
	mu     sync.Mutex
	armed  bool
	n      int
	failAt int
	err    error
	what   string
}

var errInjected = errors.New("injected I/O error")

func (f *faultFS) arm(at int, err error) {
	f.mu.Lock()
	f.armed, f.n, f.failAt, f.err, f.what = true, 0, at, err, ""
	f.mu.Unlock()
}

func (f *faultFS) op(name string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	if !f.armed {
		return nil
	}
	f.n++
	if f.n-1 == f.failAt {
		f.what = name
		return f.err
	}
	return nil
}

type faultFile struct {
	File
	fs *faultFS
}

func (f faultFile) Write(p []byte) (int, error) {
	if err := f.fs.op("write"); err != nil {
		n := len(p) / 2 // a short write, as a full disk gives
		f.File.Write(p[:n])
		return n, err
	}
	return f.File.Write(p)
}
func (f faultFile) Sync() error {
	if err := f.fs.op("sync"); err != nil {
		return err
	}
	return f.File.Sync()
}
func (f faultFile) Close() error {
	if err := f.fs.op("close"); err != nil {
		f.File.Close()
		return err
	}
	return f.File.Close()
}
func (f *faultFS) Create(name string) (File, error) {
	if err := f.op("create"); err != nil {
		return nil, err
	}
	fl, err := OSFS.Create(name)
	if err != nil {
		return nil, err
	}
	return faultFile{fl, f}, nil
}
func (f *faultFS) ReadFile(name string) ([]byte, error) {
	if err := f.op("readfile"); err != nil {
		return nil, err
	}
	return OSFS.ReadFile(name)
}
func (f *faultFS) Stat(name string) (int64, error) { return OSFS.Stat(name) }
func (f *faultFS) Rename(o, n string) error {
	if err := f.op("rename"); err != nil {
		return err
	}
	return OSFS.Rename(o, n)
}
func (f *faultFS) Remove(name string) error           { return OSFS.Remove(name) }
func (f *faultFS) RemoveAll(name string) error        { return OSFS.RemoveAll(name) }
func (f *faultFS) MkdirAll(dir string) error          { return OSFS.MkdirAll(dir) }
func (f *faultFS) ReadDir(d string) ([]string, error) { return OSFS.ReadDir(d) }
func (f *faultFS) SyncDir(dir string) error {
	if err := f.op("syncdir"); err != nil {
		return err
	}
	return OSFS.SyncDir(dir)
}

// TestFaultInjection fails each I/O operation of a commit in turn (and
// ENOSPC on the write): the commit returns the error, nothing becomes
// visible, verify passes, and a retry succeeds.
func TestFaultInjection(t *testing.T) {
	for _, inj := range []error{errInjected, syscall.ENOSPC} {
		dir := t.TempDir()
		ffs := &faultFS{}
		c, err := Create(dir, testManifest(20, EncodingCompact), &Options{FS: ffs})
		if err != nil {
			t.Fatal(err)
		}
		fillRange(t, c, 0, 5)
		failures := 0
		for at := 0; ; at++ {
			w, err := c.BeginChunk(5, 10)
			if err != nil {
				t.Fatal(err)
			}
			for i := int64(5); i < 10; i++ {
				w.Add(testSample(i))
			}
			ffs.arm(at, inj)
			err = w.Commit()
			ffs.mu.Lock()
			ffs.armed = false
			what := ffs.what
			ffs.mu.Unlock()
			if what == "" { // the commit has fewer operations than at
				if err != nil {
					t.Fatal(err)
				}
				break
			}
			failures++
			if !errors.Is(err, inj) || !strings.Contains(err.Error(), "[5, 10)") {
				t.Fatalf("failing op %d (%s): commit returned %v, want the injected error naming the range", at, what, err)
			}
			mustCheck(t, dir)
			miss, _ := c.Missing(0, 10)
			if len(miss) != 1 || miss[0] != (Range{5, 10}) {
				t.Fatalf("failing op %d (%s): Missing = %v, the failed range must stay missing", at, what, miss)
			}
			if ents, _ := os.ReadDir(c.ws.tmp); len(ents) != 1 { // owner.lock only
				t.Fatalf("failing op %d (%s): %d files left in the writer's tmp dir", at, what, len(ents))
			}
		}
		if failures < 5 { // create, write, sync, close, rename, syncdir
			t.Fatalf("only %d operations were failed", failures)
		}
		rep := mustCheck(t, dir)
		if rep.Samples != 10 {
			t.Fatalf("%d samples after the retry, want 10", rep.Samples)
		}
		c.Close()
	}
}

func lsIndex(dir string) string {
	ents, _ := os.ReadDir(filepath.Join(dir, indexDir))
	var b strings.Builder
	for _, e := range ents {
		fi, _ := e.Info()
		fmt.Fprintf(&b, "%s %d\n", e.Name(), fi.Size())
	}
	return b.String()
}

